"""Saving a run every N steps and at the end, keeping the newest few, and resuming it on any topology."""

import copy
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml

from litft.checkpoint.format import (
    CHECKPOINTS, META, RUN_CONFIG, CheckpointMeta, complete_checkpoints, fsync_dir, rng_state, set_rng_state,
    step_name, write_synced,
)
from litft.errors import LitftError
from litft.ranks import on_every_rank, on_rank_zero


def host_copy(value):
    """A copy of a state dict in host memory, for a background write while training changes the original.

    Tensors already on the host are copied too (a checkpoint written from the live tensors would mix steps); a DTensor
    stays a DTensor (its shard copied, its mesh and placements kept), which DCP needs to place it in the whole tensor.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to("cpu") if value.device.type != "cpu" else copy.deepcopy(value.detach())
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(v) for v in value)
    return value


@dataclass
class PendingSave:
    """A checkpoint whose DCP files are being written by a background thread, and what its commit writes."""

    step: int
    partial: Path
    final: Path
    written: Optional[Future]  # None when written in line
    meta: CheckpointMeta
    extras: Dict[str, object]

    def wait(self) -> None:
        try:
            self.written.result()
        except Exception as err:  # noqa: BLE001 - DCP's messages run to many lines
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
            raise LitftError(f"writing checkpoint {self.final} in the background failed ({type(err).__name__}: {first}); the checkpoints "
                             "before it are kept") from None


class Checkpointer:
    """Writes and reads this run's checkpoints; what they must agree with is ``meta`` (built from the run).

    The strategy writes and reads the training state itself (DCP shards in one
    layout for every strategy); the checkpointer owns the folder, the commit and the rest.
    """

    def __init__(self, fabric, strategy, lm, optimizer, scheduler, out_dir: Path, train, meta: CheckpointMeta, run_config: dict):
        self.fabric, self.strategy, self.lm, self.optimizer, self.scheduler = fabric, strategy, lm, optimizer, scheduler
        self.out_dir = Path(out_dir)
        self.keep = train.keep_checkpoints
        self.meta = meta
        self.run_config = run_config
        self.last_saved: Optional[int] = None
        self.last_path: Optional[Path] = None  # the newest finished checkpoint of this run
        self.extras: Dict[str, object] = {}  # small files rank 0 writes into every checkpoint (``keep_file``)
        self.background = train.async_save
        self.pending: Optional[PendingSave] = None  # a checkpoint being written in the background (--train.async_save)
        self.group = None  # the background writes' own process group

    def keep_file(self, name: str, value) -> None:
        """A small file rank 0 writes into every checkpoint from now on: ``value`` itself (a preference run's reference scores),
        or a callable giving it at each save (RL's rollouts of an unfinished cycle; None writes nothing)."""
        self.extras[name] = value

    def save(self, position: dict) -> Optional[Path]:
        """Every rank writes its part into ``.step-N.partial``; rank 0 then writes meta.json and renames it.

        ``position`` is the loop's state_dict (step, epoch, tokens, ...). With ``--train.async_save`` each rank copies its
        part to host memory and writes it in a background thread: the checkpoint is committed by ``complete`` (at the next
        step that finds it written, the next save, or the run's end) and None is returned meanwhile.
        """
        fabric, step = self.fabric, position["step"]
        assert self.pending is None, "complete() the background write before the next save"  # the loop does, to report it
        root = self.out_dir / CHECKPOINTS
        final, partial = root / step_name(step), root / f".{step_name(step)}.partial"

        def prepare():
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
            partial.mkdir(parents=True)

        on_rank_zero(fabric, prepare, "preparing a checkpoint folder")
        fabric.barrier()
        group = self._writer_group() if self.background else None

        def write_own_part():
            state = self.strategy.checkpoint_state(self.lm, self.optimizer)
            (partial / "rng").mkdir(exist_ok=True)
            torch.save(rng_state(), partial / "rng" / f"rank-{fabric.global_rank:05d}.pt")
            if not self.background:
                dcp.save(state, checkpoint_id=str(partial / "model"))
                return None
            staged = host_copy(state)
            writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="litft-checkpoint")
            future = writer.submit(dcp.save, staged, checkpoint_id=str(partial / "model"), process_group=group)
            writer.shutdown(wait=False)  # the thread ends with its one write
            return future

        future = on_every_rank(fabric, write_own_part, f"writing checkpoint {final}")
        meta = replace(self.meta, position=dict(position), world_size=fabric.world_size, scheduler=self.scheduler.state_dict())
        extras = {name: value() if callable(value) else value for name, value in self.extras.items()} if fabric.global_rank == 0 else {}
        self.last_saved = step
        pending = PendingSave(step, partial, final, future, meta, extras)
        if self.background:
            self.pending = pending
            return None
        fabric.barrier()  # every rank's files are written
        return self._commit_everywhere(pending)

    def written(self) -> bool:
        """Whether this rank's background write has ended (rank 0's ends after every rank's: DCP's metadata is written last)."""
        return self.pending is not None and self.pending.written.done()

    def complete(self) -> Optional[Path]:
        """The checkpoint being written in the background, waited for on every rank and committed: its path, or None if no
        write was pending. Every rank calls it at the same point."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        on_every_rank(self.fabric, pending.wait, f"writing checkpoint {pending.final}")  # every rank's files are written
        return self._commit_everywhere(pending)

    def _commit_everywhere(self, pending: "PendingSave") -> Path:
        """Rank 0 commits the checkpoint every rank has written; every rank then knows it as the newest."""
        on_rank_zero(self.fabric, lambda: self._commit(pending), f"finishing checkpoint {pending.final}")
        self.fabric.barrier()
        self.last_path = pending.final
        return pending.final

    def _commit(self, pending: "PendingSave") -> None:
        """Rank 0: run config, extras and meta.json, then the rename that makes the checkpoint count."""
        partial, final = pending.partial, pending.final
        (partial / RUN_CONFIG).write_text(yaml.safe_dump(self.run_config, sort_keys=False))
        for name, value in pending.extras.items():
            if value is not None:
                torch.save(value, partial / name)
        write_synced(partial / META, pending.meta.to_json())
        if final.exists():  # the same step saved before (a resumed run ending where it started)
            shutil.rmtree(final)
        os.replace(partial, final)
        fsync_dir(final.parent)
        for old in complete_checkpoints(self.out_dir)[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def _writer_group(self):
        """A gloo group of its own for the background writes' collectives: the training's group (NCCL on GPUs, or gloo used
        by the main thread meanwhile) must not carry them. Made once, by every rank at its first save."""
        if self.group is None and dist.is_available() and dist.is_initialized():
            self.group = dist.new_group(backend="gloo")
        return self.group

    def resume(self, path: Optional[Path]) -> Optional[dict]:
        """Check on every rank that the checkpoint (``resolve_resume``'s answer) fits this run, and load it.

        The loop's position to continue from, or None when there is nothing to resume.
        """
        if path is None:
            return None

        def check():
            stored = CheckpointMeta.read(path)
            stored.check_fits(path, self.meta)
            return stored

        stored = on_every_rank(self.fabric, check, "checking the checkpoint to resume from")
        self.strategy.load(path, self.lm, self.optimizer)
        self.scheduler.load_state_dict(stored.scheduler)
        rng_file = path / "rng" / f"rank-{self.fabric.global_rank:05d}.pt"
        if rng_file.is_file():  # a rank that did not exist when it was written keeps its seeded generators
            set_rng_state(torch.load(rng_file, weights_only=True))
        self.last_saved, self.last_path = stored.step, Path(path)
        return stored.position
