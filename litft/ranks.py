"""Collective agreement on failure: a rank that fails stops every rank with one line, none is left waiting.

A rank that raises alone leaves the others blocked at their next collective until
the process group's timeout. Each helper here ends with every rank learning
whether any rank failed. Ranks that wait for long work of another (rank 0
tokenizing or exporting for an hour) wait on the process group's store, which has
no deadline, and not in a collective, which has one; the peer watch names a rank
that died meanwhile.
"""

import itertools
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from litft.errors import LitftError

_calls = itertools.count()  # every rank makes the same calls in the same order, so their numbers name them


def _describe(err: BaseException) -> str:
    return str(err) if isinstance(err, LitftError) else f"{type(err).__name__}: {err}"


def agree_on_failure(fabric, error: Optional[BaseException], stage: str) -> None:
    """Every rank learns whether any rank failed at ``stage``, so none waits at a later collective.

    The failing rank re-raises its own exception; the others stop with one line
    naming the stage, instead of hanging until a timeout.
    """
    if fabric.world_size > 1:
        failed = fabric.all_reduce(torch.tensor(float(error is not None), device=fabric.device), reduce_op="sum")
        if error is None and failed.item() > 0:
            raise LitftError(f"another rank failed while {stage}; its message says why")
    if error is not None:
        raise error


class _Board:
    """Results posted on the process group's store under one call's number, read without a deadline."""

    def __init__(self, fabric):
        self.fabric = fabric
        self.store = dist.PrefixStore(f"litft/ranks/{next(_calls)}/", _get_default_store())

    def post(self, key: str, error: Optional[BaseException]) -> None:
        self.store.set(key, "" if error is None else "\x00" + _describe(error))

    def wait(self, keys: List[str], poll: float = 0.2, deadline: Optional[float] = None) -> Optional[List[str]]:
        """The messages under ``keys`` once all are posted (empty for success); None if ``deadline`` seconds pass first."""
        started = time.monotonic()
        while not self.store.check(keys):
            if deadline is not None and time.monotonic() - started > deadline:
                return None
            time.sleep(poll)
        return [v.decode()[1:] if v else "" for v in self.store.multi_get(keys)]

    def read_rank_zero(self, rank: int) -> List[str]:
        """Rank 0's result, and a note that this rank has read it."""
        messages = self.wait(["rank0"])
        self.post(f"read{rank}", None)
        return messages

    def held_until_read(self, world_size: int) -> None:
        """Rank 0 holds the store: after a failure it stays until every rank has read its message (a minute at most),
        so that none finds the store gone instead of the message."""
        self.wait([f"read{r}" for r in range(1, world_size)], deadline=60)


def _run(fn: Callable):
    try:
        return fn(), None
    except Exception as err:  # noqa: BLE001 - reported to every rank by the caller
        return None, err


def rank_zero_first(fabric, fn: Callable, stage: str):
    """Run ``fn`` on rank 0, then on the first rank of every other node, then on the rest (which find their node's caches).

    So a download or a tokenization happens once per node, and a failure on rank 0 is
    every rank's one line before any other rank repeats the work.
    """
    if fabric.world_size == 1:
        return fn()
    board = _Board(fabric)
    rank, node = fabric.global_rank, fabric.node_rank
    first_of_node = fabric.local_rank == 0
    if rank == 0:
        result, error = _run(fn)
        board.post("rank0", error)
        if error is not None:
            board.held_until_read(fabric.world_size)
            raise error
    else:
        [message] = board.read_rank_zero(rank)
        if message:
            raise LitftError(message)
        if not first_of_node:  # the node's first rank fills the node's caches first
            [message] = board.wait([f"node{node}"])
        result, error = _run(fn)
    if first_of_node:
        board.post(f"node{node}", error)
    board.post(f"done{rank}", error)
    messages = board.wait([f"done{r}" for r in range(fabric.world_size)])
    if error is not None:
        raise error
    if any(messages):
        raise LitftError(f"another rank failed while {stage}: {next(m for m in messages if m)}")
    return result


def on_rank_zero(fabric, fn: Callable, stage: str):
    """Run ``fn`` on rank 0 alone while the others wait on the store; a failure there stops every rank."""
    if fabric.world_size == 1:
        return fn()
    board = _Board(fabric)
    result, error = _run(fn) if fabric.global_rank == 0 else (None, None)
    if fabric.global_rank == 0:
        board.post("rank0", error)
        if error is not None:
            board.held_until_read(fabric.world_size)
            raise error
        return result
    [message] = board.read_rank_zero(fabric.global_rank)
    if message:
        raise LitftError(f"rank 0 failed while {stage}: {message}")
    return result


def on_every_rank(fabric, fn: Callable, stage: str):
    """Run ``fn`` on every rank; if any rank fails, every rank stops (the failing one with its own error)."""
    result, error = _run(fn)
    agree_on_failure(fabric, error, stage)
    return result
