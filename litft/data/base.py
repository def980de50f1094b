"""What every dataset becomes: lists of token tensors, an order per rank, padded micro-batches."""

import hashlib
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from litft.config import at_least, fraction
from litft.errors import LitftError

IGNORE_INDEX = -100
# Bump when tokenization, masking or packing changes, so old caches are not reused.
CACHE_VERSION = 2

# A sample is {"input_ids": LongTensor[T], "labels": LongTensor[T], "id": int}; packed rows
# also carry "position_ids" that restart at 0 for every sample inside them.
Sample = Dict[str, torch.Tensor]


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

    def load_or_tokenize(self, tokenizer, seed: int) -> PreparedData:
        """Tokenize once and keep the result in ``$LITFT_HOME/datasets``; later runs read it."""
        cache = litft_home() / "datasets" / f"{type(self).__name__.lower()}-{self.cache_key(tokenizer, seed)}.pt"
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


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash that changes when the tokenizer would split or template text differently."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update(backend.to_str().encode() if backend is not None else str(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(str(getattr(tokenizer, "chat_template", "")).encode())
    digest.update(str((tokenizer.bos_token_id, tokenizer.eos_token, getattr(tokenizer, "add_bos_token", None))).encode())
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


PACKING_WINDOW = 32


def pack(samples: List[Sample], max_length: int) -> List[Sample]:
    """Put whole samples side by side in rows of at most ``max_length`` tokens.

    Position ids restart at every sample; transformers turns such restarts into a
    block-diagonal causal mask, so packed samples do not attend to one another.
    Greedy first-fit in the given order keeps packing deterministic.
    """
    rows: List[List[Sample]] = []
    lengths: List[int] = []
    open_rows: List[int] = []  # the last few rows that still have room; a bounded search keeps packing linear
    for sample in samples:
        n = len(sample["input_ids"])
        for i in open_rows:
            if lengths[i] + n <= max_length:
                rows[i].append(sample)
                lengths[i] += n
                break
        else:
            rows.append([sample])
            lengths.append(n)
            open_rows = (open_rows + [len(rows) - 1])[-PACKING_WINDOW:]
    packed = []
    for row_id, row in enumerate(rows):
        labels = [s["labels"].clone() for s in row]
        for later in labels[1:]:
            # The first token of a sample is not predicted from the sample before it.
            later[0] = IGNORE_INDEX
        packed.append(
            {
                "input_ids": torch.cat([s["input_ids"] for s in row]),
                "labels": torch.cat(labels),
                "position_ids": torch.cat([torch.arange(len(s["input_ids"])) for s in row]),
                "id": torch.tensor(row_id),
            }
        )
    return packed


def collate(samples: List[Sample], pad_id: int, padding_free: bool = False) -> Dict[str, torch.Tensor]:
    """One micro-batch: its samples end to end in one row (``padding_free``), or right-padded rows.

    Every batch carries position ids and no attention mask. A padding-free row's
    positions restart at every sample and its attention keeps the samples apart
    (``litft.attention``); a sample's first token is not trained on the sample before
    it. Padding carries no loss, and its positions count on from the row's last
    sample: a reset would read as a packed row and cost a dense S x S mask. Beside the
    tokens: where each sample starts (varlen), and the flat positions of the tokens
    that carry loss with the tokens they predict (for the loss on targets only).
    """
    lengths = torch.cat([attended_lengths(s) for s in samples])
    if padding_free:
        labels = [s["labels"].clone() for s in samples]
        for later in labels[1:]:
            later[0] = IGNORE_INDEX
        input_ids = torch.cat([s["input_ids"] for s in samples])[None]
        labels = torch.cat(labels)[None]
        position_ids = torch.cat([s.get("position_ids", torch.arange(len(s["input_ids"]))) for s in samples])[None]
    else:
        width = max(len(s["input_ids"]) for s in samples)
        input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
        labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros((len(samples), width), dtype=torch.long)
        for row, sample in enumerate(samples):
            n = len(sample["input_ids"])
            input_ids[row, :n] = sample["input_ids"]
            labels[row, :n] = sample["labels"]
            position_ids[row, :n] = sample.get("position_ids", torch.arange(n))
            position_ids[row, n:] = torch.arange(width - n) + position_ids[row, n - 1] + 1
    batch = {
        "input_ids": input_ids, "labels": labels, "position_ids": position_ids,
        "ids": torch.stack([torch.as_tensor(s["id"]) for s in samples]),
        "num_tokens": lengths.sum(), "lengths": lengths,  # what attends together, for the FLOPs
        "varlen": cumulative_lengths(position_ids),
        "targets": targets_of(labels),
    }
    if "rejected_start" in samples[0]:  # preference pairs (litft.data.preference): two sequences each, chosen then rejected
        batch["pairs"] = len(samples)  # what the loss is a mean over; under context parallel, counted by one rank of the group
        batch["targets"]["sequence"] = sequence_of(batch["targets"]["index"], position_ids)
        if "reference" in samples[0]:  # log-probs of the reference model, scored before training
            batch["reference"] = torch.stack([s["reference"] for s in samples])
    return batch


def sequence_of(index: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Which sequence of the batch (counted over the flattened rows, where position ids restart) each flat position belongs to."""
    return (sample_starts(position_ids).flatten().cumsum(0) - 1)[index]


def targets_of(labels: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The flat positions of the tokens that carry loss, and the tokens they predict: token t predicts label t + 1."""
    predicted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).flatten()
    index = (predicted != IGNORE_INDEX).nonzero().flatten()
    return {"index": index, "labels": predicted[index]}


def attended_lengths(sample: Sample) -> torch.Tensor:
    """The lengths of the documents a sample attends as (a packed row is several), so MFU counts attention as it runs."""
    if "position_ids" not in sample:
        return torch.tensor([len(sample["input_ids"])])
    return sample_lengths(sample["position_ids"][None])


def sample_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Where a sample begins, in every row: wherever the position id does not count on by one."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def sample_lengths(position_ids: torch.Tensor) -> torch.Tensor:
    """Lengths of the samples of every row, in order."""
    begins = sample_starts(position_ids).flatten().nonzero().flatten()
    return torch.diff(begins, append=torch.tensor([position_ids.numel()], device=begins.device))


def cumulative_lengths(position_ids: torch.Tensor) -> dict:
    """The varlen keyword arguments of a batch (on the CPU, where collate made it): cumulative sample lengths and the longest.

    transformers hands them to every attention call, and FlashAttention-2 takes them as they are. Computed
    once per micro-batch before the model, so no layer reads anything back from the device.
    """
    lengths = sample_lengths(position_ids)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    longest = int(lengths.max())
    # litft_bounds: the same boundaries as host integers, for litft_segments' call per sample (model.py passes it to that path only).
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest, "litft_bounds": tuple(cu.tolist())}


class SampleOrder:
    """Which samples each rank takes at each step; a pure function of (seed, epoch, step).

    Global batch ``k`` of an epoch is ``perm[k*G:(k+1)*G]``; rank ``r`` takes every
    ``world_size``-th sample of it starting at ``r``. So the same global batch is
    trained whatever the world size, and resuming at step k needs no replay.
    """

    def __init__(self, num_samples: int, global_batch_size: int, micro_batch_size: int, rank: int, world_size: int, seed: int, shuffle: bool = True):
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.steps_per_epoch = num_samples // global_batch_size
        self._perm_epoch: Optional[int] = None
        self._perm: List[int] = []

    def permutation(self, epoch: int) -> List[int]:
        if self._perm_epoch != epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                self._perm = torch.randperm(self.num_samples, generator=gen).tolist()
            else:
                self._perm = list(range(self.num_samples))
            self._perm_epoch = epoch
        return self._perm

    def micro_batches(self, epoch: int, step: int) -> List[List[int]]:
        perm = self.permutation(epoch)
        start = step * self.global_batch_size
        mine = perm[start + self.rank : start + self.global_batch_size : self.world_size]
        return [mine[i : i + self.micro_batch_size] for i in range(0, len(mine), self.micro_batch_size)]


def _pinned(batch):
    """The batch in page-locked memory, so that its copy to the GPU does not wait for the host."""
    if torch.is_tensor(batch):
        return batch.pin_memory()
    return {k: _pinned(v) for k, v in batch.items()} if isinstance(batch, dict) else batch


class StepBatches:
    """This rank's collated micro-batches of every step, made one step ahead on a worker thread.

    The next step's batches are collated (and pinned, for a GPU's non-blocking copy)
    while the current step computes; which samples they hold is still the
    ``SampleOrder``'s pure function of (epoch, step).
    """

    def __init__(self, samples: List[Sample], order: "SampleOrder", pad_id: int, padding_free: bool = False, pin: bool = False,
                 split: Optional[Callable[[dict], dict]] = None):
        self.samples, self.order, self.pad_id, self.padding_free, self.pin, self.split = samples, order, pad_id, padding_free, pin, split
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="litft-collate")
        self.ahead = None

    def position(self, epoch: int, step: int) -> Tuple[int, int]:
        """(epoch, step) itself, or the start of the next epoch once this one has no global batch left."""
        return (epoch + 1, 0) if step >= self.order.steps_per_epoch else (epoch, step)

    def make(self, epoch: int, step: int):
        indices = self.order.micro_batches(epoch, step)
        return collated([[self.samples[i] for i in idx] for idx in indices], self.pad_id, self.padding_free, self.pin, self.split)

    def get(self, epoch: int, step: int):
        """The micro-batches of this step of this epoch; the next step's are started at once."""
        if self.ahead is not None and self.ahead[0] == (epoch, step):
            made = self.ahead[1].result()
        else:
            made = self.make(epoch, step)
        following = (epoch, step + 1) if step + 1 < self.order.steps_per_epoch else (epoch + 1, 0)
        self.ahead = (following, self.pool.submit(self.make, *following))
        return made

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def collated(micro_samples: List[List[Sample]], pad_id: int, padding_free: bool, pin: bool,
             split: Optional[Callable[[dict], dict]] = None) -> List[Dict[str, torch.Tensor]]:
    """Micro-batches of samples, collated, cut to this rank's slice where ``split`` says (context parallel), and pinned, for a
    GPU's non-blocking copy."""
    micro = [collate(samples, pad_id, padding_free) for samples in micro_samples]
    if split is not None:
        micro = [split(b) for b in micro]
    return [_pinned(b) for b in micro] if pin else micro


def eval_batches(num_samples: int, micro_batch_size: int, rank: int, world_size: int) -> Iterator[List[int]]:
    """Validation samples for this rank, every sample exactly once across ranks.

    Every rank gets the same number of batches; a rank whose share ran out gets
    empty ones, so that collective calls inside forward stay matched.
    """
    mine = list(range(rank, num_samples, world_size))
    per_rank = math.ceil(num_samples / world_size)
    for i in range(0, per_rank, micro_batch_size):
        yield mine[i : i + micro_batch_size]
