"""Where torch.compile's gain goes in litft's model: a bare training step with each of litft's changes to the model added in turn, eager and compiled.

On one H200 plain HF Llama-3.2-1B blocks gained 27% from compiling in a bare loop
(50,388 -> 63,815 tok/s), while litft's runs, with its attention, Liger's kernels
and the head that computes the loss itself, were slower compiled than eager. This
script runs the same step (one micro-batch, fused AdamW on CUDA, no accumulation,
clipping or logging) with the model as litft builds it, one change at a time:

- ``hf``: transformers' SDPA attention on rows of one sample each, the plain head and loss;
- ``segments``: litft's attention (``litft_segments``, torch's varlen flash kernel on CUDA)
  on one padding-free row per micro-batch, as litft's collate lays it out;
- ``segments+head``: with the head computing the loss on target tokens itself (litft.model.loss);
- ``segments+liger``: with Liger's RMSNorm, RoPE and SwiGLU instead (CUDA only);
- ``litft``: with both, as litft trains by default on a GPU.

Each runs eager and with litft's compiled blocks (litft.model.compiling.compile_blocks).
The change that takes compile's gain away is the one whose compiled line falls
behind its eager line. Against a full litft run (``vs_hf_trainer.py``) the
difference is the loop's: accumulation, clipping, logging.

    python benchmarks/compile_ablation.py --device cuda                    # Llama-3.2-1B shape, 4 x 2048 tokens
    python benchmarks/compile_ablation.py --device cpu --layers 2 --hidden 128 --seq 128 --steps 3    # checks the script
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {  # name: (attention, Liger's kernels, head computes the loss)
    "hf": ("sdpa", False, False),
    "segments": ("litft_segments", False, False),
    "segments+head": ("litft_segments", False, True),
    "segments+liger": ("litft_segments", True, False),
    "litft": ("litft_segments", True, True),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", default="llama-3.2-1b", help="a config folder under config_hub/models")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape has")
    parser.add_argument("--hidden", type=int, default=None, help="another width (and a fourth of it per head group), for a CPU check")
    parser.add_argument("--batch", type=int, default=4, help="samples a micro-batch")
    parser.add_argument("--seq", type=int, default=2048, help="tokens a sample")
    parser.add_argument("--steps", type=int, default=7, help="steps a side; the median of those after the third is reported")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    return parser.parse_args(argv)


def config_of(args):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ROOT / "config_hub" / "models" / args.shape)
    if args.layers:
        config.num_hidden_layers = args.layers
    if args.hidden:
        config.hidden_size, config.intermediate_size = args.hidden, 4 * args.hidden
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, args.hidden // 4
    return config


def micro_batch(args, vocab: int, padding_free: bool, device: str) -> dict:
    """One micro-batch as litft's collate lays it out, on the device as the loop's ``fabric.to_device`` moves it."""
    from lightning_fabric.utilities.apply_func import move_data_to_device

    from litft.data.collate import collate

    generator = torch.Generator().manual_seed(0)
    samples = []
    for index in range(args.batch):
        ids = torch.randint(0, vocab, (args.seq,), generator=generator)
        samples.append({"input_ids": ids, "labels": ids.clone(), "id": index})
    return move_data_to_device(collate(samples, pad_id=0, padding_free=padding_free), torch.device(device))


def step_loss(lm, batch: dict) -> torch.Tensor:
    """The summed loss of the target tokens, through the head's own loss where it computes it, else from the logits."""
    targets = batch["targets"]
    value, _, fused = lm.head_forward(batch, targets, per_token=False)
    if fused:
        return value
    picked = value.reshape(-1, value.shape[-1]).index_select(0, targets["index"]).float()
    return torch.nn.functional.cross_entropy(picked, targets["labels"], reduction="sum")


def run(args, name: str, compiled: bool) -> dict:
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    import litft.model.attention  # noqa: F401  (registers litft_segments with transformers)
    from litft.model.compiling import compile_blocks
    from litft.config import TrainArgs
    from litft.objectives import next_token
    from litft.model.kernels import use_liger_kernels
    from litft.model.loss import fuse_target_loss
    from litft.model.causal_lm import CausalLM
    from litft.model.weights import transformer_blocks

    attention, liger, fused = VARIANTS[name]
    config = config_of(args)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attention)
    model.config.use_cache = False
    if liger:
        use_liger_kernels(model)
    if fused:
        fuse_target_loss(model)
    if compiled:
        torch._dynamo.reset()
        compile_blocks(transformer_blocks(model))
    lm = CausalLM(model, TrainArgs(), next_token())
    lm.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=args.device == "cuda")
    batch = micro_batch(args, config.vocab_size, padding_free=attention == "litft_segments", device=args.device)
    counters.clear()
    times = []
    for _ in range(args.steps):
        if args.device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        step_loss(lm, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    steady = sorted(times[3:])[len(times[3:]) // 2] if len(times) > 3 else times[-1]
    row = {"variant": name, "compiled": compiled, "tokens_per_s": round(args.batch * args.seq / steady, 1),
           "first_step_s": round(times[0], 2), "compiled_frames": int(counters["frames"].get("total", 0))}
    if args.device == "cuda":
        row["peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        torch.cuda.reset_peak_memory_stats()
    del lm, model, optimizer
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    names = args.variants.split(",")
    unknown = set(names) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    for name in names:
        if VARIANTS[name][1] and args.device != "cuda":
            print(json.dumps({"variant": name, "skipped": "Liger's kernels run on CUDA only"}), flush=True)
            continue
        speeds = {}
        for compiled in (False, True):
            try:
                row = run(args, name, compiled)
            except Exception as err:  # one variant's failure (out of memory, a kernel missing) leaves the others' lines
                row = {"variant": name, "compiled": compiled, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
            speeds[compiled] = row.get("tokens_per_s")
            if compiled and speeds[False] and speeds[True]:
                row["compiled_over_eager"] = round(speeds[True] / speeds[False], 3)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
