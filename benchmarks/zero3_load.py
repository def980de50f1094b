"""Peak memory of building a model under DeepSpeed ZeRO-3: each rank's partition and one module, never the whole model.

Saves a Llama of the given shape (random weights, 1.1 GB in fp32 by default) to a
temporary folder once, then, for full finetuning, LoRA and QLoRA, starts N CPU
processes that build the model exactly as a litft job does (the strategy's
structure under ``zero.Init``, its filler module by module, then ``fabric.setup``,
which is ``deepspeed.initialize``; QLoRA quantizes and partitions a block at a time).
Each rank prints how much its anonymous resident memory grew at its peak, first
through the fill and then through ``fabric.setup``. The same runs on a tiny model
give the fixed costs (DeepSpeed's engine, imports), which are subtracted before
dividing by the model's fp32 size, and by the model as the ranks hold it (the
partitions held times the ranks: for QLoRA, the 4-bit base).

    python benchmarks/zero3_load.py --layers 18 --hidden 1024 --devices 2 [--jobs full lora qlora]
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning_fabric as L
import torch
from benchkit import PeakGrowth, llama_shape, resident_mb, shape_parser
from transformers import LlamaForCausalLM

from litft.run.build import build_module
from litft.config import DeepSpeedArgs, Layout, LoraArgs, TrainArgs
from litft.parallel.strategies import DeepSpeed

JOBS = {"full": None, "lora": LoraArgs(r=8, dropout=0.0), "qlora": LoraArgs(r=8, dropout=0.0, quantize="bnb.nf4")}
RESULT = re.compile(r"RESULT (\w+) (\w+) (\d+) (-?[\d.]+) (-?[\d.]+) (-?[\d.]+)")
TINY = ["--layers", "1", "--hidden", "128", "--vocab", "512"]


def held_mb(lm) -> float:
    """Parameter bytes on this rank: ZeRO-3 partitions, 4-bit packed weights as stored."""
    total = 0
    for p in lm.parameters():
        local = p.ds_tensor if hasattr(p, "ds_tensor") else p
        total += local.numel() * local.element_size()
    return total / 2**20


def build_and_measure(fabric, strategy, folder: str, job: str, size: str) -> None:
    torch.set_num_threads(1)
    train = TrainArgs(global_batch_size=fabric.world_size, micro_batch_size=1)
    start = resident_mb()
    with PeakGrowth() as filled:
        lm, fill, on_device = build_module(
            folder, "32-true", JOBS[job], train, 1, random_init=False, seed=0, device=fabric.device, strategy=strategy,
        )
        fill(lm)
    with PeakGrowth() as wrapped:
        strategy.setup(fabric, lm, lambda part: None, on_device)
    through_setup = max(filled.before + filled.mb, wrapped.before + wrapped.mb) - start
    print(f"RESULT {job} {size} {fabric.global_rank} {filled.mb:.1f} {through_setup:.1f} {held_mb(lm):.1f}", flush=True)


def run_one(job: str, size: str, folder: str, devices: int) -> None:
    """One job on one model in fresh processes (the parent's memory is not theirs)."""
    layout = Layout("deepspeed", devices, 1, deepspeed=DeepSpeedArgs(stage=3))
    strategy = DeepSpeed(layout, "cpu", "32-true", TrainArgs(global_batch_size=devices, micro_batch_size=1))
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy.fabric_strategy(), precision="32-true")
    fabric.launch(build_and_measure, strategy, folder, job, size)


def saved_model(args, folder: Path) -> float:
    """A Llama of the shape flags saved in ``folder`` (random weights); its fp32 size in MB."""
    config, _, _, total = llama_shape(args)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return total


def main() -> None:
    if sys.argv[1:2] == ["--run"]:
        job, size, folder, devices = sys.argv[2:6]
        return run_one(job, size, folder, int(devices))
    parser = shape_parser(__doc__.splitlines()[0], layers=18)
    parser.add_argument("--jobs", nargs="+", choices=list(JOBS), default=list(JOBS))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="litft-zero3-"))
    try:
        sizes = {"big": saved_model(args, root / "big"), "tiny": saved_model(parser.parse_args(TINY), root / "tiny")}
        _, block_mb, embedding_mb, _ = llama_shape(args)
        print(f"model {sizes['big']:.0f} MB in fp32, one block {block_mb:.0f} MB, one embedding {embedding_mb:.0f} MB, {args.devices} ranks")
        rows = {}
        for job in args.jobs:
            for size in sizes:
                out = subprocess.run(
                    [sys.executable, __file__, "--run", job, size, str(root / size), str(args.devices)],
                    capture_output=True, text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"),
                )
                if out.returncode != 0:
                    raise SystemExit(out.stderr[-3000:])
                # The ranks' lines may interleave: read each record by its shape.
                for j, s, rank, fill_mb, setup_mb, held in RESULT.findall(out.stdout):
                    rows[(j, s, int(rank))] = (float(fill_mb), float(setup_mb), float(held))
            for rank in range(args.devices):
                big, tiny = rows[(job, "big", rank)], rows[(job, "tiny", rank)]
                fill_growth, setup_growth = big[0] - tiny[0], big[1] - tiny[1]
                print(
                    f"{job:5s} rank {rank}: fill +{fill_growth:7.1f} MB = {fill_growth / sizes['big']:.3f} x model | "
                    f"through fabric.setup +{setup_growth:7.1f} MB = {setup_growth / sizes['big']:.3f} x model | "
                    f"parameters held {big[2]:7.1f} MB (fill = {fill_growth / (big[2] * args.devices):.3f} x the model as held) | "
                    f"tiny baseline {tiny[0]:.1f} / {tiny[1]:.1f} MB", flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
