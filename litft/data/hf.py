"""Data through the Hugging Face ``datasets`` library: a hub id, or local parquet, arrow, JSON, JSONL or CSV files.

Records become samples with the instruction and text code of ``sft.py`` and
``text.py``; what differs is the reading. Map-style data is tokenized once, by
``datasets.map`` in parallel processes, into an Arrow table under
``$LITFT_HOME/datasets`` keyed by the dataset's fingerprint, and read from there
memory-mapped, a row at a time, as the sample order asks for it. Streamed data
(``stream.py``) is tokenized on the fly.
"""

import csv
import functools
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from litft.config import at_least
from litft.data.base import DataModule, PreparedData, Prompted, litft_home, split_indices
from litft.data.images import ImageRecords
from litft.data.samples import IGNORE_INDEX, Sample, pack
from litft.data.sft import InstructionData, PromptStyle
from litft.data.stream import streamed
from litft.data.text import cut_blocks, document_ids
from litft.errors import LitftError

BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json", ".csv": "csv"}
VAL_SPLITS = ("validation", "valid", "val", "dev")
FIELDS = ("messages", "instruction", "input", "output", "prompt", "completion", "text")
# What a dataset holds, by the fields it has, in the order they are looked for.
FORMS = {"chat": ("messages",), "alpaca": ("instruction", "output"), "completion": ("prompt", "completion"), "text": ("text",)}
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant", "system": "system"}
IMAGES = "images"  # a vision dataset's column of images (TRL's layout)
MAP_BATCH = 1000  # records per datasets.map call
BLOCK_BATCH = 10_000  # text documents joined per cut; a block's worth of tail is dropped at the end of each
PARALLEL_FROM = 20_000  # records from which tokenizing is worth starting processes for


@functools.cache
def hf_datasets():
    """The ``datasets`` library, imported on first use and quieted (a bar for every split and map otherwise).

    Not at the top: the import takes about a second of every process's start, and runs on
    other data (TinyTasks, JSON, text files) never need it.
    """
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def features(*columns: str):
    """Declared, not inferred, so that an empty split (no validation records, no scoring prompts for text) still saves and loads."""
    datasets = hf_datasets()
    kinds = {"length": datasets.Value("int64"), "reference": datasets.Value("string")}
    return datasets.Features({name: kinds.get(name, datasets.List(datasets.Value("int64"))) for name in columns})


TOKENS = ("input_ids", "labels", "length")
PACKED = (*TOKENS, "position_ids")
PROMPTS = ("prompt_ids", "reference")


@dataclass
class Layout:
    """Which form a dataset has, and which of its columns holds each field litft reads."""

    form: str
    columns: Dict[str, str]

    def record(self, row: dict):
        """The row as the instruction code reads records (or a document's text)."""
        get = {name: row.get(column) for name, column in self.columns.items()}
        if self.form == "chat":
            return {"messages": [chat_turn(turn) for turn in get["messages"] or []]}
        if self.form == "alpaca":
            return {"instruction": get["instruction"], "input": get.get("input") or "", "output": get["output"]}
        if self.form == "completion":
            return {"prompt": get["prompt"], "completion": get["completion"]}
        return get["text"] or ""


def chat_turn(turn):
    """A turn as {role, content}; ShareGPT's {from, value} turns are renamed."""
    if isinstance(turn, dict) and "from" in turn and "role" not in turn:
        return {"role": ROLES.get(turn["from"], turn["from"]), "content": turn.get("value")}
    return turn


class ArrowSamples(Sequence):
    """Tokenized samples in an Arrow table, read memory-mapped as they are asked for; ids count from ``first_id``."""

    def __init__(self, table, first_id: int = 0):
        self.table, self.first_id = table, first_id

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i) -> Sample:
        row = self.table[int(i)]
        sample = {key: torch.tensor(row[key], dtype=torch.long) for key in ("input_ids", "labels", "position_ids") if key in row}
        sample["id"] = torch.tensor(self.first_id + int(i))
        return sample

    @property
    def lengths(self):
        return self.table.data.column("length").to_numpy() if len(self.table) else []


class ArrowPrompts(Sequence):
    """Validation prompts and their answers for scoring, from an Arrow table."""

    def __init__(self, table):
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        row = self.table[int(i)]
        return Prompted(prompt_ids=list(row["prompt_ids"]), reference=row["reference"])


def columns_of(samples: List[Sample]) -> Dict[str, list]:
    """Samples as the columns of an Arrow table."""
    table = {"input_ids": [s["input_ids"].tolist() for s in samples], "labels": [s["labels"].tolist() for s in samples]}
    if any("position_ids" in s for s in samples):
        table["position_ids"] = [s["position_ids"].tolist() for s in samples]
    table["length"] = [len(s["input_ids"]) for s in samples]
    return table


def rows_of(batch: Dict[str, list]) -> List[dict]:
    return [dict(zip(batch, values)) for values in zip(*batch.values())]


def options(builder: str, files: List[Path]) -> dict:
    """CSV cells are read as text: otherwise an answer "42" becomes a number and an empty input a missing value."""
    if builder != "csv":
        return {}
    with open(files[0], newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), [])
    datasets = hf_datasets()
    return {"features": datasets.Features({name: datasets.Value("string") for name in header}), "keep_default_na": False}


def loaded_by_datasets(load, what: str):
    """Call a ``datasets`` loader; what it says about bad or missing data becomes one line."""
    try:
        return load()
    except (OSError, ValueError, hf_datasets().exceptions.DatasetGenerationError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise LitftError(f"could not load {what} ({reason}); check --data.path, --data.name and --data.split") from None


@dataclass
class HF(InstructionData):
    """A Hugging Face dataset: a hub id, or local parquet, arrow, JSON, JSONL or CSV files, map-style or streamed."""

    path: str = ""
    """A hub dataset id, or a local file or folder of .parquet, .arrow, .json, .jsonl or .csv files (or one that save_to_disk wrote)."""
    name: Optional[str] = None
    """The dataset's configuration (a hub dataset's subset)."""
    split: str = "train"
    """The split to train on."""
    val_split: Optional[str] = None
    """The split to validate on (default: the dataset's validation, valid, val or dev split; without one, val_split_fraction of the training split is held out)."""
    val_split_fraction: float = 0.05
    """Share of the training split held out for validation when the dataset has no validation split (map-style data)."""
    columns: Dict[str, str] = field(default_factory=dict)
    """The dataset's column for each field litft reads, where the names differ, e.g. {"prompt": "question", "completion": "answer"}; fields: messages (or conversations), instruction, input, output, prompt, completion, text."""
    streaming: bool = False
    """Read records as a stream, tokenized as training reaches them, for data larger than memory or disk (needs --train.max_steps)."""
    shuffle_buffer: int = 10_000
    """With streaming: the stream is shuffled within windows of this many records."""
    val_samples: int = 200
    """With streaming: validation records, from the head of the validation split (or held out from the head of the training stream)."""
    num_proc: Optional[int] = None
    """Processes that tokenize map-style data (default: up to 8 from 20,000 records on, else one)."""
    prompt_style: PromptStyle = "alpaca"
    """How instruction and prompt/completion records become text: alpaca headers, the tokenizer's chat template, or plain."""
    mask_prompt: bool = True
    """Train only on the response tokens; the prompt carries no loss."""
    max_seq_length: Optional[int] = None
    """Truncate samples (or cut text) to this many tokens (default: the tokenizer's limit, at most 2048)."""
    packing: bool = False
    """Put several samples in one row of max_seq_length tokens, kept apart by position ids (map-style data)."""

    def check(self) -> None:
        super().check()
        if not self.path:
            raise LitftError("--data HF needs --data.path: a hub dataset id, or a local file or folder")
        unknown = sorted(set(self.columns) - set(FIELDS))
        if unknown:
            raise LitftError(f"--data.columns names unknown field(s) {unknown}; the fields are {', '.join(FIELDS)}")
        at_least(self.shuffle_buffer, 1, "--data.shuffle_buffer")
        at_least(self.val_samples, 0, "--data.val_samples")
        at_least(self.num_proc, 1, "--data.num_proc", "to choose by the data's size")
        if self.streaming and self.packing:
            raise LitftError("--data.packing needs map-style data (rows are packed when the data is tokenized); set --data.streaming false")

    # Reading

    def loaded(self, streaming: bool) -> dict:
        """The dataset's splits, read by ``datasets`` (the builder for local files chosen from their extension)."""
        datasets, local = hf_datasets(), Path(self.path).expanduser()
        what = f"dataset {self.path!r}"
        if local.is_dir() and ((local / "dataset_dict.json").is_file() or (local / "state.json").is_file()):
            stored = loaded_by_datasets(lambda: datasets.load_from_disk(str(local)), what)
            splits = dict(stored) if isinstance(stored, datasets.DatasetDict) else {"train": stored}
            return {k: v.to_iterable_dataset() for k, v in splits.items()} if streaming else splits
        if local.is_file():
            builder = BUILDERS.get(local.suffix.lower())
            if builder is None:
                raise LitftError(f"--data.path {local} is not a {', '.join(BUILDERS)} file; convert it or point at a folder of them")
            args, kwargs = (builder,), {"data_files": str(local), **options(builder, [local])}
        elif local.is_dir():
            files = sorted(p for p in local.rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS)
            found = sorted({BUILDERS[p.suffix.lower()] for p in files})
            if len(found) != 1:
                detail = "none" if not found else f"several kinds ({', '.join(found)})"
                raise LitftError(f"folder {local} holds {detail} of {', '.join(BUILDERS)} files; it needs files of one kind")
            args, kwargs = (found[0],), {"data_dir": str(local), **options(found[0], files)}
        elif self.path.startswith((".", "/", "~")) or Path(self.path).suffix.lower() in BUILDERS:
            raise LitftError(f"--data.path {self.path} does not exist; pass an existing file or folder, or a hub dataset id")
        else:
            args, kwargs = (self.path, self.name), {}
        return dict(loaded_by_datasets(lambda: datasets.load_dataset(*args, streaming=streaming, **kwargs), what))

    def splits(self, streaming: bool) -> Tuple[object, Optional[object]]:
        """The training split and the validation split, if the dataset has one."""
        splits = self.loaded(streaming)
        if self.split not in splits:
            raise LitftError(f"dataset {self.path!r} has no split {self.split!r} (it has {', '.join(splits)}); choose one with --data.split")
        if self.val_split is not None and self.val_split not in splits:
            raise LitftError(f"dataset {self.path!r} has no split {self.val_split!r} (it has {', '.join(splits)}); choose one with --data.val_split")
        val_name = self.val_split or next((name for name in VAL_SPLITS if name in splits and name != self.split), None)
        return splits[self.split], splits.get(val_name) if val_name else None

    def names_images(self, column: str = IMAGES) -> bool:
        """An ``images`` column (or ``column``) in the training split, read as a stream (nothing downloaded or converted
        whole at launch): its declared features, or its first record where it declares none."""
        train, _ = self.splits(streaming=True)
        names = getattr(train, "column_names", None)
        if names is None:
            names = list(loaded_by_datasets(lambda: next(iter(train), {}), f"dataset {self.path!r}"))
        return column in names

    def stream_splits(self) -> Tuple[object, Optional[object]]:
        """The splits as streams, their images (where the dataset declares Image values) left as the files' bytes."""
        train, val = self.splits(streaming=True)
        return undecoded_images(train), undecoded_images(val) if val is not None else None

    def layout(self, column_names: List[str]) -> Layout:
        """The dataset's form, found from its columns (after --data.columns renames them)."""
        names = set(column_names)
        columns = {name: self.columns.get(name, name) for name in FIELDS}
        if "messages" not in self.columns and "messages" not in names and "conversations" in names:
            columns["messages"] = "conversations"
        absent = sorted(column for column in self.columns.values() if column not in names)
        if absent:
            raise LitftError(f"--data.columns names column(s) {absent} that dataset {self.path!r} lacks; it has {sorted(names)}")
        for form, needed in FORMS.items():
            if all(columns[name] in names for name in needed):
                return Layout(form, {name: column for name, column in columns.items() if column in names})
        raise LitftError(
            f"dataset {self.path!r} has columns {sorted(names)}; litft reads messages or conversations (chat), instruction/input/output, "
            "prompt/completion or text: map yours with --data.columns, e.g. '{\"prompt\": \"question\", \"completion\": \"answer\"}'"
        )

    # Tokenizing

    def encode_row(self, row: dict, index: int, tokenizer, layout: Layout, max_len: Optional[int]) -> Sample:
        """One record as a sample (a text document as its tokens, whole when ``max_len`` is None)."""
        record = layout.record(row)
        if layout.form == "text":
            ids = torch.tensor(document_ids(tokenizer, record)[:max_len], dtype=torch.long)
            return {"input_ids": ids, "labels": ids.clone(), "id": torch.tensor(index)}
        return self.encode(tokenizer, record, index, f"dataset {self.path!r}", max_len)

    def encode_batch(self, batch: Dict[str, list], indices: List[int], tokenizer, layout: Layout, max_len: int) -> Dict[str, list]:
        """``datasets.map``'s function: a batch of records as samples, one per record, each decided alone (so any split into processes agrees)."""
        cut = None if layout.form == "text" else max_len  # documents are cut into blocks afterwards
        samples = [self.encode_row(row, i, tokenizer, layout, cut) for row, i in zip(rows_of(batch), indices)]
        return columns_of([s for s in samples if (s["labels"] != IGNORE_INDEX).any()])

    def join_batch(self, batch: Dict[str, list], max_len: int, text: bool) -> Dict[str, list]:
        """The second, serial pass: text documents joined and cut into blocks, or samples packed into rows."""
        if text:
            return columns_of(cut_blocks(batch["input_ids"], max_len))
        samples = [{"input_ids": torch.tensor(i), "labels": torch.tensor(lab)} for i, lab in zip(batch["input_ids"], batch["labels"])]
        return columns_of(pack(samples, max_len))

    def prompts_batch(self, batch: Dict[str, list], tokenizer, layout: Layout) -> Dict[str, list]:
        prompts = [self.prompted(tokenizer, layout.record(row), f"dataset {self.path!r}") for row in rows_of(batch)]
        prompts = [p for p in prompts if p is not None]
        return {"prompt_ids": [p.prompt_ids for p in prompts], "reference": [p.reference for p in prompts]}

    def load_or_tokenize(self, tokenizer, seed: int) -> PreparedData:
        """Map-style: tokenized once per dataset fingerprint and read back memory-mapped; streamed: see ``stream.py``."""
        if self.streaming:
            return streamed(self, tokenizer, seed)
        train, val = self.splits(streaming=False)
        source = f"{train._fingerprint}:{val._fingerprint if val is not None else ''}"
        if IMAGES in train.column_names:  # image records: tokenized by the model's processor, as JSON's (litft.data.images)
            return DataModule.load_or_tokenize(self, tokenizer, seed, source=source)
        key = self.cache_key(tokenizer, seed, source=source)
        cache = litft_home() / "datasets" / f"hf-{key}"
        if not (cache / "dataset_dict.json").is_file():
            if val is None:
                train_idx, val_idx = split_indices(len(train), self.val_split_fraction, seed)
                train, val = train.select(train_idx), train.select(val_idx)
            self.tokenize_into(cache, train, val, tokenizer, key)
        stored = hf_datasets().load_from_disk(str(cache))
        return PreparedData(
            train=ArrowSamples(stored["train"]), val=ArrowSamples(stored["val"], first_id=len(stored["train"])),
            scoring=ArrowPrompts(stored["scoring"]),
        )

    def records(self, seed: int):
        """A dataset with an ``images`` column (``datasets`` Image values, a list a record) as image records."""
        train, val = self.splits(streaming=False)
        if val is None:
            train_idx, val_idx = split_indices(len(train), self.val_split_fraction, seed)
            train, val = train.select(train_idx), train.select(val_idx)
        layout = self.image_layout(train.column_names)
        train, val = undecoded_images(train), undecoded_images(val)
        return [image_record(layout, row) for row in train], [image_record(layout, row) for row in val], f"dataset {self.path!r}"

    def image_layout(self, column_names: List[str]) -> Layout:
        """The form of a vision dataset's records beside its ``images`` column: chat or prompt/completion conversations."""
        layout = self.layout([c for c in column_names if c != IMAGES])
        if layout.form not in ("chat", "completion"):
            raise LitftError(f"dataset {self.path!r} has an images column beside {layout.form} records; image records are messages or "
                             "prompt/completion conversations whose turns hold {'type': 'image'} parts (map yours with --data.columns)")
        return layout

    def stream_encoder(self, tokenizer, column_names: List[str], max_len: int) -> Tuple[Callable[[dict, int], Sample], bool]:
        """How a streamed record becomes a sample, and whether the records are image records (not scored by generation).

        An image record's tokens are never cut, and a stream's global batches keep their size (each rank its micro-batches):
        a record longer than ``max_len`` becomes a sample without targets (one token), which adds nothing to the loss."""
        if IMAGES not in column_names:
            layout = self.layout(column_names)
            return (lambda row, index: self.encode_row(row, index, tokenizer, layout, max_len)), False
        layout, images = self.image_layout(column_names), ImageRecords(tokenizer, self.mask_prompt)
        filler = images.processor.tokenizer.eos_token or images.processor.tokenizer.pad_token

        def encode(row: dict, index: int) -> Sample:
            where = f"record {index} of dataset {self.path!r}"
            sample = images.encode(image_record(layout, row), index, where, max_len)
            if sample is not None:
                return sample
            if filler is None:
                raise LitftError(f"{where} is longer than {max_len} tokens with its images (whose tokens are never cut); raise "
                                 "--data.max_seq_length")
            ids = images.tokens(filler, [], where)
            return {"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX), "id": torch.tensor(index), "text": filler, "images": []}

        return encode, True

    def tokenize_into(self, cache: Path, train, val, tokenizer, key: str) -> None:
        """Tokenize both splits in parallel processes and save them (with the scoring prompts) as one folder, renamed into place."""
        datasets, layout = hf_datasets(), self.layout(train.column_names)
        max_len = self.effective_max_length(tokenizer)
        procs = self.num_proc or (min(os.cpu_count() or 1, 8) if len(train) >= PARALLEL_FROM else 1)
        staging = cache.parent / f".{cache.name}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        print(f"tokenizing {len(train):,} + {len(val):,} records of {self.path} ({layout.form}) in {procs} process(es), once", file=sys.stderr, flush=True)

        def mapped(table, function, name, columns, parallel=True, size=MAP_BATCH, with_indices=False, **kwargs):
            declared = features(*columns)
            if not len(table):  # datasets maps an empty table to one without columns
                return datasets.Dataset.from_dict({column: [] for column in declared}, features=declared)
            workers = procs if parallel and procs > 1 and len(table) > 1 else None
            return table.map(
                function, batched=True, batch_size=size, with_indices=with_indices, remove_columns=table.column_names, num_proc=workers,
                fn_kwargs=kwargs, cache_file_name=str(staging / f"{name}.arrow"), new_fingerprint=f"{key}-{name}", features=declared,
            )

        parts = {}
        for name, table in (("train", train), ("val", val)):
            tokens = mapped(table, self.encode_batch, name, TOKENS, with_indices=True, tokenizer=tokenizer, layout=layout, max_len=max_len)
            text = layout.form == "text"
            rows = TOKENS if text else PACKED
            joined = text or self.packing
            parts[name] = mapped(tokens, self.join_batch, f"{name}-rows", rows, parallel=False, size=BLOCK_BATCH, max_len=max_len, text=text) if joined else tokens
        if not len(parts["train"]):
            raise LitftError(f"dataset {self.path!r} holds no usable training sample (too short for a block, or nothing to train on after truncation)")
        prompts = val if layout.form != "text" else val.select([])
        parts["scoring"] = mapped(prompts, self.prompts_batch, "scoring", PROMPTS, tokenizer=tokenizer, layout=layout)
        partial = cache.parent / f".{cache.name}.partial{os.getpid()}"
        # An empty split needs one shard asked for: saved as none, it would not load back.
        empty = {name: 1 for name, part in parts.items() if not len(part)}
        datasets.DatasetDict(parts).save_to_disk(str(partial), num_shards=empty)
        os.replace(partial, cache)
        shutil.rmtree(staging, ignore_errors=True)


def undecoded_images(table):
    """``table`` (a dataset, or a stream) with its ``datasets`` Image values left as the files' bytes, decoded once checked."""
    declared = (getattr(table, "features", None) or {}).get(IMAGES)
    datasets = hf_datasets()
    if isinstance(declared, datasets.Image):
        return table.cast_column(IMAGES, datasets.Image(decode=False))
    inner = getattr(declared, "feature", None)
    if isinstance(inner, datasets.Image):
        return table.cast_column(IMAGES, datasets.List(datasets.Image(decode=False)))
    return table  # paths, or a stream whose features are not known: read as they come


def image_record(layout: Layout, row: dict) -> dict:
    """A row of a vision dataset as an image record: its conversation, and its images (one, or a list) as a list."""
    entry = row[IMAGES]
    return dict(layout.record(row), images=list(entry or []) if isinstance(entry, (list, tuple)) else [] if entry is None else [entry])

