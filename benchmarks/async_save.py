"""How long training stands still for a checkpoint, written in line and with --train.async_save.

A random Llama of a few hundred MB (``--hidden``, ``--layers``; litft-tiny's tokenizer), full fine-tuning in fp32 (so a
checkpoint holds the weights and both AdamW moments: three times the model), one process, a save every
``--save_interval`` steps. Each mode runs in a fresh process; printed per mode: the model's and a checkpoint's size, the
seconds each save blocked the loop (metrics.csv's ``save_blocked_s``), their mean over the saves inside the run (the
final one waits for its write in both modes, so it is left out), and the run's seconds per step; then the background
mode's blocked time over the in-line one's.

    python benchmarks/async_save.py                       # 1024 wide, 6 layers: about 330 MB of weights
    python benchmarks/async_save.py --hidden 1536 --layers 8
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchkit import model_folder, python_path  # noqa: E402

MODES = ("in-line", "background")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save_interval", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work_dir", type=Path, default=None)
    return parser.parse_args(argv)


def run(args, model: Path, work: Path, mode: str) -> dict:
    out = work / f"run-{mode}"
    flags = [
        "finetune_full", str(model), "--data", "TinyTasks", "--data.num_train", "256", "--data.num_val", "8",
        "--train.global_batch_size", "8", "--train.micro_batch_size", "8", "--train.max_steps", str(args.steps),
        "--train.save_interval", str(args.save_interval), "--train.keep_checkpoints", "2", "--train.warmup_steps", "1",
        "--eval.initial_validation", "false", "--eval.final_validation", "false", "--eval.interval", "0",
        "--precision", "32-true", "--accelerator", "cpu", "--logger_name", "csv", "--out_dir", str(out), "--overwrite", "true",
        *(["--train.async_save", "true"] if mode == "background" else []),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=python_path(ROOT))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "litft", *flags], cwd=work, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{done.stderr[-3000:]}")
    with open(out / "logs" / "csv" / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f)]
    blocked = {int(r["step"]): r["save_blocked_s"] for r in rows if "save_blocked_s" in r}
    inside = [s for step, s in blocked.items() if step < args.steps]
    checkpoint = max((out / "checkpoints").iterdir())
    size = sum(f.stat().st_size for f in (checkpoint / "model").iterdir()) / 1e6
    steps = [r for r in rows if "tokens_per_s" in r]
    return {"mode": mode, "checkpoint_mb": round(size), "blocked_s": {k: round(v, 3) for k, v in blocked.items()},
            "blocked_s_mean": sum(inside) / len(inside), "run_s": round(seconds, 1), "steps": len(steps)}


def main(argv=None) -> None:
    args = parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="litft-async-save-"))
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    model = model_folder(work, args.hidden, args.layers)
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 1e6
    print(f"model {model.name}: {weights:.0f} MB of fp32 weights", flush=True)
    results = {}
    for mode in MODES:
        results[mode] = run(args, model, work, mode)
        print(json.dumps(results[mode]), flush=True)
    ratio = results["background"]["blocked_s_mean"] / results["in-line"]["blocked_s_mean"]
    print(f"background over in-line: {ratio:.2f}x the seconds a save blocks training "
          f"({results['background']['blocked_s_mean']:.2f} vs {results['in-line']['blocked_s_mean']:.2f} s)")


if __name__ == "__main__":
    main()
