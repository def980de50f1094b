"""Tokens/s, MFU and peak memory of litft on one GPU, for a real model shape, full finetune and LoRA.

    python benchmarks/gpu_throughput.py --model llama-3.2-1b --seq_len 2048 --micro_batch_size 4

The model is one of config_hub/models (real shapes, random bf16 weights written
here: nothing is downloaded), trained on random text by the same `litft` commands
a user runs, so the numbers include everything the framework does per step. The
figures come from the run's own log (steady state: the median of the steps
after --warmup_steps), so they are the ones a user sees.
"""

import argparse
import csv
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]


def random_weights(name: str, work: Path, layers: Optional[int] = None) -> Path:
    """The config's model (``layers`` of its layers) with random bf16 weights and litft-tiny's tokenizer, saved as a model folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from litft.model.tiny import ensure_tiny_model

    shipped = ROOT / "config_hub" / "models" / name
    folder = work / f"{Path(name).name}-random{f'-{layers}' if layers else ''}"
    if (folder / "config.json").is_file():
        return folder
    config = AutoConfig.from_pretrained(shipped if shipped.is_dir() else name)
    if layers:
        config.num_hidden_layers = layers
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(ensure_tiny_model()).save_pretrained(folder)
    return folder


def random_text(work: Path, tokens: int) -> Path:
    """Enough words of random letters for ``tokens`` tokens of litft-tiny's tokenizer (about one per letter)."""
    path = work / "text" / "train.txt"
    if path.is_file() and path.stat().st_size >= tokens:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = (" ".join("".join(rng.choice("abcdefghij") for _ in range(5)) for _ in range(2000)) for _ in range(tokens // 10000 + 1))
    path.write_text("\n\n".join(words))
    return path


def steady_state(out_dir: Path, warmup: int) -> dict:
    with open(out_dir / "logs" / "csv" / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f)]
    steps = [r for r in rows if "tokens_per_s" in r and r["step"] > warmup]
    median = lambda key: statistics.median(r[key] for r in steps) if steps and key in steps[0] else float("nan")  # noqa: E731
    return {
        "tokens/s": median("tokens_per_s"),
        "TFLOP/s": median("tflops_per_s_per_device"),
        "MFU": median("mfu"),
        "peak GB": max(r["peak_memory_gb"] for r in steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b", help="a folder name under config_hub/models, or any folder with a config.json")
    parser.add_argument("--jobs", default="full,lora")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--global_batch_size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup_steps", type=int, default=5)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--gradient_checkpointing", default="false")
    parser.add_argument("--lora_r", type=int, default=16)
    parser.add_argument("--work_dir", type=Path, default=Path("/tmp/litft-gpu-bench"))
    args, extra = parser.parse_known_args()  # anything else is passed to litft as it is

    args.work_dir.mkdir(parents=True, exist_ok=True)
    model = random_weights(args.model, args.work_dir)
    text = random_text(args.work_dir, args.seq_len * args.global_batch_size * (args.steps + 2))
    common = [
        "--data", "TextFiles", "--data.train_data_path", str(text), "--data.max_seq_length", str(args.seq_len),
        "--data.val_split_fraction", "0.02", "--train.global_batch_size", str(args.global_batch_size),
        "--train.micro_batch_size", str(args.micro_batch_size), "--train.max_steps", str(args.steps),
        "--train.gradient_checkpointing", args.gradient_checkpointing, "--train.save_interval", "null",
        "--eval.interval", "0", "--eval.initial_validation", "false", "--eval.final_validation", "false",
        "--precision", args.precision, "--overwrite", "true", *extra,
    ]
    jobs = {
        "full": ["pretrain", str(model), "--init", "pretrained"],
        "lora": ["finetune_lora", str(model), "--lora_r", str(args.lora_r)],
    }
    results = {}
    for job in args.jobs.split(","):
        out = args.work_dir / f"out-{job}"
        command = [sys.executable, "-m", "litft", *jobs[job], *common, "--out_dir", str(out)]
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True, cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        results[job] = steady_state(out, args.warmup_steps)

    print(f"\n{args.model}, seq {args.seq_len}, micro batch {args.micro_batch_size}, {args.precision}, "
          f"checkpointing {args.gradient_checkpointing}")
    print(f"{'job':<6}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'peak GB':>10}")
    for job, r in results.items():
        print(f"{job:<6}{r['tokens/s']:>12,.0f}{r['TFLOP/s']:>10.1f}{r['MFU']:>8.1%}{r['peak GB']:>10.1f}")


if __name__ == "__main__":
    main()
