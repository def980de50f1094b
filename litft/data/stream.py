"""Streamed data: records read as training reaches them and tokenized on the fly, in an order that is a pure function of the seed.

The records of an epoch come in windows of ``shuffle_buffer`` records, each
window permuted by a generator seeded from (seed, epoch, window). Global batch
``k`` of an epoch is records ``k*G .. (k+1)*G - 1`` of that order, and rank ``r``
takes every ``world_size``-th of them, as ``SampleOrder`` does for map-style data:
so the step's samples do not depend on the world size, and a resumed run reads
its way back to the window of its next record (reading, not tokenizing, the
records before it) and goes on with the same samples. Every rank reads every
record of the stream and tokenizes only its own.
"""

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from litft.data.base import PreparedData

from litft.data.order import collated

from litft.data.samples import IGNORE_INDEX, Sample
from litft.errors import LitftError


def window_seed(seed: int, epoch: int, window: int) -> int:
    return ((seed * 1_000_003 + epoch) * 1_000_003 + window) % 2**63


@dataclass
class RecordStream:
    """A dataset's training records in the seeded order of an epoch, from any position, with each record's place in the stream."""

    dataset: object  # a datasets.IterableDataset, read from its start each time
    skip: int  # records at the head held out for validation
    buffer: int
    seed: int

    def records(self, epoch: int, start: int) -> Iterator[Tuple[int, dict]]:
        """(id, record) from position ``start`` of the epoch's order on; the id is the record's place in the unshuffled stream."""
        window = start // self.buffer
        raw = islice(iter(self.dataset), self.skip + window * self.buffer, None)
        while True:
            chunk = list(islice(raw, self.buffer))
            if not chunk:
                return
            order = torch.randperm(len(chunk), generator=torch.Generator().manual_seed(window_seed(self.seed, epoch, window)))
            first = window * self.buffer
            for offset, j in enumerate(order.tolist()):
                if first + offset >= start:
                    yield first + j, chunk[j]
            window += 1


class StreamBatches:
    """This rank's collated micro-batches of every step of a stream, read one step ahead on a worker thread.

    The same interface as ``StepBatches``: ``position`` moves to the next epoch
    when the stream has no full global batch left, ``get`` gives the micro-batches.
    """

    def __init__(self, stream: RecordStream, encode: Callable[[dict, int], Sample], global_batch_size: int, micro_batch_size: int,
                 rank: int, world_size: int, pad_id: int, pin: bool = False, padding_free: bool = False,
                 split: Optional[Callable[[dict], dict]] = None):
        self.stream, self.encode = stream, encode
        self.global_batch_size, self.micro_batch_size, self.rank, self.world_size = global_batch_size, micro_batch_size, rank, world_size
        self.pad_id, self.pin, self.padding_free, self.split = pad_id, pin, padding_free, split
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="litft-stream")
        self.cursor: Optional[Tuple[int, int, Iterator]] = None  # (epoch, next position, records); touched by the worker only
        self.made: Dict[Tuple[int, int], Future] = {}

    def read(self, epoch: int, step: int) -> Optional[List[dict]]:
        """This rank's micro-batches of global batch ``step`` of the epoch; None when the epoch's stream ends before it is full."""
        start = step * self.global_batch_size
        if self.cursor is None or self.cursor[:2] != (epoch, start):
            self.cursor = (epoch, start, self.stream.records(epoch, start))
        records = self.cursor[2]
        batch = list(islice(records, self.global_batch_size))
        self.cursor = (epoch, start + len(batch), records)
        if len(batch) < self.global_batch_size:
            return None
        mine = [self.encode(record, index) for index, record in batch[self.rank :: self.world_size]]
        size = self.micro_batch_size
        return collated([mine[i : i + size] for i in range(0, len(mine), size)], self.pad_id, self.padding_free, self.pin, self.split)

    def ahead(self, epoch: int, step: int) -> Future:
        if (epoch, step) not in self.made:
            self.made[(epoch, step)] = self.pool.submit(self.read, epoch, step)
        return self.made[(epoch, step)]

    def position(self, epoch: int, step: int) -> Tuple[int, int]:
        if self.ahead(epoch, step).result() is not None:
            return epoch, step
        if self.ahead(epoch + 1, 0).result() is None:
            raise LitftError(f"the training stream holds fewer records than one global batch ({self.global_batch_size}); lower --train.global_batch_size")
        return epoch + 1, 0

    def get(self, epoch: int, step: int, run_step: int = 0) -> List[dict]:
        micro = self.ahead(epoch, step).result()
        self.made = {key: future for key, future in self.made.items() if key >= (epoch, step)}
        self.ahead(epoch, step + 1)
        return micro

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class StreamSource:
    """The training side of streamed data: the records and how one becomes a sample."""

    stream: RecordStream
    encode: Callable[[dict, int], Sample]
    images: bool = False  # image records (litft.data.images), whose batches the model's processor completes at each step

    def step_batches(self, global_batch_size: int, micro_batch_size: int, rank: int, world_size: int, pad_id: int, pin: bool,
                     padding_free: bool = False, split: Optional[Callable[[dict], dict]] = None) -> StreamBatches:
        return StreamBatches(self.stream, self.encode, global_batch_size, micro_batch_size, rank, world_size, pad_id, pin, padding_free, split)


def streamed(module, tokenizer, seed: int) -> PreparedData:
    """``module`` (an HF data module) read as a stream: validation records tokenized now, training records as training reaches them."""
    train, val = module.stream_splits()
    names = train.column_names or list(next(iter(train), {}).keys())
    if not names:
        raise LitftError(f"the training split of dataset {module.path!r} is empty")
    encode, images = module.stream_encoder(tokenizer, names, module.effective_max_length(tokenizer))
    held_out = val is None
    val_rows = list(islice(iter(train if held_out else val), module.val_samples))
    samples = [encode(row, i) for i, row in enumerate(val_rows)]
    layout = None if images else module.layout(names)  # image records are not scored by generation yet
    scoring = [] if layout is None or layout.form == "text" else [
        module.prompted(tokenizer, layout.record(row), f"dataset {module.path!r}") for row in val_rows]
    stream = RecordStream(train, len(val_rows) if held_out else 0, module.shuffle_buffer, seed)
    return PreparedData(
        train=StreamSource(stream, encode, images), val=[s for s in samples if (s["labels"] != IGNORE_INDEX).any()],
        scoring=[p for p in scoring if p is not None],
    )
