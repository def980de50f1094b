"""The figures litft must not lose, measured the way a user's machine sees them, and appended to a history in the repo.

    python benchmarks/record.py                         # the CPU figures (about 25 minutes on 2 CPU cores)
    python benchmarks/record.py --figures zero3_lora_peak_defaults fsdp_accumulation
    python benchmarks/record.py --suite_seconds 1712    # also record a suite time measured elsewhere
    python benchmarks/record.py --accelerator cuda      # the GPU figures (benchmarks/gpu_record.py), about 8 minutes
    python benchmarks/record.py --accelerator cuda --dry   # the GPU plan checked on the CPU, under a minute

Run it before a change to the loop, the strategies, attention, data or loading lands,
and commit the lines it appends to ``benchmarks/history.jsonl``: commit, date,
machine, device, torch, transformers and peft, figure, value. Each figure is
printed with its change since that figure's last entry on the same device, so a
slip shows the day it happens. It is a benchmark, not a test: CI does not run it.

CPU figures (memory as a share of the model's fp32 bytes, speed as a ratio to HF
Trainer run in the same invocation, each ratio the mean of two runs: one run of the
same commit moves by about 5%):

- ``zero3_lora_peak_defaults``: ``litft finetune_lora`` at its default flags under ZeRO-3 on 2 ranks, 32-true, one step of a 0.97 GB random Llama (20
  layers, hidden 1024, MLP 2816): the largest rank's peak anonymous memory above the
  same run on a tiny model. No rank should ever hold the whole model (goal <= 0.8).
  ``zero3_lora_peak_vocab`` and ``zero3_lora_peak_wide``: the same on held-out shapes, a tied 32k
  vocabulary (16% of the model: ZeRO-3 gathers it whole) and 6 blocks of hidden 2048.
- ``fsdp_accumulation``: ``litft finetune_full`` under FSDP FULL_SHARD on 2 ranks,
  micro-batch 1, 2 steps of the same model, global batch 8 against 2: what
  accumulating 4 micro-batches adds to the largest rank's peak (goal < 0.25).
- ``lora_vs_trainer`` and ``full_vs_trainer`` (micro-batch 4, global 8) and
  ``lora_vs_trainer_mb8`` and ``full_vs_trainer_mb8`` (micro-batch 8, global 16):
  chat SFT of SmolLM2-135M-Instruct, 12 steps, 2 threads, litft's tokens/s over
  Trainer's on the same samples and batches (``benchmarks/vs_hf_trainer.py``; goal
  >= 1.3); ``*_memory_vs_trainer*``: litft's peak resident memory over Trainer's
  (goal <= 1.0). LoRA at litft's defaults (no dropout, peft's default too), and
  ``lora_dropout_vs_trainer*`` with ``--lora_dropout 0.05`` on both sides;
  ``lora_dropout_cost*``: litft's LoRA step time at 0.05 over its time at 0 (goal <= 1.1), from the
  ``litft-dropout-alternating`` side (dropout on every other step, then the other steps, in two runs), not from the
  two sides' separate runs, whose own speeds move by more than the cost (their ratio is printed as ``..._separate``).

Peaks are each process's anonymous resident memory (``RssAnon``), sampled every
10 ms over the whole process tree the command starts: loading, every step,
checkpoint saving and the export included, as the out-of-memory killer sees it.
"""

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(ROOT))  # this checkout's litft (the folders it makes), whichever one is installed

from figures import HISTORY, record  # noqa: E402  (benchmarks/ is the scripts' own path)
SHAPES = {"": (4, 8), "_mb8": (8, 16)}  # figure suffix: (micro-batch, global batch); the second is the shape users reported
BIG = dict(hidden=1024, layers=20, intermediate=2816)
TINY = dict(hidden=128, layers=1, intermediate=384)
# Held-out shapes for ZeRO-3 LoRA's peak: a tied 32k vocabulary (16% of the model, as Llama 3.2 1B's 21%), and 6 wide blocks.
HELD_OUT = {"vocab": dict(hidden=1024, layers=16, intermediate=2816, vocab=32768, tied=True),
            "wide": dict(hidden=2048, layers=6, intermediate=5632)}


class TreePeak:
    """The largest anonymous resident memory any process of a tree reached, sampled every 10 ms."""

    def __init__(self, root_pid: int):
        self.root, self.peak, self.done = root_pid, 0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _tree(self) -> List[int]:
        pids, i = [self.root], 0
        while i < len(pids):
            try:  # a process may end while it is listed, a thread while it is read
                tasks = list(Path(f"/proc/{pids[i]}/task").glob("*"))
            except OSError:
                tasks = []
            for task in tasks:
                try:
                    pids += [int(c) for c in (task / "children").read_text().split()]
                except OSError:
                    pass
            i += 1
        return pids

    def _sample(self):
        while not self.done.is_set():
            for pid in self._tree():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                found = re.search(r"RssAnon:\s+(\d+) kB", status)
                if found:
                    self.peak = max(self.peak, int(found.group(1)) * 1024)
            self.done.wait(0.01)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.peak


def run_peak(command: List[str], env: dict) -> int:
    """Run a command; the largest anonymous memory any of its processes held (bytes)."""
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = TreePeak(process.pid)
    output, _ = process.communicate()
    top = peak.stop()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command[:6])}... exited {process.returncode}:\n{output[-3000:]}")
    return top


def llama_folder(work: Path, hidden: int, layers: int, intermediate: int, vocab: int = 384, tied: bool = False) -> Path:
    """A random Llama of the shape with litft-tiny's tokenizer (ids past it never used), saved once; its fp32 bytes are the model size."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from litft.model.tiny import ensure_tiny_model

    folder = work / f"llama-{hidden}x{layers}-vocab{vocab}{'-tied' if tied else ''}"
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                             num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, max_position_embeddings=256,
                             tie_word_embeddings=tied)
        LlamaForCausalLM(config).save_pretrained(folder)
        AutoTokenizer.from_pretrained(ensure_tiny_model()).save_pretrained(folder)
    return folder


def model_bytes(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                count = 1
                for n in shape:
                    count *= n
                total += 4 * count
    return total


def litft_peak(job: str, folder: Path, out: Path, flags: List[str]) -> int:
    data = ["--data", "TinyTasks", "--data.num_train", "64", "--data.num_val", "8", "--accelerator", "cpu", "--precision", "32-true",
            "--eval.initial_validation", "false", "--logger_name", "csv", "--overwrite", "true", "--out_dir", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DS_ACCELERATOR="cpu")
    return run_peak([sys.executable, "-m", "litft", job, str(folder), *data, *flags], env)


def zero3_lora_peak_defaults(work: Path, shape: Optional[dict] = None) -> float:
    flags = ["--strategy", "deepspeed", "--deepspeed.stage", "3", "--devices", "2", "--train.global_batch_size", "2",
             "--train.micro_batch_size", "1", "--train.max_steps", "1"]
    big, tiny = llama_folder(work, **(shape or BIG)), llama_folder(work, **TINY)
    grown = litft_peak("finetune_lora", big, work / "out", flags) - litft_peak("finetune_lora", tiny, work / "out", flags)
    return grown / model_bytes(big)


def fsdp_accumulation(work: Path) -> float:
    big = llama_folder(work, **BIG)
    flags = ["--strategy", "fsdp", "--fsdp.sharding_strategy", "FULL_SHARD", "--devices", "2", "--train.micro_batch_size", "1",
             "--train.max_steps", "2"]
    peaks = {g: litft_peak("finetune_full", big, work / "out", [*flags, "--train.global_batch_size", str(g)]) for g in (8, 2)}
    return (peaks[8] - peaks[2]) / model_bytes(big)


def versus_trainer(work: Path, runs: int = 2) -> Dict[str, float]:
    """Speed and memory over Trainer's at both batch shapes at litft's defaults, and LoRA again with dropout 0.05 on both
    sides; each figure the mean of ``runs`` invocations (each run printed)."""
    figures: Dict[str, List[float]] = {}
    separate: Dict[str, List[float]] = {}
    for shape, (micro, total) in SHAPES.items():
        for run in range(runs):
            litft_rate = {}
            for jobs, extra, name in (("lora,full", [], "{run}"), ("lora", ["--lora_dropout", "0.05"], "{run}_dropout")):
                for row in vs_trainer_rows(work, micro, total, jobs, extra, "litft,trainer"):
                    figure = name.format(run=row["run"])
                    if row["side"] == "litft":
                        litft_rate[figure] = row["tokens_per_s"]
                    elif row["side"] == "trainer":
                        figures.setdefault(f"{figure}_vs_trainer{shape}", []).append(row["litft_speed_over_this"])
                        figures.setdefault(f"{figure}_memory_vs_trainer{shape}", []).append(row["litft_memory_over_this"])
            # Printed, not recorded: two processes' own speeds move by more than the cost (lora_dropout_cost measures it).
            separate.setdefault(f"lora_dropout_cost_separate{shape}", []).append(litft_rate["lora"] / litft_rate["lora_dropout"])
    for name, values in sorted({**figures, **separate}.items()):
        print(f"  {name}: runs {', '.join(f'{v:.3f}' for v in values)}", flush=True)
    return {name: sum(values) / len(values) for name, values in figures.items()}


def lora_dropout_cost(work: Path, micro: int, total: int, runs: int = 2) -> float:
    """LoRA's step time at dropout 0.05 over its time at 0 (vs_hf_trainer's litft-dropout-alternating side: two runs, each
    switching dropout every step, the second on the other steps, so each step's batch is timed both ways and each
    process's own speed counts alike on both sides); the mean of ``runs`` invocations."""
    costs = [row["dropout_cost"] for _ in range(runs)
             for row in vs_trainer_rows(work, micro, total, "lora", ["--lora_dropout", "0.05"], "litft-dropout-alternating")]
    print(f"  lora_dropout_cost at micro-batch {micro}: runs {', '.join(f'{c:.3f}' for c in costs)}", flush=True)
    return sum(costs) / len(costs)


def vs_trainer_rows(work: Path, micro: int, total: int, jobs: str, extra: List[str], sides: str) -> List[dict]:
    command = [sys.executable, str(ROOT / "benchmarks" / "vs_hf_trainer.py"), "--jobs", jobs, "--sides", sides, "--steps", "12",
               "--threads", "2", "--micro_batch", str(micro), "--global_batch", str(total), "--work_dir", str(work / "vs"), *extra]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"vs_hf_trainer.py exited {out.returncode}:\n{out.stderr[-3000:]}")
    rows = json_rows(out.stdout)
    for row in rows:
        if row.get("error"):
            raise SystemExit(f"vs_hf_trainer.py: {row['error']}")
    return rows


def json_rows(stdout: str) -> List[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


MEASURES = {"zero3_lora_peak_defaults": zero3_lora_peak_defaults, "fsdp_accumulation": fsdp_accumulation,
            **{f"lora_dropout_cost{shape}": functools.partial(lora_dropout_cost, micro=micro, total=total) for shape, (micro, total) in SHAPES.items()},
            **{f"zero3_lora_peak_{name}": functools.partial(zero3_lora_peak_defaults, shape=shape) for name, shape in HELD_OUT.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--figures", nargs="+", default=None, help="CPU: the names of MEASURES and vs_trainer; "
                        "CUDA: the groups of benchmarks/gpu_record.py")
    parser.add_argument("--dry", action="store_true", help="with --accelerator cuda: check the plan on the CPU (no GPU, nothing appended)")
    parser.add_argument("--suite_seconds", type=float, default=None, help="the test suite's time from a clean clone, measured elsewhere")
    parser.add_argument("--no_history", action="store_true", help="print only; append nothing")
    parser.add_argument("--seconds", type=float, default=470.0, help="with --accelerator cuda: the call's time; groups that would pass it are left out")
    args = parser.parse_args()
    if args.accelerator == "cuda":
        from gpu_record import run_gpu_record

        run_gpu_record(args.figures, dry=args.dry, history=Path(os.devnull) if args.no_history or args.dry else HISTORY, seconds=args.seconds)
        return
    chosen = args.figures or [*MEASURES, "vs_trainer"]
    work = Path(tempfile.mkdtemp(prefix="litft-record-"))
    figures: Dict[str, float] = {}
    try:
        for name in chosen:
            started = time.perf_counter()
            if name == "vs_trainer":
                figures.update(versus_trainer(work))
            else:
                figures[name] = MEASURES[name](work)
            print(f"measured {name} in {time.perf_counter() - started:.0f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.suite_seconds is not None:
        figures["suite_seconds"] = args.suite_seconds
    for line in record(figures, Path(os.devnull) if args.no_history else HISTORY):
        print(line)


if __name__ == "__main__":
    main()
