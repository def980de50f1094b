"""The longest single sequence a job trains on this GPU: one real training step per length tried, searched from the estimate.

    python benchmarks/longest_sequence.py --runs 8b-qlora-long --side offload --seconds 450
    python benchmarks/longest_sequence.py --runs 8b-lora-long --side checkpointed --start 131072

A length "fits" when ``litft finetune_lora`` at micro-batch 1 finishes one step at it (an out-of-memory, on the device or
the host, is a length that does not). The search starts where ``litft estimate --longest true`` says (the estimate is on
the safe side by 8-20% on an H200, so the first try is 10% past it), grows by 15% while lengths fit, then halves the gap
between the longest fitting and the shortest failing length until they are within 2% or the next try would not end inside
``--seconds`` (a try's time is predicted from the last one's, as the square of the length: attention). Each try prints a
JSON line as it ends; the last line holds the result, so a call cut short still says the longest length that fitted.
"""

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
SIDES = {"checkpointed": "checkpointed", "offload": "offload"}  # vs_hf_trainer.py's litft sides (offload: + tiled MLP)
GRAIN = 1024  # lengths tried are multiples of this


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cuda", choices=("cuda",))
    parser.add_argument("--runs", default="8b-qlora-long", help="one of vs_hf_trainer.py's runs at micro-batch 1 (8b-qlora-long, 8b-lora-long)")
    parser.add_argument("--side", default="offload", choices=sorted(SIDES), help="checkpointed, or offload (with the tiled MLP)")
    parser.add_argument("--start", type=int, default=None, help="the first length tried (default: 1.1 x the estimate's longest)")
    parser.add_argument("--seconds", type=float, default=450.0, help="the whole search's time; no try starts that would pass it")
    parser.add_argument("--work_dir", type=Path, default=None)
    return parser.parse_args(argv)


def next_length(fitting: Optional[int], failing: Optional[int], start: int) -> Optional[int]:
    """The next length to try from the longest that fitted and the shortest that failed; None once they are within 2%
    (or the grain), or when nothing new is left between them."""
    if fitting is None and failing is None:
        return round_to_grain(start)
    if failing is None:
        length = round_to_grain(fitting * 1.15)
    elif fitting is None:
        length = round_to_grain(failing * 0.85)
        if length >= failing:  # failing at the grain itself: nothing shorter to try
            return None
    elif failing - fitting <= max(GRAIN, 0.02 * fitting):
        return None
    else:
        length = round_to_grain((fitting + failing) / 2)
    return None if length == fitting or length == failing else length


def out_of_memory(failure: Exception) -> bool:
    """A try that ran out of memory: the device's (torch's error) or the host's (the kernel's kill, -9)."""
    text = str(failure)
    return "out of memory" in text.lower() or "OutOfMemoryError" in text or " exited -9" in text


def round_to_grain(length: float) -> int:
    return max(GRAIN, int(length) // GRAIN * GRAIN)


def search(try_length: Callable[[int], dict], start: int, seconds: float, clock=time.monotonic, began: Optional[float] = None) -> dict:
    """Try lengths while time allows (``seconds`` from ``began``, the process's start: the model's build and the estimate
    count); ``try_length(n)`` -> {"fits": bool, "s": seconds, ...}. The longest fitting and the shortest failing length."""
    began = clock() if began is None else began
    fitting, failing, tries = None, None, []
    length = next_length(fitting, failing, start)
    while length is not None:
        timed = [t for t in tries if t["fits"]] or tries  # a failed try may have ended early (out of memory in its first block)
        if timed:  # quadratic in length (attention)
            predicted = timed[-1]["s"] * (length / timed[-1]["seq_len"]) ** 2
            if clock() - began + predicted > seconds:
                break
        result = {"seq_len": length, **try_length(length)}
        tries.append(result)
        print(json.dumps(result), flush=True)
        if result["fits"]:
            fitting = max(fitting or 0, length)
        else:
            failing = min(failing or math.inf, length)
        length = next_length(fitting, failing, start)
    return {"longest_fitting": fitting, "shortest_failing": failing, "tries": len(tries)}


def host_gib() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemTotal")) / 2**20


def estimated_longest(model: Path, load, side: str, device_gb: float) -> int:
    """``litft estimate --longest true`` for the run's flags on a device of ``device_gb``, shortened in proportion where the
    host memory it needs (offloaded activations) passes 80% of this machine's: the device alone does not bound offload."""
    flags = [sys.executable, "-m", "litft", "estimate", str(model), "--job", f"finetune_{load.job}", "--precision", load.precision,
             "--train.micro_batch_size", "1", "--train.gradient_checkpointing", "true", "--device_memory_gb", f"{device_gb:.1f}",
             "--longest", "true", "--json", "true"]
    if load.job == "lora":
        flags += ["--lora_r", str(load.lora_r)]
    if load.quantize:
        flags += ["--quantize", load.quantize]
    if side == "offload":
        flags += ["--train.activation_offload", "true", "--train.tiled_mlp", "true"]
    estimate = json.loads(subprocess.run(flags, cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    host = estimate["total"]["cpu"] / 2**30  # the offloaded activations, pinned
    return int(estimate["seq_len"] * min(1.0, 0.8 * host_gib() / host) if host else estimate["seq_len"])


def main(argv=None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(1, str(ROOT))
    import torch
    from gpu_throughput import random_text, random_weights
    from vs_hf_trainer import CUDA_RUNS, SideFailed, litft_side

    started = time.monotonic()
    if not torch.cuda.is_available():
        raise SystemExit("longest_sequence.py needs a CUDA device")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="litft-longest-"))
    base = CUDA_RUNS[args.runs]
    model = random_weights(base.shape, work, base.layers)
    device_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    start = args.start or round_to_grain(1.1 * estimated_longest(model, base, args.side, device_gb))
    side_args = SimpleNamespace(accelerator="cuda", steps=1, skip=0, seed=0, gradient_checkpointing=False, threads=8, litft_flags="")

    def try_length(length: int) -> dict:
        load = dataclasses.replace(base, seq_len=length)
        random_text(work, length * 3)
        began = time.monotonic()
        try:
            row = litft_side(side_args, load, model, work, SIDES[args.side])
        except SideFailed as failure:
            if not out_of_memory(failure):  # any other failure is a bug to see, not a length limit to record
                raise
            return {"fits": False, "s": time.monotonic() - began, "error": failure.line}
        return {"fits": True, "s": time.monotonic() - began, "peak_gb": row["peak_gb"], "tokens_per_s": row["tokens_per_s"]}

    print(json.dumps({"run": args.runs, "side": args.side, "device_gib": round(device_gb, 1), "start": start}), flush=True)
    result = search(try_length, start, args.seconds, began=started)
    print(json.dumps({"run": args.runs, "side": args.side, **result}), flush=True)


if __name__ == "__main__":
    main()
