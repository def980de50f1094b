"""Collective agreement on failure: a rank that fails stops every rank with one line, none is left waiting.

A rank that raises alone leaves the others blocked at their next collective until
the process group's timeout (30 minutes). Each helper here ends with a collective
in which every rank learns whether any rank failed.
"""

from typing import Callable, Optional

import torch

from litft.errors import LitftError


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


def rank_zero_first(fabric, fn: Callable, stage: str):
    """Run ``fn`` on rank 0, then on the others (which find rank 0's caches).

    Rank 0's error message is sent to every rank, so all of them exit with the
    same line instead of waiting for a rank that has stopped.
    """
    result, error = None, None
    if fabric.global_rank == 0:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - re-raised below on rank 0
            error = err
    message = _describe(error) if error is not None else None
    if fabric.world_size > 1:
        message = fabric.broadcast(message, src=0)
    if error is not None:
        # The broadcast already told every rank; a further collective would wait for ranks that have exited.
        raise error
    if message is not None:
        raise LitftError(message)
    if fabric.global_rank != 0:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - reported to every rank below
            error = err
    agree_on_failure(fabric, error, stage)
    return result


def on_rank_zero(fabric, fn: Callable, stage: str) -> None:
    """Run ``fn`` on rank 0 alone; a failure there stops every rank instead of stranding them."""
    error = None
    if fabric.global_rank == 0:
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - re-raised by agree_on_failure
            error = err
    agree_on_failure(fabric, error, stage)


def on_every_rank(fabric, fn: Callable, stage: str):
    """Run ``fn`` on every rank; if any rank fails, every rank stops (the failing one with its own error)."""
    result, error = None, None
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001 - re-raised by agree_on_failure
        error = err
    agree_on_failure(fabric, error, stage)
    return result
