"""Peak memory per rank of loading a MoE checkpoint stored in the hub's layout (one tensor per expert) under FSDP.

Saves a random Qwen3-MoE of the given shape as transformers saves it (bf16, experts one
tensor each, which the model stacks per layer), then starts N CPU processes that build it
as the jobs do (meta device, filled block by block through the checkpoint's conversion,
each block sharded when filled) and print, per rank, how much the process's anonymous
resident memory grew at its peak, its share, and what the load wrote to disk. Run it at an
older commit to measure the path it had (the whole model converted by one process and
written to $LITFT_HOME/converted).

    python benchmarks/hub_layout_load.py --layers 12 --devices 2
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

import lightning_fabric as L
import torch
from benchkit import PeakGrowth

from litft.config import FSDPArgs, Layout, TrainArgs
from litft.objectives import next_token
from litft.model.causal_lm import CausalLM
from litft.model.loading import load_config
from litft.parallel.strategies import strategy_class
from litft.model.weights import Materializer, skeleton

from litft.model import weights

if hasattr(weights, "checkpoint_in_model_layout"):  # a litft before streamed conversion: the whole model converted once, to disk
    def model_layout_weights(folder, config):
        return weights.CheckpointWeights(weights.checkpoint_in_model_layout(folder, config))
else:
    from litft.model.hub_layout import model_layout_weights


def disk_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20 if folder.exists() else 0.0


def load_and_measure(fabric, strategy, folder: str, model_mb: float, group_mb: float) -> None:
    home = Path(os.environ["LITFT_HOME"])
    started = time.perf_counter()
    with PeakGrowth() as peak:
        config = load_config(folder)
        lm = CausalLM(skeleton(config, torch.bfloat16), TrainArgs(), next_token())
        strategy.setup(fabric, lm, Materializer(lm.model, lm.hf_model, model_layout_weights(Path(folder), config), seed=0), on_device=False)
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in lm.parameters()) / 2**20
    fabric.barrier()
    print(f"rank {fabric.global_rank}/{fabric.world_size}: peak growth while loading {peak.mb:7.1f} MB | share held {held:7.1f} MB | "
          f"model {model_mb:.0f} MB | one layer's experts {group_mb:.0f} MB | written to disk {disk_mb(home / 'converted'):.0f} MB | "
          f"{time.perf_counter() - started:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    folder = Path(os.environ.get("HUB_LAYOUT_MODEL") or tempfile.mkdtemp(prefix="litft-hub-layout-"))
    h, width = args.hidden, args.hidden // 2
    config = Qwen3MoeConfig(vocab_size=32000, hidden_size=h, intermediate_size=3 * h, moe_intermediate_size=width, num_hidden_layers=args.layers,
                            num_attention_heads=h // 64, num_key_value_heads=h // 128, head_dim=64, num_experts=args.experts,
                            num_experts_per_tok=4, tie_word_embeddings=False)
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    os.environ["HUB_LAYOUT_MODEL"] = str(folder)  # the launched processes reuse the saved model
    os.environ.setdefault("LITFT_HOME", tempfile.mkdtemp(prefix="litft-home-"))  # fresh: nothing converted before
    model_mb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
    group_mb = 3 * args.experts * h * width * 2 / 2**20
    layout = Layout("fsdp", args.devices, 1, FSDPArgs(sharding_strategy="FULL_SHARD"))
    strategy = strategy_class(layout)(layout, "cpu", "bf16-true", TrainArgs(global_batch_size=args.devices, micro_batch_size=1))
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy.fabric_strategy())
    torch.set_num_threads(1)
    fabric.launch(load_and_measure, strategy, str(folder), model_mb, group_mb)


if __name__ == "__main__":
    main()
