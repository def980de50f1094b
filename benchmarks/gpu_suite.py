"""Everything a GPU machine should confirm about litft, in one command and under 10 minutes on one H100.

    python benchmarks/gpu_suite.py            # JSON lines on stdout, one per result
    python benchmarks/gpu_suite.py --skip_matrix --jobs full

1. What this machine is (``litft env``'s report).
2. The precision matrix of the CI (every job x strategy x precision, two steps,
   litft/cli/selfcheck.py) on CUDA with the real varlen kernel, each case also stopped
   half-way, resumed, and its last loss compared with the uninterrupted run's.
3. Tokens/s, MFU and peak memory of a 1B full finetune (bf16-true), a 1B LoRA
   (bf16-mixed) and a 1B chat SFT (prompts masked, varied lengths, padding-free) on
   a random Llama-3.2-1B-shaped model built here (nothing is downloaded).

On a machine without CUDA it says so in one line and exits 0, so it can sit in any script.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def emit(kind: str, **fields) -> None:
    print(json.dumps({"kind": kind, **fields}), flush=True)


def run_matrix_on_gpu(work: Path, steps: int) -> int:
    import torch

    from litft.cli.selfcheck import matrix, run_matrix

    world = min(2, torch.cuda.device_count())
    cases = matrix(steps=steps, resume=True)
    fields = ("case", "passed", "problems", "attention", "saved", "resume difference", "seconds")
    # Each case printed as it ends: a run cut short by the device's time limit still shows what it reached.
    records = run_matrix(cases, work / "matrix", accelerator="cuda", world=world, timeout=420,
                         say=lambda record: emit("matrix", **{k: record.get(k) for k in fields}))
    return sum(not record["passed"] for record in records)


def throughput(work: Path, jobs: list, seq_len: int, steps: int) -> None:
    """The three runs, each by the litft command a user types; figures from the run's own log (median after warm-up)."""
    from gpu_throughput import random_text, random_weights, steady_state
    from vs_hf_trainer import chat_records

    model = random_weights("llama-3.2-1b", work)
    text = random_text(work, seq_len * 16 * (steps + 2))
    chat = work / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in chat_records(640, 0)))
    batch = ["--train.global_batch_size", "16", "--train.micro_batch_size", "4", "--train.max_steps", str(steps),
             "--train.save_interval", "null", "--eval.initial_validation", "false", "--eval.final_validation", "false",
             "--eval.interval", "0", "--overwrite", "true", "--logger_name", "csv"]
    text_data = ["--data", "TextFiles", "--data.train_data_path", str(text), "--data.max_seq_length", str(seq_len), "--data.val_split_fraction", "0.02"]
    runs = {
        "1b full bf16-true": ["pretrain", str(model), "--init", "pretrained", *text_data, "--precision", "bf16-true"],
        "1b lora bf16-mixed": ["finetune_lora", str(model), "--lora_r", "16", *text_data, "--precision", "bf16-mixed"],
        "1b chat sft full bf16-true": ["finetune_full", str(model), "--data", "JSON", "--data.json_path", str(chat), "--data.prompt_style", "chat",
                                       "--data.val_split_fraction", "0.02", "--precision", "bf16-true"],
    }
    wanted = {"full": "1b full bf16-true", "lora": "1b lora bf16-mixed", "chat": "1b chat sft full bf16-true"}
    for job in jobs:
        name = wanted[job]
        out = work / f"out-{job}"
        command = [sys.executable, "-m", "litft", *runs[name], *batch, "--out_dir", str(out)]
        started = time.perf_counter()
        proc = subprocess.run(command, cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True)
        if proc.returncode != 0:
            emit("throughput", run=name, error=(proc.stderr.strip().splitlines() or ["?"])[-1][:400])
            continue
        emit("throughput", run=name, seq_len=seq_len, seconds=round(time.perf_counter() - started), **steady_state(out, warmup=min(5, steps // 2)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work_dir", type=Path, default=Path("/tmp/litft-gpu-suite"))
    parser.add_argument("--skip_matrix", action="store_true")
    parser.add_argument("--matrix_steps", type=int, default=4)
    parser.add_argument("--jobs", default="full,lora,chat", help="throughput runs: any of full, lora, chat (empty: none)")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("gpu_suite: no CUDA device here (torch.cuda.is_available() is False); nothing to measure")
        return
    from litft.cli.envreport import report_lines

    emit("env", lines=report_lines())
    args.work_dir.mkdir(parents=True, exist_ok=True)
    failed = 0 if args.skip_matrix else run_matrix_on_gpu(args.work_dir, args.matrix_steps)
    throughput(args.work_dir, [j for j in args.jobs.split(",") if j], args.seq_len, args.steps)
    emit("summary", matrix_failed=failed)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
