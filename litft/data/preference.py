"""Preference pairs: a prompt with a chosen and a rejected response, each pair one sample of two sequences.

A pair's sample holds the prompt and the chosen response, then the prompt again and
the rejected response, with position ids restarting at the second prompt: attention
keeps the two sequences apart as it keeps packed samples apart, so both go through
the model in one row, padding-free. Only response tokens carry labels; the
objective (``litft.objectives.preference``) sums their log-probs per sequence.
"""

import os
import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from litft.data.base import DataModule, PreparedData, Prompted
from litft.data.images import ImageRecords, carries_images
from litft.data.samples import IGNORE_INDEX, Sample
from litft.data.records import RecordSource
from litft.data.sft import PromptStyle, alpaca_prompt
from litft.data.tiny import LETTERS, TASKS, check_tiny, task_record
from litft.errors import LitftError

ROLES = ("system", "user", "assistant", "tool")


def is_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in value)


def check_pair(record, where: str) -> None:
    """One line for a record that is not a preference pair, naming the record."""
    if not isinstance(record, dict):
        raise LitftError(f"{where} is not a JSON object; each record needs 'chosen' and 'rejected' (and 'prompt')")
    if carries_images(record):  # checked as it is tokenized, by the model's processor (litft.data.images)
        return
    missing = [key for key in ("chosen", "rejected") if key not in record]
    if missing:
        raise LitftError(f"{where} lacks the field(s) {', '.join(missing)}; each record needs 'chosen' and 'rejected' (text or chat messages) and a 'prompt'")
    for key in ("prompt", "chosen", "rejected"):
        value = record.get(key)
        if key == "prompt" and value is None:
            continue
        if not (isinstance(value, str) or is_messages(value)):
            raise LitftError(f"{where}: '{key}' must be text or a list of {{'role', 'content'}} messages")
        if (value == "" or value == []) and key != "prompt":
            raise LitftError(f"{where}: '{key}' is empty; every pair needs two responses")
    if "prompt" not in record and isinstance(record["chosen"], str) != isinstance(record["rejected"], str):
        raise LitftError(f"{where} has no 'prompt', and one response is text, the other messages; give a prompt or two of a kind")


def split_conversations(chosen: list, rejected: list, where: str) -> Tuple[list, list, list]:
    """The shared prompt of two whole conversations (every message before the last) and the two last messages."""
    if chosen[:-1] != rejected[:-1] or chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
        raise LitftError(f"{where}: 'chosen' and 'rejected' must be the same conversation up to a last assistant message each (or give a 'prompt')")
    return chosen[:-1], chosen[-1:], rejected[-1:]


def shared_prefix(chosen: str, rejected: str, where: str) -> Tuple[str, str, str]:
    """Two whole texts as the prompt they share (up to the last space or newline of it) and the two responses."""
    n = len(os.path.commonprefix([chosen, rejected]))
    if n < min(len(chosen), len(rejected)):  # back to a word's start: the responses begin with whole words
        n = max(chosen.rfind(" ", 0, n), chosen.rfind("\n", 0, n)) + 1
    if n == 0 or n >= min(len(chosen), len(rejected)):
        raise LitftError(f"{where} has no 'prompt' and its two texts share no prompt before different responses; give a 'prompt'")
    return chosen[:n], chosen[n:], rejected[n:]


def as_messages(value, role: str) -> list:
    return value if isinstance(value, list) else ([{"role": role, "content": value}] if value else [])


class PreferenceData(DataModule):
    """Shared tokenization of preference records; subclasses say where the records come from."""

    prompt_style: PromptStyle = "plain"
    val_split_fraction: float = 0.05

    def records(self, seed: int) -> Tuple[List[dict], List[dict], str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def texts(self, tokenizer, record: dict, where: str) -> Tuple[str, str, str]:
        """The prompt, chosen and rejected texts: rendered by the chat template where the record holds messages or asks for one."""
        return self.rendered(tokenizer, record, where)[:3]

    def rendered(self, tokenizer, record: dict, where: str) -> Tuple[str, str, str, bool]:
        """``texts``, and whether the chat template rendered them (it writes its own BOS where the model has one)."""
        check_pair(record, where)
        prompt, chosen, rejected = record.get("prompt"), record["chosen"], record["rejected"]
        chat = self.prompt_style == "chat" or any(isinstance(v, list) for v in (prompt, chosen, rejected))
        if prompt is None and isinstance(chosen, str):  # two whole texts (Anthropic HH style): the prompt is what they share
            prompt, chosen, rejected = shared_prefix(chosen, rejected, where)
            chat = False
        if not chat:
            if self.prompt_style == "alpaca":
                prompt = alpaca_prompt(prompt, "")
            eos = tokenizer.eos_token or ""
            return prompt or "", chosen + eos, rejected + eos, False
        if not getattr(tokenizer, "chat_template", None):
            raise LitftError(f"{where} is a chat (messages or --data.prompt_style chat) but the tokenizer has no chat template; use a chat model or plain text")
        if prompt is None:
            prompt, chosen, rejected = split_conversations(chosen, rejected, where)
        prompt = as_messages(prompt, "user")
        before = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) if prompt else ""
        responses = []
        for response in (chosen, rejected):
            whole = tokenizer.apply_chat_template(prompt + as_messages(response, "assistant"), tokenize=False)
            if not whole.startswith(before):
                raise LitftError(f"the tokenizer's chat template does not render {where} with its prompt first, so the responses cannot be told apart")
            responses.append(whole[len(before):])
        return before, responses[0], responses[1], True

    def encode(self, tokenizer, record: dict, index: int, where: str, max_len: int) -> Tuple[Optional[Sample], str]:
        """The pair as one sample (None when its prompt leaves no room for a response), and whether truncation cut it."""
        prompt_text, chosen_text, rejected_text, templated = self.rendered(tokenizer, record, where)
        bos = [] if templated or tokenizer.bos_token_id is None or not getattr(tokenizer, "add_bos_token", False) else [tokenizer.bos_token_id]
        prompt = bos + tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        if not prompt:  # the first response token would be predicted from the other sequence, or from nothing
            raise LitftError(f"{where} has an empty prompt (and the tokenizer adds no BOS token); every pair needs a prompt")
        room = max_len - len(prompt)
        if room < 1:
            return None, "dropped"
        chosen, rejected = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in (chosen_text, rejected_text))
        if not chosen or not rejected:
            raise LitftError(f"{where}: a response tokenizes to nothing; every pair needs two responses")
        cut = "cut" if max(len(chosen), len(rejected)) > room else ""
        chosen, rejected = chosen[:room], rejected[:room]
        masked = [IGNORE_INDEX] * len(prompt)
        ids = prompt + chosen + prompt + rejected
        return {
            "input_ids": torch.tensor(ids),
            "labels": torch.tensor(masked + chosen + masked + rejected),
            "position_ids": torch.cat([torch.arange(len(prompt) + len(chosen)), torch.arange(len(prompt) + len(rejected))]),
            "rejected_start": torch.tensor(len(prompt) + len(chosen)),
            "id": torch.tensor(index),
        }, cut

    def encode_all(self, tokenizer, records: List[dict], origin: str, max_len: int) -> Tuple[List[Sample], int, int]:
        samples, cut, dropped = [], 0, 0
        for index, record in enumerate(records):
            sample, change = self.encode(tokenizer, record, index, f"record {index} of {origin}", max_len)
            cut, dropped = cut + (change == "cut"), dropped + (change == "dropped")
            if sample is not None:
                samples.append(sample)
        return samples, cut, dropped

    def tokenize(self, tokenizer, seed: int) -> PreparedData:
        train_records, val_records, origin = self.records(seed)
        max_len = self.effective_max_length(tokenizer)
        if any(carries_images(r) for r in train_records + val_records):
            return tokenize_image_pairs(tokenizer, train_records, val_records, origin, max_len)
        train, cut, dropped = self.encode_all(tokenizer, train_records, origin, max_len)
        val, val_cut, val_dropped = self.encode_all(tokenizer, val_records, origin, max_len)
        notes = []
        if cut + dropped + val_cut + val_dropped:
            notes.append(
                f"preference data: {cut + val_cut} of {len(train_records) + len(val_records)} pairs had responses cut to --data.max_seq_length "
                f"{max_len} (the prompt kept whole); {dropped + val_dropped} dropped, their prompt alone that long"
            )
        return PreparedData(train=train, val=val, scoring=[prompted(tokenizer, s) for s in val], notes=notes)


def tokenize_image_pairs(tokenizer, train_records: List[dict], val_records: List[dict], origin: str, max_len: int) -> PreparedData:
    """Pairs about images (litft.data.images), through the model's processor; no scoring by generation yet."""
    pairs, splits, dropped = ImageRecords(tokenizer, mask_prompt=True), [], 0
    for records in (train_records, val_records):
        encoded = [pairs.pair(r, i, f"record {i} of {origin}", max_len) for i, r in enumerate(records)]
        dropped += sum(s is None for s in encoded)
        splits.append([s for s in encoded if s is not None])
    notes = [f"preference data: {dropped} pairs about images longer than --data.max_seq_length {max_len} left out (an image's tokens are "
             "never cut)"] if dropped else []
    return PreparedData(train=splits[0], val=splits[1], scoring=[], notes=notes)


def prompted(tokenizer, pair: Sample) -> Prompted:
    """A pair's prompt as the model reads it, with the chosen answer as the reference of exact-match scoring."""
    start = int(pair["rejected_start"])
    masked = int((pair["labels"][:start] == IGNORE_INDEX).sum())
    answer = tokenizer.decode(pair["input_ids"][masked:start], skip_special_tokens=True)
    return Prompted(pair["input_ids"][:masked].tolist(), answer.strip())


@dataclass
class Preferences(RecordSource, PreferenceData):
    """Preference pairs from a JSON/JSONL file or anything the ``datasets`` library reads: prompt, chosen and rejected as text or chat."""

    path: str = "data/preferences.jsonl"
    """A .json list or .jsonl file of {"prompt", "chosen", "rejected"} records (text, or lists of chat messages); or a hub dataset id, or local parquet, arrow or CSV files, read by the datasets library."""
    name: Optional[str] = None
    """A hub dataset's configuration (subset)."""
    split: str = "train"
    """The split to train on (datasets)."""
    val_path: Optional[str] = None
    """A separate file (or dataset) of validation pairs; without it, the dataset's validation split, else val_split_fraction of the training pairs."""
    val_split_fraction: float = 0.05
    """Share of the training pairs held out for validation when there is no validation file or split."""
    columns: Dict[str, str] = field(default_factory=dict)
    """The data's column for each field, where the names differ, e.g. {"prompt": "question", "chosen": "response_j", "rejected": "response_k"}."""
    prompt_style: PromptStyle = "plain"
    """How text prompts become the model's input: as they are (plain), in alpaca headers, or as the user's turn of the chat template."""
    max_seq_length: Optional[int] = None
    """Longest prompt plus response, in tokens: responses are cut to fit, pairs whose prompt alone is that long are dropped (default: the tokenizer's limit, at most 2048)."""

    def check(self) -> None:
        super().check()
        unknown = sorted(set(self.columns) - {"prompt", "chosen", "rejected"})
        if unknown:
            raise LitftError(f"--data.columns names unknown field(s) {unknown}; the fields are prompt, chosen and rejected")

    def records(self, seed: int):
        return self.train_and_val(seed, check_pair)


def corrupted(rng: random.Random, record: dict) -> str:
    """A wrong answer to a TinyTasks record, one number or one letter off the right one: close enough to be a real choice."""
    answer = record["output"]
    if answer.isdigit():
        value = int(answer)
        return str(value + rng.choice([d for d in (-2, -1, 1, 2) if value + d >= 0]))
    letters = answer.split()
    i = rng.randrange(len(letters))
    letters[i] = rng.choice([c for c in LETTERS if c != letters[i]])
    return " ".join(letters)


def preference_records(n: int, seed: int, tasks=TASKS) -> List[dict]:
    rng = random.Random(seed)
    records = []
    for i in range(n):
        record = task_record(rng, tasks[i % len(tasks)])
        records.append({"prompt": alpaca_prompt(record["instruction"], record["input"]), "chosen": record["output"], "rejected": corrupted(rng, record)})
    return records


@dataclass
class TinyPreferences(PreferenceData):
    """Generated preference pairs of the TinyTasks prompts: the right answer chosen, a corrupted one rejected."""

    tasks: List[str] = TASKS
    """Which of reverse, sort, add, count to generate."""
    num_train: int = 2000
    """Training pairs."""
    num_val: int = 200
    """Validation pairs (preference accuracy on held-out prompts)."""
    max_seq_length: Optional[int] = 64
    """Longest prompt plus response, in tokens."""

    def check(self) -> None:
        super().check()
        check_tiny(self.tasks, self.num_train, self.num_val)

    def records(self, seed: int):
        tasks = tuple(self.tasks)
        return preference_records(self.num_train, seed, tasks), preference_records(self.num_val, seed + 10_000, tasks), "TinyPreferences"
