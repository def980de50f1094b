"""Many litft commands in a few long-lived processes, each command exactly as a user types it.

Starting Python, torch, transformers and DeepSpeed costs a rank about as much as
training a tiny model for a few steps; a test file of 2-rank comparisons that
starts each run afresh spends most of its time importing. Here ``world``
processes start once, with the environment a launcher gives (RANK, WORLD_SIZE,
MASTER_ADDR), and run every command in turn through litft's own CLI entry point,
each on a fresh rendezvous port; every run's out_dir is left for the tests to read.
The path a user's ``--devices N`` takes (litft starting its own processes) is the
launcher tests' (tests/distributed/test_launchers.py).

    python -m tests.batch PLAN RANK     # one worker; run_batch starts them
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

RESULTS = "results.jsonl"


LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")


def run_batch(commands: List[List[str]], root: Path, world: int, env: Optional[dict] = None, timeout: float = 1500) -> Dict[int, dict]:
    """Run ``commands`` (litft argument lists) one after another on ``world`` ranks; index -> {"ok", "error"} per command."""
    root.mkdir(parents=True, exist_ok=True)
    plan = root / "plan.json"
    plan.write_text(json.dumps({"commands": [[str(a) for a in c] for c in commands], "root": str(root)}))
    (root / RESULTS).unlink(missing_ok=True)
    base = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1")
    for key in LAUNCH_VARIABLES:
        base.pop(key, None)
    procs = []
    for rank in range(world):
        rank_env = dict(base)
        if world > 1:  # what a launcher gives each rank
            rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
        log = open(root / f"worker-{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "tests.batch", str(plan), str(rank)], env=rank_env, stdout=log,
                                       stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1]), log))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
        time.sleep(0.3)
    for p, log in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        log.close()
    results = {}
    if (root / RESULTS).is_file():
        for line in (root / RESULTS).read_text().splitlines():
            record = json.loads(line)
            results[record["index"]] = record
    tail = (root / "worker-0.log").read_text()[-3000:]
    for index in range(len(commands)):
        results.setdefault(index, {"index": index, "ok": False, "error": f"no result (the workers ended or timed out): ...{tail}"})
    return results


class Batch:
    """Named litft commands, run when a test first asks for a result: one set of processes per world size (ranks that ran
    different jobs before would disagree on DeepSpeed's process-wide numbering), in batches ordered so that a command
    reading another's out_dir (a resume) runs after it, with as few sets started as that allows: within a phase the
    larger worlds run first, so a run resumed on fewer ranks than it was saved on needs no phase of its own."""

    def __init__(self, root: Path):
        self.root = root
        self.commands: Dict[str, tuple] = {}  # name -> (world, arguments, out_dir, phase)
        self.results: Optional[Dict[str, dict]] = None

    def add(self, name: str, world: int, *args, out: Optional[Path] = None) -> Path:
        """Register a command for ``world`` ranks; its out_dir (``root/name`` unless given: a resumed run continues in its
        first run's) is returned and added to it."""
        out = out or self.root / name
        args = [*map(str, args), "--out_dir", str(out)]
        # After every earlier command whose out_dir it reads: in the same phase where that one ran before it (the same world, earlier
        # in the batch; or a larger world, whose batch runs first), else in a later phase.
        phase = max([c[3] + (c[0] < world) for c in self.commands.values() if any(str(c[2]) in a for a in args[:-2])], default=0)
        self.commands[name] = (world, args, out, phase)
        return out

    def _batches(self) -> List[tuple]:
        keys = sorted({(c[3], c[0]) for c in self.commands.values()}, key=lambda key: (key[0], -key[1]))  # larger worlds first
        return [(phase, world, [n for n, c in self.commands.items() if (c[3], c[0]) == (phase, world)]) for phase, world in keys]

    def out(self, name: str) -> Path:
        """The run's out_dir, once every command has run; the run's error and its workers' last lines where it failed."""
        if self.results is None:
            self.results = {}
            for phase, world, names in self._batches():
                done = run_batch([self.commands[n][1] for n in names], self.root / f"batch-{phase}-{world}", world)
                self.results.update({n: done[i] for i, n in enumerate(names)})
        result = self.results[name]
        if not result["ok"]:
            logs = "".join(self._section(name, rank)[-2500:] for rank in range(self.commands[name][0]))
            raise AssertionError(f"{name}: litft {' '.join(self.commands[name][1])} {result['error']}\n{logs}")
        return self.commands[name][2]

    def output(self, name: str) -> str:
        """What rank 0 printed while running this command."""
        self.out(name)
        return self._section(name, 0)

    def _section(self, name: str, rank: int) -> str:
        world, _, _, phase = self.commands[name]
        index = next(names for p, w, names in self._batches() if (p, w) == (phase, world)).index(name)
        log = (self.root / f"batch-{phase}-{world}" / f"worker-{rank}.log").read_text()
        return log.split(f"=== {index}: litft ", 1)[-1].split(f"\n=== {index + 1}: litft ", 1)[0]


def worker(plan_path: str, rank: str) -> None:
    """Every command of the plan in turn, each on a fresh rendezvous port; rank 0 records how each ended."""
    from litft.__main__ import main
    from litft.cli.selfcheck import case_port

    plan = json.loads(Path(plan_path).read_text())
    root = Path(plan["root"])
    distributed = "WORLD_SIZE" in os.environ
    for index, command in enumerate(plan["commands"]):
        if distributed:
            os.environ["MASTER_PORT"] = str(case_port(root, index, rank))
        print(f"=== {index}: litft {' '.join(command)}", flush=True)
        error, started = None, time.perf_counter()
        try:
            main(command)
        except SystemExit as stop:
            if stop.code not in (0, None):
                error = f"exited {stop.code}"
        except Exception as err:  # noqa: BLE001 - a failing command fails its test, not the rest of the batch
            import traceback

            traceback.print_exc()
            error = f"{type(err).__name__}: {err}"[:2000]
        if rank == "0":
            with open(root / RESULTS, "a") as f:
                f.write(json.dumps({"index": index, "ok": error is None, "error": error, "seconds": round(time.perf_counter() - started, 2)}) + "\n")


if __name__ == "__main__":
    worker(*sys.argv[1:3])
