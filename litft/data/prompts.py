"""Prompts for online RL (``--objective grpo``): each a prompt to sample completions for, and the columns its rewards read.

A record holds a ``prompt`` (text, or chat messages rendered with the chat template and
its generation prompt) and any other columns (an ``answer``, test cases, ...), which are
passed to the reward functions by name with every completion, as TRL passes them.
"""

import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from litft.data.base import DataModule, PreparedData, Prompted
from litft.data.images import ImageRecords, carries_images
from litft.data.preference import as_messages, is_messages
from litft.data.samples import Sample
from litft.data.records import RecordSource
from litft.data.sft import PromptStyle, alpaca_prompt
from litft.data.tiny import TASKS, check_tiny, task_records
from litft.errors import LitftError


def check_prompt(record, where: str) -> None:
    if not isinstance(record, dict):
        raise LitftError(f"{where} is not a JSON object; each record needs a 'prompt' (text or chat messages)")
    prompt = record.get("prompt")
    if not (isinstance(prompt, str) and prompt) and not (is_messages(prompt) and prompt):
        raise LitftError(f"{where} has no 'prompt' (text or a list of {{'role', 'content'}} messages); every record needs one")


class PromptData(DataModule):
    """Shared rendering of prompt records; subclasses say where the records come from."""

    prompt_style: PromptStyle = "chat"
    val_split_fraction: float = 0.05

    def records(self, seed: int) -> Tuple[List[dict], List[dict], str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def render(self, tokenizer, record: dict, where: str) -> Tuple[str, bool]:
        """The prompt as the model reads it, and whether the chat template wrote it (and its own BOS)."""
        check_prompt(record, where)
        prompt = record["prompt"]
        if self.prompt_style == "chat" or isinstance(prompt, list):
            if not getattr(tokenizer, "chat_template", None):
                raise LitftError(f"{where} is a chat (messages or --data.prompt_style chat) but the tokenizer has no chat template; "
                                 "use a chat model or --data.prompt_style plain")
            system = getattr(self, "system_prompt", None)
            messages = ([{"role": "system", "content": system}] if system else []) + as_messages(prompt, "user")
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), True
        return (alpaca_prompt(prompt, "") if self.prompt_style == "alpaca" else prompt), False

    def encode(self, tokenizer, record: dict, index: int, where: str, max_len: int, images: Optional[ImageRecords] = None) -> Optional[Sample]:
        """The prompt as a sample, or None where it leaves no room for a completion; ``images``: a vision dataset's processor,
        which renders every record (image parts or none) with its chat template and keeps the text and image files."""
        if images is not None:
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), list):  # turns (with parts) are checked as rendered
                check_prompt(record, where)
            sample = images.prompt(record, index, where, max_len, getattr(self, "system_prompt", None))
            if sample is None:
                return None
        else:
            text, templated = self.render(tokenizer, record, where)
            bos = [] if templated or tokenizer.bos_token_id is None or not getattr(tokenizer, "add_bos_token", False) else [tokenizer.bos_token_id]
            ids = bos + tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) >= max_len:
                return None  # no room for a completion
            sample = {"input_ids": torch.tensor(ids), "id": torch.tensor(index)}
        # The other columns reach the reward functions by name; images as their paths (a decoded picture has no JSON form).
        sample["columns"] = {key: json.dumps(value) for key, value in record.items()
                             if key != "prompt" and not (key == "images" and not all(isinstance(e, str) for e in value or []))}
        if isinstance(record["prompt"], list):  # a conversation: the rewards see it, and the completion, as messages (as TRL gives them)
            sample["messages"] = json.dumps(record["prompt"])
        return sample

    def tokenize(self, tokenizer, seed: int) -> PreparedData:
        train_records, val_records, origin = self.records(seed)
        max_len = self.effective_max_length(tokenizer)
        notes, prepared = [], []
        images = ImageRecords(tokenizer, mask_prompt=True) if any(carries_images(r) for r in train_records + val_records) else None
        for name, records in (("train", train_records), ("val", val_records)):
            samples = [self.encode(tokenizer, r, i, f"record {i} of {origin}", max_len, images) for i, r in enumerate(records)]
            dropped = sum(s is None for s in samples)
            if dropped:
                notes.append(f"{dropped} {name} prompts of {origin} are {max_len} tokens or longer, leaving no room for a completion: dropped")
            prepared.append([s for s in samples if s is not None])
        scoring = []
        for sample in prepared[1] if images is None else ():  # scoring generates from text prompts
            answer = sample["columns"].get("answer")
            if answer is not None:
                scoring.append(Prompted(prompt_ids=sample["input_ids"].tolist(), reference=str(json.loads(answer)).strip()))
        return PreparedData(train=prepared[0], val=prepared[1], scoring=scoring, notes=notes)


def columns_of(sample: Sample) -> Dict[str, object]:
    """A prompt sample's other columns, as the reward functions take them."""
    return {key: json.loads(value) for key, value in sample["columns"].items()}


def reward_view(sample: Sample, prompt_text: str, completion_text: str) -> Tuple[object, object]:
    """The prompt and a completion as TRL passes them to reward functions: the prompt's messages and a one-message
    assistant turn where the prompt was a conversation, else the texts."""
    if "messages" in sample:
        return json.loads(sample["messages"]), [{"role": "assistant", "content": completion_text}]
    return prompt_text, completion_text


@dataclass
class Prompts(RecordSource, PromptData):
    """Prompts from a JSON/JSONL file or anything the ``datasets`` library reads, every other column passed to the rewards."""

    path: str = "data/prompts.jsonl"
    """A .json list or .jsonl file of {"prompt", ...} records (text, or a list of chat messages); or a hub dataset id, or local parquet, arrow or CSV files, read by the datasets library."""
    name: Optional[str] = None
    """A hub dataset's configuration (subset)."""
    split: str = "train"
    """The split to train on (datasets)."""
    val_path: Optional[str] = None
    """A separate file (or dataset) of held-out prompts; without it, the dataset's validation split, else val_split_fraction of the prompts."""
    val_split_fraction: float = 0.05
    """Share of the prompts held out (their reward is validated) when there is no validation file or split."""
    columns: Dict[str, str] = field(default_factory=dict)
    """The data's column for each name the rewards read, where they differ, e.g. {"prompt": "question", "answer": "solution"}."""
    prompt_style: PromptStyle = "chat"
    """How text prompts become the model's input: the user's turn of the chat template (chat), as they are (plain), or in alpaca headers."""
    system_prompt: Optional[str] = None
    """A system message put before every chat prompt (how to lay out the answer, for instance)."""
    max_seq_length: Optional[int] = None
    """Longest prompt, in tokens: longer prompts are dropped (default: the tokenizer's limit, at most 2048)."""

    def records(self, seed: int):
        return self.train_and_val(seed, lambda record, where: None)  # each prompt is checked as it is rendered


@dataclass
class TinyPrompts(PromptData):
    """Generated TinyTasks prompts (reverse, sort, add, count) with their exact answers, for the built-in exact_match reward."""

    tasks: List[str] = TASKS
    """Which of reverse, sort, add, count to generate."""
    num_train: int = 2000
    """Training prompts."""
    num_val: int = 64
    """Held-out prompts (their reward is validated)."""
    prompt_style: PromptStyle = "alpaca"
    """How the prompts are written: alpaca headers (as TinyTasks trains litft-tiny), the chat template, or plain."""
    max_seq_length: Optional[int] = 64
    """Longest prompt, in tokens."""

    def check(self) -> None:
        super().check()
        check_tiny(self.tasks, self.num_train, self.num_val)

    def records(self, seed: int):
        records = []
        for task in task_records(self.num_train + self.num_val, seed, tuple(self.tasks)):
            prompt = task["instruction"] if self.prompt_style == "alpaca" else f"{task['instruction']}\n{task['input']}"
            records.append({"prompt": prompt, "input": task["input"], "answer": task["output"]})
        return records[: self.num_train], records[self.num_train:], "TinyPrompts"

    def render(self, tokenizer, record: dict, where: str) -> Tuple[str, bool]:
        if self.prompt_style == "alpaca":
            return alpaca_prompt(record["prompt"], record["input"]), False
        return super().render(tokenizer, record, where)
