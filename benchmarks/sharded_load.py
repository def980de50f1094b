"""Peak memory of building a model under FSDP: one full block at a time, never the whole model.

Builds a Llama of the given shape with random weights into a temporary folder, then
starts N CPU processes that load it the way litft does (meta device, filled block by
block, each block sharded as soon as it is filled) and print, per rank, how much the
process's anonymous resident memory grew at its peak while loading, against the model's size.

    python benchmarks/sharded_load.py --layers 8 --hidden 1024 --devices 2
"""

import argparse
import os
import tempfile
from pathlib import Path


def resident_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def load_and_measure(fabric, folder: str, model_mb: float, block_mb: float) -> None:
    import torch

    from litft.args import TrainArgs
    from litft.model import CausalLM, load_config
    from litft.weights import CheckpointWeights, Materializer, skeleton

    import threading

    # Anonymous memory only: safetensors pages mapped from the file are page cache, shared and evictable.
    before, peak, done = resident_mb("RssAnon"), [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], resident_mb("RssAnon"))
            done.wait(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lm = CausalLM(skeleton(load_config(folder), torch.float32), TrainArgs())
    lm.materialize = Materializer(lm.model, lm.hf_model, CheckpointWeights(Path(folder)), seed=0)
    if fabric.world_size == 1:
        lm.materialize(lm)
    fabric.setup_module(lm)
    done.set()
    sampler.join()
    grew = peak[0] - before
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in lm.parameters()) * 4 / 2**20
    print(
        f"rank {fabric.global_rank}/{fabric.world_size}: peak growth while loading {grew:7.1f} MB | "
        f"shard held {held:7.1f} MB | model {model_mb:.1f} MB | one block {block_mb:.1f} MB",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()

    import lightning as L
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from litft.args import DeepSpeedArgs, FSDPArgs
    from litft.strategy import FSDP2Strategy, Parallelism

    folder = os.environ.get("SHARDED_LOAD_MODEL") or tempfile.mkdtemp(prefix="litft-load-")
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128, tie_word_embeddings=False,
    )
    if not (Path(folder) / "model.safetensors").exists():
        LlamaForCausalLM(config).save_pretrained(folder)
    os.environ["SHARDED_LOAD_MODEL"] = folder  # the launched processes reuse the saved model
    per_block = 4 * (2 * args.hidden * args.hidden + 2 * args.hidden * (args.hidden // 2) + 3 * args.hidden * args.hidden * 3) / 2**20
    total = per_block * args.layers + 4 * 2 * args.vocab * args.hidden / 2**20
    if args.devices == 1:
        fabric = L.Fabric(accelerator="cpu", devices=1)
    else:
        layout = Parallelism("fsdp", args.devices, 1, FSDPArgs(sharding_strategy="FULL_SHARD"), DeepSpeedArgs())
        fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=FSDP2Strategy(layout, "32-true", "gloo"))
    torch.set_num_threads(1)
    fabric.launch(load_and_measure, folder, total, per_block)


if __name__ == "__main__":
    main()
