"""Peak memory of building a model under FSDP: one full block at a time, never the whole model.

Builds a Llama of the given shape with random weights into a temporary folder, then
starts N CPU processes that load it the way litft does (meta device, filled block by
block, each block sharded as soon as it is filled) and print, per rank, how much the
process's anonymous resident memory grew at its peak while loading, against the model's size.

    python benchmarks/sharded_load.py --layers 8 --hidden 1024 --devices 2
    python benchmarks/sharded_load.py --layers 8 --hidden 2048 --devices 2 --tensor_parallel 2
"""

import os
import tempfile
from pathlib import Path

import lightning_fabric as L
import torch
from benchkit import PeakGrowth, llama_shape, shape_parser
from transformers import LlamaForCausalLM

from litft.config import FSDPArgs, Layout, TrainArgs
from litft.objectives import next_token
from litft.model.causal_lm import CausalLM
from litft.model.loading import load_config
from litft.parallel.strategies import strategy_class
from litft.model.weights import CheckpointWeights, Materializer, skeleton


def load_and_measure(fabric, strategy, folder: str, model_mb: float, block_mb: float) -> None:
    with PeakGrowth() as peak:
        lm = CausalLM(skeleton(load_config(folder), torch.float32), TrainArgs(), next_token())
        strategy.setup(fabric, lm, Materializer(lm.model, lm.hf_model, CheckpointWeights(Path(folder)), seed=0), on_device=False)
    grew = peak.mb
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in lm.parameters()) * 4 / 2**20
    print(
        f"rank {fabric.global_rank}/{fabric.world_size}: peak growth while loading {grew:7.1f} MB | "
        f"shard held {held:7.1f} MB | model {model_mb:.1f} MB | one block {block_mb:.1f} MB",
        flush=True,
    )


def main() -> None:
    parser = shape_parser(__doc__.splitlines()[0], layers=8)
    parser.add_argument("--tensor_parallel", type=int, default=1, help="ranks that split each block (the rest shard it with FSDP)")
    args = parser.parse_args()
    folder = os.environ.get("SHARDED_LOAD_MODEL") or tempfile.mkdtemp(prefix="litft-load-")
    config, per_block, _, total = llama_shape(args)
    if not (Path(folder) / "model.safetensors").exists():
        LlamaForCausalLM(config).save_pretrained(folder)
    os.environ["SHARDED_LOAD_MODEL"] = folder  # the launched processes reuse the saved model
    layout = Layout("fsdp" if args.devices > 1 else "auto", args.devices, 1, FSDPArgs(sharding_strategy="FULL_SHARD") if args.devices > 1 else FSDPArgs(),
                    tensor_parallel=args.tensor_parallel)
    strategy = strategy_class(layout)(layout, "cpu", "32-true", TrainArgs(global_batch_size=args.devices, micro_batch_size=1))
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy.fabric_strategy())
    torch.set_num_threads(1)
    fabric.launch(load_and_measure, strategy, folder, total, per_block)


if __name__ == "__main__":
    main()
