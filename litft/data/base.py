"""What every ``--data`` choice is and gives: tokenized samples, split into train and validation, cached once."""

import hashlib
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from litft.config import at_least, fraction
from litft.data.samples import Sample, pack
from litft.errors import LitftError

# Bump when tokenization, masking or packing changes, so old caches are not reused.
CACHE_VERSION = 3



def litft_home() -> Path:
    """Where litft keeps its caches (tokenized data, the built tiny model)."""
    return Path(os.environ.get("LITFT_HOME", Path.home() / ".cache" / "litft"))


@dataclass
class Prompted:
    """One instruction example kept as text, for scoring a model by generation."""

    prompt_ids: List[int]
    reference: str


@dataclass
class PreparedData:
    train: List[Sample]
    val: List[Sample]
    scoring: List[Prompted]
    notes: List[str] = field(default_factory=list)  # what tokenizing changed (pairs cut or dropped), for the run's first screen


class DataModule:
    """Base of every ``--data`` choice: subclasses are dataclasses whose fields are the flags.

    ``prepare`` tokenizes on rank 0 first (others then read its cache), so a big
    corpus is tokenized once per machine and not once per process.
    """

    max_seq_length: Optional[int] = None
    packing: bool = False

    def check(self) -> None:
        """The data flags' own checks, made with the other flags' before any file is read."""
        at_least(self.max_seq_length, 1, "--data.max_seq_length", "for the tokenizer's limit")
        if hasattr(self, "val_split_fraction"):
            fraction(self.val_split_fraction, "--data.val_split_fraction", "the share held out for validation,")

    def tokenize(self, tokenizer, seed: int) -> PreparedData:  # pragma: no cover - abstract
        raise NotImplementedError

    def source_files(self) -> List[Path]:
        """Files whose contents the tokenized cache depends on."""
        return []

    def names_images(self) -> bool:
        """Whether the records carry images, told before the model is built: a composite folder whose causal-LM class is its
        text model alone (Qwen3.5) builds its image-text model only for image records (litft.model.vision)."""
        return False

    def config_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]

    def cache_key(self, tokenizer, seed: int, source: str = "") -> str:
        """What the tokenized data depends on; ``source`` is a fingerprint of data read by another library."""
        digest = hashlib.sha256()
        digest.update(f"{type(self).__name__}:{source}".encode())
        digest.update(json.dumps(self.config_dict(), sort_keys=True).encode())
        digest.update(f"{seed}:{self.effective_max_length(tokenizer)}:{CACHE_VERSION}".encode())
        digest.update(tokenizer_fingerprint(tokenizer).encode())
        for path in self.source_files():
            stat = path.stat()
            digest.update(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        return digest.hexdigest()[:20]

    def load_or_tokenize(self, tokenizer, seed: int, source: str = "") -> PreparedData:
        """Tokenize once and keep the result in ``$LITFT_HOME/datasets``; later runs read it. ``source``: as for ``cache_key``."""
        cache = litft_home() / "datasets" / f"{type(self).__name__.lower()}-{self.cache_key(tokenizer, seed, source)}.pt"
        if cache.is_file():
            stored = torch.load(cache, weights_only=True)
            return PreparedData(
                train=stored["train"],
                val=stored["val"],
                scoring=[Prompted(p, r) for p, r in zip(stored["scoring_ids"], stored["scoring_refs"])],
                notes=stored.get("notes", []),
            )
        prepared = self.tokenize(tokenizer, seed)
        if not prepared.train:
            raise LitftError(f"the training data of --data {type(self).__name__} holds no usable sample; check the file's contents")
        if self.packing:
            prepared.train = pack(prepared.train, self.effective_max_length(tokenizer))
            prepared.val = pack(prepared.val, self.effective_max_length(tokenizer))
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        torch.save(
            {
                "train": prepared.train,
                "val": prepared.val,
                "scoring_ids": [p.prompt_ids for p in prepared.scoring],
                "scoring_refs": [p.reference for p in prepared.scoring],
                "notes": prepared.notes,
            },
            tmp,
        )
        os.replace(tmp, cache)
        return prepared

    def effective_max_length(self, tokenizer) -> int:
        if self.max_seq_length is not None:
            return self.max_seq_length
        limit = getattr(tokenizer, "model_max_length", None)
        # Tokenizers without a limit report a huge sentinel value.
        return min(int(limit), 2048) if limit else 2048


def data_config(module: "DataModule") -> dict:
    """A data module as jsonargparse reads it back: its class (litft's own by their short path) and its flags."""
    where = type(module).__module__
    where = "litft.data" if where.startswith("litft.data.") else where  # litft.data exports every module of its own
    return {"class_path": f"{where}.{type(module).__name__}", "init_args": module.config_dict()}


def mean_length(samples) -> float:
    """Mean tokens per sample; tokenized tables keep a column of lengths, so their rows are not read for it."""
    lengths = getattr(samples, "lengths", None)
    if lengths is None:
        lengths = [len(s["input_ids"]) for s in samples]
    return float(sum(lengths)) / max(len(samples), 1)


def samples_see_images(data: PreparedData) -> bool:
    """Whether the prepared samples carry images (litft.data.images): the first of each split tells, as a dataset is one or the other."""
    for samples in (data.train, data.val):
        if getattr(samples, "images", False) or (isinstance(samples, list) and samples and "images" in samples[0]):  # a stream says
            return True
    return False


def _plain(value):
    if isinstance(value, DataModule):
        return data_config(value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "chat_template.jinja", "chat_template.json")


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash that changes when the tokenizer would split or template text differently."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update(backend.to_str().encode() if backend is not None else str(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(str(getattr(tokenizer, "chat_template", "")).encode())
    digest.update(str((tokenizer.bos_token_id, tokenizer.eos_token, getattr(tokenizer, "add_bos_token", None))).encode())
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or "-"))
    for name in PROCESSOR_FILES if folder.is_dir() else ():  # a VLM's image processor decides how many tokens an image becomes
        if (folder / name).is_file():
            digest.update((folder / name).read_bytes())
    return digest.hexdigest()[:16]


def split_indices(count: int, val_fraction: float, seed: int) -> Tuple[List[int], List[int]]:
    """Positions of the training and validation items of a seeded random split, each in their original order.

    Seeded, so every rank and every resume sees the same validation set.
    """
    fraction(val_fraction, "--data.val_split_fraction", "the share held out for validation,")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = int(round(count * val_fraction))
    if val_fraction > 0 and n_val == 0 and count > 1:
        n_val = 1
    val_idx = set(order[:n_val])
    return [i for i in range(count) if i not in val_idx], sorted(val_idx)


def split_train_val(items: list, val_fraction: float, seed: int) -> Tuple[list, list]:
    train_idx, val_idx = split_indices(len(items), val_fraction, seed)
    return [items[i] for i in train_idx], [items[i] for i in val_idx]


def json_problem(err) -> str:
    """A JSON decoding error's message with where on its line it is (json's own ends "starting at" before the place)."""
    return f"{err.msg} column {err.colno}" if err.msg.endswith(" at") else f"{err.msg} at column {err.colno}"
