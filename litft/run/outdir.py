"""out_dir as a run claims it: nothing written or deleted before every input is checked, and nothing of an earlier run lost
to a start that fails.

A run checks its flags, its data, its reward functions and its resume target before it touches out_dir (litft.run.trainer).
It then claims the folder: an earlier run there is refused, continued (``--resume``), or, with ``--overwrite``, set aside in
``out_dir/.replaced`` rather than deleted. The earlier run is deleted only once the new one has saved its first checkpoint;
a start that fails before that (a reward that raises at step-0 validation, a crash) takes back what it wrote and puts the
earlier run where it was, so the corrected command starts as if the failed one had never run. A ``.replaced`` left by a
start that was killed is put back the next time a run starts in the folder (``reconcile``).
"""

import shutil
from pathlib import Path
from typing import Optional

import yaml

from litft.checkpoint.format import CHECKPOINTS, RUN_CONFIG, complete_checkpoints
from litft.errors import LitftError

REPLACED = ".replaced"
OUTPUTS = (RUN_CONFIG, "logs", CHECKPOINTS, "rollouts", "final", "final-adapter")  # what a litft run writes into out_dir


class OutDir:
    """The run's out_dir: ``check`` (no writes), ``claim`` (rank 0, once every input is checked), ``settle`` (after a
    checkpoint) and ``release`` (after a failure)."""

    def __init__(self, path: Path, overwrite: bool, continues: bool):
        self.path, self.overwrite, self.continues = Path(path), overwrite, continues  # continues: --resume inside out_dir
        self.claimed = self.settled = self.created = False

    @property
    def replaced(self) -> Path:
        return self.path / REPLACED

    def reconcile(self) -> None:
        """Finish what a killed start left: the run it set aside comes back, unless it saved a checkpoint (then it is the run)."""
        if not self.replaced.is_dir():
            return
        if complete_checkpoints(self.path):
            shutil.rmtree(self.replaced)
        else:
            self._put_back()

    def check(self) -> None:
        """Refuse an out_dir with files in it, unless it is an earlier litft run and --overwrite or --resume was given."""
        out = self.path
        if out.exists() and not out.is_dir():
            raise LitftError(f"--out_dir {out} is a file; choose a folder")
        if not out.exists() or not any(out.iterdir()):
            return
        if not (out / RUN_CONFIG).is_file():
            raise LitftError(f"--out_dir {out} holds files that litft did not write; choose another --out_dir")
        if not (self.continues or self.overwrite):
            raise LitftError(f"--out_dir {out} already holds a run; choose another --out_dir, pass --resume auto to continue it or --overwrite true")

    def claim(self, recorded: dict) -> None:
        """Rank 0, once every input is checked: set aside the run --overwrite replaces, and write the run's config."""
        self.check()
        self.created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        if self.overwrite and not self.continues:
            held = [name for name in OUTPUTS if (self.path / name).exists()]
            if held:
                self.replaced.mkdir()
                for name in held:
                    (self.path / name).rename(self.replaced / name)
        (self.path / RUN_CONFIG).write_text(yaml.safe_dump(recorded, sort_keys=False))
        self.claimed = True

    def settle(self) -> None:
        """After a checkpoint of this run: the run it replaced is gone for good."""
        if self.claimed and not self.settled:
            shutil.rmtree(self.replaced, ignore_errors=True)
            self.settled = True

    def release(self) -> Optional[str]:
        """After a failure: a start that saved no checkpoint takes back what it wrote, and the run it replaced comes back; the
        line saying so, or None where there was nothing to undo."""
        if not self.claimed or self.settled or self.continues:
            return None
        for name in OUTPUTS:
            target = self.path / name
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
        came_back = self._put_back()
        if self.created and not any(self.path.iterdir()):
            self.path.rmdir()
        return f"out_dir {self.path}: this start saved no checkpoint, so what it wrote is removed" + (
            " and the run --overwrite would have replaced is back" if came_back else "")

    def _put_back(self) -> bool:
        if not self.replaced.is_dir():
            return False
        for item in self.replaced.iterdir():
            target = self.path / item.name
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
            item.rename(target)
        self.replaced.rmdir()
        return True
