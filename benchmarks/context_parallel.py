"""Peak memory per rank of a long-sequence training step with context parallel 1, 2 and 4, on CPU processes.

FSDP FULL_SHARD over 4 ranks, rows packed to ``--seq_len`` tokens, the same global
batch of ``--global_batch`` rows in every run: with a context group of N each rank
holds 1/N of every row it trains, so its activations shrink N times while weights,
gradients and optimizer states stay sharded as they were. Each rank samples its
anonymous resident memory every 2 ms and reports the peak growth during each step
(the first, which makes the optimizer's states, is left out). A budget per rank
(``--budget_mb``) marks which runs would fit a device of that size.

    python benchmarks/context_parallel.py                       # seq 8192, CP 1 2 4
    python benchmarks/context_parallel.py --seq_len 16384 --hidden 256
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchkit import model_folder, python_path

ROOT = Path(__file__).resolve().parents[1]

MEASURED_RUN = """
import os
import sys
from benchkit import PeakGrowth
import litft.run.loop as loop
step = loop.train_step
peaks = []
def measured(trainer, batch):
    with PeakGrowth() as peak:
        step(trainer, batch)
    peaks.append(peak.mb)
    if trainer.state.step == trainer.total_steps:
        rows = sum(b["input_ids"].shape[0] for b in batch.micro)
        width = batch.micro[0]["input_ids"].shape[1]
        rank = trainer.fabric.global_rank
        with open(os.path.join(os.environ["PEAKS"], f"rank-{rank:03d}.txt"), "w") as f:  # ranks share stdout: a file each
            f.write(f"{len(batch.micro)} micro-batches of {rows // len(batch.micro)} x {width} tokens, peak growth {max(peaks[1:]):.0f} MB")
loop.train_step = measured
from litft.__main__ import main
main(sys.argv[1:])
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq_len", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--global_batch", type=int, default=4)
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--budget_mb", type=float, default=1024)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    args = parser.parse_args()
    work = Path(os.environ.get("CONTEXT_PARALLEL_DIR") or tempfile.mkdtemp(prefix="litft-context-parallel-"))
    folder = model_folder(work, args.hidden, args.layers, max_positions=args.seq_len)
    params = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**20
    print(f"model: {params:.0f} MB of fp32 weights, FULL_SHARD on {args.devices} ranks; rows of {args.seq_len} tokens, "
          f"global batch {args.global_batch} rows; budget {args.budget_mb:.0f} MB per rank")
    script = work / "measured_run.py"
    script.write_text(MEASURED_RUN)
    env = dict(os.environ, PYTHONPATH=python_path(ROOT / "benchmarks", ROOT), PYTHONUNBUFFERED="1", MALLOC_MMAP_THRESHOLD_="131072")
    samples = 2 * args.global_batch * args.seq_len // 24  # TinyTasks samples run about 30 tokens: enough for two steps
    for split in args.splits:
        out = work / f"run-cp{split}"
        command = [
            sys.executable, str(script), "pretrain", str(folder), "--data", "TinyTasks", "--data.packing", "true",
            "--data.max_seq_length", str(args.seq_len), "--data.num_train", str(samples), "--data.num_val", "4",
            "--strategy", "fsdp", "--fsdp.sharding_strategy", "FULL_SHARD", "--devices", str(args.devices), "--context_parallel", str(split),
            "--accelerator", "cpu", "--precision", "32-true", "--train.micro_batch_size", "1",
            "--train.global_batch_size", str(args.global_batch), "--train.max_steps", "3", "--eval.interval", "0",
            "--eval.initial_validation", "false", "--eval.final_validation", "false", "--train.save_interval", "null",
            "--train.gradient_checkpointing", str(args.gradient_checkpointing).lower(), "--logger_name", "csv",
            "--out_dir", str(out), "--overwrite", "true",
        ]
        peaks_dir = work / f"peaks-cp{split}"
        shutil.rmtree(peaks_dir, ignore_errors=True)
        peaks_dir.mkdir()
        done = subprocess.run(command, cwd=work, env=dict(env, PEAKS=str(peaks_dir)), capture_output=True, text=True)
        shutil.rmtree(out, ignore_errors=True)
        lines = [path.read_text() for path in sorted(peaks_dir.glob("rank-*.txt"))]
        if not lines:
            print(f"context parallel {split}: failed\n{done.stderr[-2000:]}")
            continue
        peaks = [float(re.search(r"peak growth ([\d.]+) MB", line)[1]) for line in lines]
        verdict = "fits" if max(peaks) <= args.budget_mb else "over"
        print(f"context parallel {split}: {lines[0].split(', peak')[0]}; peak growth per rank "
              f"{' '.join(f'{p:.0f}' for p in peaks)} MB (fullest {max(peaks):.0f} MB: {verdict} the {args.budget_mb:.0f} MB budget)")


if __name__ == "__main__":
    main()
