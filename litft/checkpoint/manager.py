"""Saving a run every N steps and at the end, keeping the newest few, and resuming it on any topology."""

import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Dict, Optional

import torch
import yaml

from litft.checkpoint.format import (
    CHECKPOINTS, META, RUN_CONFIG, CheckpointMeta, complete_checkpoints, fsync_dir, rng_state, set_rng_state,
    step_name, write_synced,
)
from litft.ranks import on_every_rank, on_rank_zero


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

    def keep_file(self, name: str, value) -> None:
        """A small file rank 0 writes into every checkpoint from now on: ``value`` itself (a preference run's reference scores),
        or a callable giving it at each save (RL's rollouts of an unfinished cycle; None writes nothing)."""
        self.extras[name] = value

    def save(self, position: dict) -> Path:
        """Every rank writes its part into ``.step-N.partial``; rank 0 then writes meta.json and renames it.

        ``position`` is the loop's state_dict (step, epoch, tokens, ...).
        """
        fabric, step = self.fabric, position["step"]
        root = self.out_dir / CHECKPOINTS
        final, partial = root / step_name(step), root / f".{step_name(step)}.partial"

        def prepare():
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
            partial.mkdir(parents=True)

        on_rank_zero(fabric, prepare, "preparing a checkpoint folder")
        fabric.barrier()

        def write_own_part():
            self.strategy.save(partial, self.lm, self.optimizer)
            (partial / "rng").mkdir(exist_ok=True)
            torch.save(rng_state(), partial / "rng" / f"rank-{fabric.global_rank:05d}.pt")

        on_every_rank(fabric, write_own_part, f"writing checkpoint {final}")
        fabric.barrier()

        def commit():
            meta = replace(self.meta, position=dict(position), world_size=fabric.world_size, scheduler=self.scheduler.state_dict())
            (partial / RUN_CONFIG).write_text(yaml.safe_dump(self.run_config, sort_keys=False))
            for name, value in self.extras.items():
                value = value() if callable(value) else value
                if value is not None:
                    torch.save(value, partial / name)
            write_synced(partial / META, meta.to_json())
            if final.exists():  # the same step saved before (a resumed run ending where it started)
                shutil.rmtree(final)
            os.replace(partial, final)
            fsync_dir(root)
            for old in complete_checkpoints(self.out_dir)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)

        on_rank_zero(fabric, commit, f"finishing checkpoint {final}")
        fabric.barrier()
        self.last_saved, self.last_path = step, final
        return final

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
