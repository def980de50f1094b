"""Plain text for pretraining: documents joined by EOS and cut into fixed-length blocks."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import torch

from litft.data.base import json_problem, DataModule, PreparedData, split_train_val

from litft.data.samples import Sample
from litft.errors import LitftError

TEXT_SUFFIXES = (".txt", ".md", ".jsonl")


def read_documents(path: Path) -> List[str]:
    """Documents from a .txt file (the whole file), a .jsonl file ("text" per line), or a folder of them."""
    if not path.exists():
        raise LitftError(f"text data {path} does not exist; pass a .txt or .jsonl file or a folder of them")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise LitftError(f"folder {path} holds no {'/'.join(TEXT_SUFFIXES)} files")
        return [doc for f in files for doc in read_documents(f)]
    if path.suffix != ".jsonl":
        return [path.read_text(encoding="utf-8")]
    documents = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise LitftError(f"{path}:{number} is not valid JSON ({json_problem(err)}); fix that line") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise LitftError(f"{path}:{number} has no string field 'text'; each line must be {{\"text\": ...}}")
        documents.append(record["text"])
    return documents


def document_ids(tokenizer, document: str) -> List[int]:
    """A document's tokens and the EOS that ends it."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return tokenizer(document, add_special_tokens=False)["input_ids"] + eos


def blocks(tokenizer, documents: List[str], block_size: int, first_id: int = 0) -> List[Sample]:
    """Tokenize, join with EOS, and cut into blocks; the short tail is dropped."""
    return cut_blocks([document_ids(tokenizer, doc) for doc in documents], block_size, first_id)


def cut_blocks(documents: List[List[int]], block_size: int, first_id: int = 0) -> List[Sample]:
    """Token lists joined end to end and cut into blocks of ``block_size``; the short tail is dropped."""
    tokens = torch.tensor([t for doc in documents for t in doc], dtype=torch.long)
    n_blocks = len(tokens) // block_size
    return [
        {"input_ids": chunk, "labels": chunk.clone(), "id": torch.tensor(first_id + i)}
        for i, chunk in enumerate(tokens[: n_blocks * block_size].view(n_blocks, block_size))
    ]


@dataclass
class TextFiles(DataModule):
    """Plain text for pretraining: .txt files, a folder of them, or JSONL with a "text" field."""

    train_data_path: Path = Path("data/train")
    """A .txt or .jsonl file, or a folder searched for them."""
    val_data_path: Optional[Path] = None
    """Validation text; without it val_split_fraction of the documents is held out."""
    val_split_fraction: float = 0.05
    """Share of documents held out for validation when val_data_path is not given."""
    max_seq_length: Optional[int] = 512
    """Tokens in one training block."""

    def source_files(self):
        paths = []
        for root in (self.train_data_path, self.val_data_path):
            if root is not None and root.exists():
                paths += sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        return paths

    def tokenize(self, tokenizer, seed: int) -> PreparedData:
        documents = read_documents(self.train_data_path)
        if self.val_data_path is not None:
            train_docs, val_docs = documents, read_documents(self.val_data_path)
        else:
            train_docs, val_docs = split_train_val(documents, self.val_split_fraction, seed)
        size = self.effective_max_length(tokenizer)
        train = blocks(tokenizer, train_docs, size)
        if not train:
            raise LitftError(f"{self.train_data_path} holds fewer than {size} tokens; add text or lower --data.max_seq_length")
        # Validation ids follow the training ids so that every block has a unique id.
        return PreparedData(train=train, val=blocks(tokenizer, val_docs, size, first_id=len(train)), scoring=[])
