"""Peak memory of ``litft convert`` against the model's size: it holds one block at a time.

Trains a random-init Llama of the given shape for one step under FSDP on N CPU
processes (a real sharded checkpoint, one file per rank), then converts that
checkpoint to a Hugging Face folder in a fresh process and prints how much the
process's anonymous resident memory grew at its peak, beside the model's size and
its largest unit (a block, or an embedding matrix).

    python benchmarks/convert_memory.py --layers 24 --hidden 1024 --devices 2
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchkit import PeakGrowth, llama_shape, shape_parser

ROOT = Path(__file__).resolve().parents[1]


def measure_convert(checkpoint: str, target: str) -> None:
    """In this process: convert and report the peak growth of anonymous memory (page cache not counted)."""
    import torch.distributed.checkpoint  # noqa: F401  (libraries loaded before measuring: their code is not the export)
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    from litft.checkpoint.convert import convert

    started = time.perf_counter()
    with PeakGrowth() as peak:
        convert(Path(checkpoint), out_dir=Path(target))
    print(json.dumps({"peak_growth_mb": peak.mb, "seconds": time.perf_counter() - started}))


def main() -> None:
    parser = shape_parser(__doc__.splitlines()[0], layers=24)
    parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        return measure_convert(*args.measure)

    from litft.model.tiny import ensure_tiny_model

    work = Path(os.environ.get("CONVERT_BENCH_DIR") or tempfile.mkdtemp(prefix="litft-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    config, block_mb, embedding_mb, model_mb = llama_shape(args)
    (work / "model").mkdir(exist_ok=True)
    config.save_pretrained(work / "model")
    run = work / "run"
    if not (run / "checkpoints").is_dir():
        subprocess.run(
            [sys.executable, "-m", "litft", "pretrain", str(work / "model" / "config.json"), "--tokenizer", str(ensure_tiny_model()),
             "--devices", str(args.devices), "--strategy", "fsdp", "--fsdp.sharding_strategy", "FULL_SHARD", "--accelerator", "cpu",
             "--precision", "32-true", "--train.global_batch_size", str(args.devices), "--train.micro_batch_size", "1",
             "--train.max_steps", "1", "--data", "TinyTasks", "--data.num_train", "16", "--data.num_val", "8", "--eval.interval", "0", "--eval.initial_validation", "false",
             "--eval.final_validation", "false", "--out_dir", str(run)],
            check=True, cwd=ROOT,
        )
    checkpoint = sorted((run / "checkpoints").glob("step-*"))[-1]
    target = work / f"hf-{time.time_ns()}"
    out = subprocess.run([sys.executable, __file__, "--measure", str(checkpoint), str(target)], check=True, capture_output=True, text=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    shards = len(list((checkpoint / "model").glob("*.distcp")))
    print(
        f"convert of a {shards}-rank FSDP checkpoint: peak growth {measured['peak_growth_mb']:.0f} MB in {measured['seconds']:.1f} s | "
        f"model {model_mb:.0f} MB | largest unit {max(block_mb, embedding_mb):.0f} MB (block {block_mb:.0f} MB, embedding {embedding_mb:.0f} MB)"
    )


if __name__ == "__main__":
    main()
