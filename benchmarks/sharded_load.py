"""Peak memory of building a model under FSDP: one full block at a time, never the whole model.

Builds a Llama of the given shape with random weights into a temporary folder, then
starts N CPU processes that load it the way litft does (meta device, filled block by
block, each block sharded as soon as it is filled) and print, per rank, how much the
process's anonymous resident memory grew at its peak while loading, against the model's size.

    python benchmarks/sharded_load.py --layers 8 --hidden 1024 --devices 2
"""

import os
import tempfile
from pathlib import Path

from benchkit import PeakGrowth, llama_shape, shape_parser


def load_and_measure(fabric, folder: str, model_mb: float, block_mb: float) -> None:
    import torch

    from litft.args import TrainArgs
    from litft.model import CausalLM, load_config
    from litft.weights import CheckpointWeights, Materializer, skeleton

    with PeakGrowth() as peak:
        lm = CausalLM(skeleton(load_config(folder), torch.float32), TrainArgs())
        lm.materialize = Materializer(lm.model, lm.hf_model, CheckpointWeights(Path(folder)), seed=0)
        if fabric.world_size == 1:
            lm.materialize(lm)
        fabric.setup_module(lm)
    grew = peak.mb
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in lm.parameters()) * 4 / 2**20
    print(
        f"rank {fabric.global_rank}/{fabric.world_size}: peak growth while loading {grew:7.1f} MB | "
        f"shard held {held:7.1f} MB | model {model_mb:.1f} MB | one block {block_mb:.1f} MB",
        flush=True,
    )


def main() -> None:
    args = shape_parser(__doc__.splitlines()[0], layers=8).parse_args()

    import lightning as L
    import torch
    from transformers import LlamaForCausalLM

    from litft.args import DeepSpeedArgs, FSDPArgs
    from litft.strategy import FSDP2Strategy, Parallelism

    folder = os.environ.get("SHARDED_LOAD_MODEL") or tempfile.mkdtemp(prefix="litft-load-")
    config, per_block, _, total = llama_shape(args)
    if not (Path(folder) / "model.safetensors").exists():
        LlamaForCausalLM(config).save_pretrained(folder)
    os.environ["SHARDED_LOAD_MODEL"] = folder  # the launched processes reuse the saved model
    if args.devices == 1:
        fabric = L.Fabric(accelerator="cpu", devices=1)
    else:
        layout = Parallelism("fsdp", args.devices, 1, FSDPArgs(sharding_strategy="FULL_SHARD"), DeepSpeedArgs())
        fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=FSDP2Strategy(layout, "32-true", "gloo"))
    torch.set_num_threads(1)
    fabric.launch(load_and_measure, folder, total, per_block)


if __name__ == "__main__":
    main()
