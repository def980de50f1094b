"""``--profile true``: torch.profiler over a few training steps after warm-up, a Chrome trace and a table of top operators per rank."""

from pathlib import Path
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile

WARMUP_STEPS = 2  # the first steps allocate, autotune and fill caches: not what a step costs
PROFILED_STEPS = 3
TOP_OPERATORS = 15


class StepProfiler:
    """Starts after the warm-up steps of this launch and stops after a few more; does nothing when the flag is off.

    Each rank writes ``out_dir/logs/profile/rank-N.json`` (open it in Perfetto or
    chrome://tracing) and ``rank-N.txt`` (its operators by self time); rank 0
    prints its table.
    """

    def __init__(self, enabled: bool, folder: Path, rank: int, device: torch.device, start_step: int, total_steps: int, say: Callable[[str], None]):
        self.enabled, self.folder, self.rank, self.device, self.say = enabled, folder, rank, device, say
        steps = total_steps - start_step
        self.first = start_step + min(WARMUP_STEPS, max(steps - 1, 0))  # a short run is profiled from its first step
        self.last = min(self.first + PROFILED_STEPS, total_steps)
        self.running: Optional[profile] = None

    def after(self, step: int) -> None:
        """Called once the optimizer step ``step`` is done (and with the start step before any)."""
        if not self.enabled:
            return
        if self.running is None and step == self.first and step < self.last:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.running = profile(activities=activities, record_shapes=True)
            self.running.start()
        elif self.running is not None and step >= self.last:
            self.stop()

    def stop(self) -> None:
        """Write this rank's trace and table (also when the run ends inside the profiled steps)."""
        if self.running is None:
            return
        running, self.running = self.running, None
        running.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        running.export_chrome_trace(str(self.folder / f"rank-{self.rank:05d}.json"))
        order = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = running.key_averages().table(sort_by=order, row_limit=TOP_OPERATORS)
        (self.folder / f"rank-{self.rank:05d}.txt").write_text(table + "\n")
        self.say(f"profile of steps {self.first + 1}-{self.last}, top operators by self time on rank {self.rank} "
                 f"(every rank's trace and table in {self.folder}):\n{table}")
