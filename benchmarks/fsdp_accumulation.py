"""Peak memory of one FSDP training step, accumulating 4 micro-batches against 1, on CPU processes.

FSDP2 with gradient sync off keeps every parameter's whole gradient on every rank
until the last micro-batch; litft reduce-scatters after each micro-batch instead,
so accumulation costs only what its gradient shards add while the later
micro-batches run. That is not nothing: a step of one micro-batch never holds all
its gradient shards and all its saved activations at once (the shards grow as
backward frees the activations), while the second micro-batch of an accumulating
step starts its backward with both, and with the next unit already gathered. So
the extra is one micro-batch's saved activations plus about one unit in flight;
gradient checkpointing shrinks the first, depth the second.

Each rank samples its anonymous resident memory every 2 ms and prints the peak of
each training step (the first step, which makes the optimizer's states, is left
out) and what the first micro-batch's forward kept for backward; glibc is told to
map every large allocation on its own so that resident memory follows the live
tensors. ``--lightning_no_sync`` turns gradient sync off during accumulation, as
Lightning's no_backward_sync does, for the comparison.

    python benchmarks/fsdp_accumulation.py [--devices 2]        # litft: reduce-scatter every micro-batch
    python benchmarks/fsdp_accumulation.py --layers 24 --gradient_checkpointing
    python benchmarks/fsdp_accumulation.py --lightning_no_sync  # whole gradients kept during accumulation
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
from contextlib import contextmanager
from benchkit import PeakGrowth, resident_mb
from torch.distributed.fsdp import FSDPModule
import litft.run.loop as loop
from litft.parallel.strategies import fsdp
# An environment variable, not a flag: Fabric starts the other ranks again from sys.argv, which litft parses.
if os.environ.get("LIGHTNING_NO_SYNC") == "1":  # what Lightning's no_backward_sync does: no reduction until the last micro-batch
    @contextmanager
    def no_sync(self, module, enabled):
        units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.set_requires_gradient_sync(not enabled, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)
    fsdp.ReplicaSync.no_backward_sync = no_sync
step = loop.train_step
peaks, saved = [], []
def measured(trainer, batch):
    backward = trainer.fabric.backward
    def first_backward(*args, **kwargs):  # what the first micro-batch's forward kept for its backward
        saved.append(resident_mb() - peak.before)
        trainer.fabric.backward = backward
        return backward(*args, **kwargs)
    trainer.fabric.backward = first_backward
    with PeakGrowth() as peak:
        step(trainer, batch)
    peaks.append(peak.before + peak.mb)
    if trainer.state.step == trainer.total_steps:
        print(f"rank {trainer.fabric.global_rank}: micro-batches per step {len(batch.micro)}, peak during a step "
              f"{max(peaks[1:]):.1f} MB, saved activations {sorted(saved)[len(saved) // 2]:.1f} MB "
              f"(each step's peak: {' '.join(f'{p:.0f}' for p in peaks)})", flush=True)
loop.train_step = measured
from litft.__main__ import main
main(sys.argv[1:])
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--lightning_no_sync", action="store_true")
    args = parser.parse_args()
    work = Path(os.environ.get("FSDP_ACCUMULATION_DIR") or tempfile.mkdtemp(prefix="litft-accumulation-"))
    folder = model_folder(work, args.hidden, args.layers)
    params = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**20
    print(f"model: {params:.0f} MB of fp32 weights; FULL_SHARD on {args.devices} ranks (a shard of weights or gradients: {params / args.devices:.0f} MB)")
    script = work / "measured_run.py"
    script.write_text(MEASURED_RUN)
    # Every allocation of 128 KiB or more gets its own mapping, returned on free: resident memory then follows
    # the live tensors instead of what glibc's heap keeps, which varied by +-200 MB from step to step.
    env = dict(os.environ, PYTHONPATH=python_path(ROOT / "benchmarks", ROOT), PYTHONUNBUFFERED="1", MALLOC_MMAP_THRESHOLD_="131072")
    peaks: dict = {}
    for global_batch in (2 * args.devices, 8 * args.devices):  # micro-batch 2 on each rank: 1 and 4 micro-batches per step
        command = [
            sys.executable, str(script), "finetune_full", str(folder), "--data", "TinyTasks", "--data.num_train", "64",
            "--data.num_val", "4", "--strategy", "fsdp", "--fsdp.sharding_strategy", "FULL_SHARD", "--devices", str(args.devices),
            "--accelerator", "cpu", "--precision", "32-true", "--train.micro_batch_size", "2",
            "--train.global_batch_size", str(global_batch), "--train.max_steps", "6", "--eval.interval", "0",
            "--eval.initial_validation", "false", "--eval.final_validation", "false", "--train.save_interval", "null",
            "--out_dir", str(work / f"run-{global_batch}"), "--overwrite", "true",
            "--train.gradient_checkpointing", str(args.gradient_checkpointing).lower(),
        ]
        done = subprocess.run(command, cwd=work, env=dict(env, LIGHTNING_NO_SYNC=str(int(args.lightning_no_sync))), capture_output=True, text=True)
        shutil.rmtree(work / f"run-{global_batch}", ignore_errors=True)  # the exported model: a model's size on disk per run
        lines = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
        print("\n".join(lines) if lines else done.stderr[-2000:])
        for line in lines:
            found = re.match(r"rank (\d+): micro-batches per step (\d+), peak during a step ([\d.]+) MB, saved activations ([\d.]+)", line)
            peaks[int(found[1]), int(found[2])] = float(found[3]), float(found[4])
    for rank in range(args.devices):
        if (rank, 1) in peaks and (rank, 4) in peaks:
            extra, saved = peaks[rank, 4][0] - peaks[rank, 1][0], peaks[rank, 1][1]
            print(f"rank {rank}: 4 micro-batches peak {extra:+.1f} MB above 1 ({100 * extra / params:+.1f}% of the model); "
                  f"one micro-batch's saved activations {saved:.1f} MB, the rest {extra - saved:+.1f} MB ({100 * (extra - saved) / params:+.1f}%)")


if __name__ == "__main__":
    main()
