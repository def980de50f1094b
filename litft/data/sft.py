"""Instruction data: Alpaca-style records and chat ``messages``, with the prompt masked from the loss."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, Literal, Optional, Tuple

import torch

from litft.data.base import json_problem, DataModule, PreparedData, Prompted, split_train_val

from litft.data.images import ImageRecords, carries_images, image_files, with_absolute_images
from litft.data.samples import IGNORE_INDEX, Sample
from litft.errors import LitftError

PromptStyle = Literal["alpaca", "chat", "plain"]


def alpaca_prompt(instruction: str, input_text: str) -> str:
    """The Alpaca field layout (instruction / input / response headers), in litft's wording."""
    if input_text:
        return f"### Instruction:\n{instruction}\n\n### Input:\n{input_text}\n\n### Response:\n"
    return f"### Instruction:\n{instruction}\n\n### Response:\n"


def read_records(path: Path) -> List[dict]:
    """Records from a JSON list or a JSONL file; a bad line is reported by its number."""
    if not path.is_file():
        raise LitftError(f"data file {path} does not exist; pass an existing file to --data.json_path")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl" or (text.lstrip()[:1] == "{"):
        records = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise LitftError(f"{path}:{number} is not valid JSON ({json_problem(err)}); fix that line") from None
        return records
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        raise LitftError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}); fix the file or use JSONL") from None
    if not isinstance(records, list):
        raise LitftError(f"{path} must hold a JSON list of records (or one JSON record per line)")
    return records


def images_named_in(json_files: List[Path]) -> List[Path]:
    """The image files that JSON/JSONL record files name (a tokenized cache's key reads them too)."""
    named = [p for p in json_files if '"images"' in p.read_text(encoding="utf-8", errors="replace")]
    return image_files([r for p in named for r in with_absolute_images(read_records(p), p.parent)])


def files_name_images(json_files: List[Path]) -> bool:
    """Whether any record of these JSON/JSONL files is in a vision layout (files that never mention an image are not parsed)."""
    named = [p for p in json_files if '"image' in p.read_text(encoding="utf-8", errors="replace")]
    return any(carries_images(r) for p in named for r in read_records(p))


class InstructionData(DataModule):
    """Shared tokenization of instruction records; subclasses say where records come from."""

    prompt_style: PromptStyle = "alpaca"
    mask_prompt: bool = True
    val_split_fraction: float = 0.05

    def records(self, seed: int) -> Tuple[List[dict], List[dict], str]:  # pragma: no cover - abstract
        """Train records, validation records, and a name for error messages."""
        raise NotImplementedError

    def tokenize(self, tokenizer, seed: int) -> PreparedData:
        train_records, val_records, origin = self.records(seed)
        max_len = self.effective_max_length(tokenizer)
        if any(carries_images(r) for r in train_records + val_records):
            return self.tokenize_images(tokenizer, train_records, val_records, origin, max_len)
        train = [self.encode(tokenizer, r, i, origin, max_len) for i, r in enumerate(train_records)]
        val = [self.encode(tokenizer, r, i, origin, max_len) for i, r in enumerate(val_records)]
        scoring = [self.prompted(tokenizer, r, origin) for r in val_records]
        # Samples that truncation left without any target token teach nothing.
        train = [s for s in train if (s["labels"] != IGNORE_INDEX).any()]
        val = [s for s in val if (s["labels"] != IGNORE_INDEX).any()]
        return PreparedData(train=train, val=val, scoring=[p for p in scoring if p is not None])

    def tokenize_images(self, tokenizer, train_records: List[dict], val_records: List[dict], origin: str, max_len: int) -> PreparedData:
        """A vision dataset, every record through the model's processor (litft.data.images); no scoring by generation yet."""
        records = ImageRecords(tokenizer, self.mask_prompt)
        splits, notes = [], []
        for name, chosen, where in (("training", train_records, origin), ("validation", val_records, self.val_path_name() or origin)):
            encoded = [records.encode(r, i, f"record {i} of {where}", max_len) for i, r in enumerate(chosen)]
            dropped = sum(s is None for s in encoded)
            if dropped:
                notes.append(f"data: {dropped} {name} record(s) longer than {max_len} tokens left out (an image's tokens are never cut; "
                             "raise --data.max_seq_length to keep them)")
            splits.append([s for s in encoded if s is not None and (s["labels"] != IGNORE_INDEX).any()])
        return PreparedData(train=splits[0], val=splits[1], scoring=[], notes=notes)

    def val_path_name(self) -> Optional[str]:
        """The separate validation file's name, where there is one (for where a record is)."""
        return None

    def segments(self, tokenizer, record: dict, where: str) -> List[Tuple[str, bool]]:
        """The record as text pieces, each marked True when it is trained on."""
        check_record(record, where)
        if "messages" in record:
            return chat_segments(tokenizer, record["messages"], where, self.mask_prompt)
        if "instruction" not in record:  # prompt and completion: the prompt as it is, or as the user's turn of a chat
            if self.prompt_style == "chat":
                messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
                return chat_segments(tokenizer, messages, where, self.mask_prompt)
            return [(record["prompt"], False), (record["completion"] + (tokenizer.eos_token or ""), True)]
        instruction, input_text, output = record["instruction"], record.get("input") or "", record["output"]
        if self.prompt_style == "chat":
            user = f"{instruction}\n\n{input_text}" if input_text else instruction
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
            return chat_segments(tokenizer, messages, where, self.mask_prompt)
        prompt = alpaca_prompt(instruction, input_text) if self.prompt_style == "alpaca" else f"{instruction}\n{input_text}".rstrip("\n") + "\n"
        return [(prompt, False), (output + (tokenizer.eos_token or ""), True)]

    def encode(self, tokenizer, record: dict, index: int, origin: str, max_len: int) -> Sample:
        segments = self.segments(tokenizer, record, f"record {index} of {origin}")
        ids = self.bos(tokenizer, record)
        labels = [IGNORE_INDEX] * len(ids)
        for text, trained in segments:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            labels += piece if (trained or not self.mask_prompt) else [IGNORE_INDEX] * len(piece)
        ids, labels = ids[:max_len], labels[:max_len]
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "id": torch.tensor(index)}

    def prompted(self, tokenizer, record: dict, origin: str) -> Optional[Prompted]:
        """The untrained part of a record as token ids, and its answer as text."""
        pieces = self.segments(tokenizer, record, origin)
        if len(pieces) < 2 or not pieces[-1][1]:
            return None
        prompt = "".join(text for text, _ in pieces[:-1])
        # Compare text as generation decodes it: without end-of-turn or other special tokens.
        answer_ids = tokenizer(pieces[-1][0], add_special_tokens=False)["input_ids"]
        reference = tokenizer.decode(answer_ids, skip_special_tokens=True)
        ids = self.bos(tokenizer, record) + tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return Prompted(prompt_ids=ids, reference=reference.strip())

    def bos(self, tokenizer, record: dict) -> List[int]:
        """The BOS token where the tokenizer adds one; chat templates write their own."""
        uses_template = "messages" in record or self.prompt_style == "chat"
        if uses_template or tokenizer.bos_token_id is None or not getattr(tokenizer, "add_bos_token", False):
            return []
        return [tokenizer.bos_token_id]


def check_record(record, where: str) -> None:
    """Fail on the first record that has neither instruction fields nor chat messages."""
    if not isinstance(record, dict):
        raise LitftError(f"{where} is not a JSON object")
    if "messages" in record or carries_images(record):  # image records are checked as they are tokenized (litft.data.images)
        return
    needed = ("prompt", "completion") if "prompt" in record and "instruction" not in record else ("instruction", "output")
    missing = [k for k in needed if not isinstance(record.get(k), str)]
    if missing:
        raise LitftError(
            f"{where} lacks the field(s) {', '.join(missing)}; each record needs 'instruction' and 'output' "
            "(optionally 'input'), 'prompt' and 'completion', or a 'messages' list"
        )


def chat_segments(tokenizer, messages, where: str, mask_prompt: bool = True) -> List[Tuple[str, bool]]:
    """Render ``messages`` with the tokenizer's chat template; assistant turns are the targets.

    Each assistant turn is located by rendering the conversation up to it with and
    without the turn; a template whose renderings are not prefixes of each other
    cannot be masked this way and is reported.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise LitftError(f"{where} uses chat messages but the tokenizer has no chat template; use a chat model or --data.prompt_style alpaca")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise LitftError(f"{where} has a 'messages' field that is not a list of {{'role', 'content'}} objects")
    if not any(m["role"] == "assistant" for m in messages):
        raise LitftError(f"{where} has no assistant message to train on")
    if not mask_prompt:
        return [(tokenizer.apply_chat_template(messages, tokenize=False), True)]
    segments: List[Tuple[str, bool]] = []
    done = ""
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:turn], tokenize=False, add_generation_prompt=True) if turn else ""
        after = tokenizer.apply_chat_template(messages[: turn + 1], tokenize=False)
        if not (before.startswith(done) and after.startswith(before)):
            raise LitftError(f"the tokenizer's chat template does not render {where} incrementally, so its prompt cannot be masked; set --data.mask_prompt false")
        segments += [(before[len(done) :], False), (after[len(before) :], True)]
        done = after
    return [(text, trained) for text, trained in segments if text]


@dataclass
class JSON(InstructionData):
    """Instruction records from a JSON list or JSONL file: Alpaca fields, prompt and completion, or chat ``messages``."""

    json_path: Path = Path("data/train.json")
    """A .json list or .jsonl file of records with instruction/input/output, or messages."""
    val_path: Optional[Path] = None
    """A separate validation file; without it val_split_fraction of json_path is held out."""
    val_split_fraction: float = 0.05
    """Share of json_path held out for validation when val_path is not given."""
    prompt_style: PromptStyle = "alpaca"
    """How instruction records become text: alpaca headers, the tokenizer's chat template, or plain."""
    mask_prompt: bool = True
    """Train only on the response tokens; the prompt carries no loss."""
    max_seq_length: Optional[int] = None
    """Truncate samples to this many tokens (default: the tokenizer's limit, at most 2048)."""
    packing: bool = False
    """Put several samples in one row of max_seq_length tokens, kept apart by position ids."""

    def source_files(self):
        files = [p for p in (self.json_path, self.val_path) if p is not None and p.is_file()]
        return files + images_named_in(files)

    def names_images(self) -> bool:
        return files_name_images([p for p in (self.json_path, self.val_path) if p is not None and p.is_file()])

    def val_path_name(self) -> Optional[str]:
        return str(self.val_path) if self.val_path is not None else None

    def records(self, seed: int):
        records = with_absolute_images(read_records(self.json_path), self.json_path.parent)
        if not records:
            raise LitftError(f"{self.json_path} holds no records; add some or point --data.json_path elsewhere")
        for number, record in enumerate(records):
            check_record(record, f"record {number} of {self.json_path}")
        if self.val_path is not None:
            return records, with_absolute_images(read_records(self.val_path), self.val_path.parent), str(self.json_path)
        train, val = split_train_val(records, self.val_split_fraction, seed)
        return train, val, str(self.json_path)
