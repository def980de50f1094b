"""How fast each of transformers' experts implementations trains a mixture-of-experts model, here.

    python benchmarks/moe_experts.py [--device cuda] [--tokens 2048] [--threads 2]

A random Qwen3-MoE-shaped model (small enough for a CPU) is trained forward and
backward on the same tokens with the experts computed by the per-expert loop
(``eager``), by gathering each token's expert weights (``batched_mm``) and by one
grouped matmul over tokens sorted by expert (``grouped_mm``); one JSON line each
with tokens/s, peak memory and the loss and gradient difference from the loop.
litft trains with the implementation ``litft.model.experts.choose`` picks.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from litft.model.experts import choose, grouped_kernel  # noqa: E402


def build(device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, num_experts=32, num_experts_per_tok=4, max_position_embeddings=4096)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).train()


def step(model, ids) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batched_limit_gb", type=float, default=4.0, help="skip batched_mm where its gathered weights would exceed this")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build(args.device, dtype)
    ids = torch.randint(0, 4096, (max(1, args.tokens // 512), min(512, args.tokens)), device=args.device)
    reference = None
    print(json.dumps({"device": args.device, "litft_chooses": choose(model), "grouped_kernel": grouped_kernel(args.device, dtype)}), flush=True)
    config = model.config
    expert_bytes = 3 * config.hidden_size * config.moe_intermediate_size * torch.finfo(dtype).bits // 8
    for name in ("eager", "grouped_mm", "batched_mm"):
        gathered = args.tokens * config.num_experts_per_tok * expert_bytes * 3  # the weights gathered, their gradient, one copy more
        if name == "batched_mm" and gathered > args.batched_limit_gb * 1e9:
            print(json.dumps({"experts": name, "skipped": f"would gather about {gathered / 1e9:.0f} GB of expert weights"}), flush=True)
            continue
        model.set_experts_implementation(name)
        step(model, ids)  # warm-up
        if args.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        for _ in range(args.steps):
            loss = step(model, ids)
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - started) / args.steps
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        reference = reference or (loss.item(), grads)
        row = {"experts": name, "tokens_per_s": round(args.tokens / seconds, 1), "loss_difference": abs(loss.item() - reference[0]),
               "gradient_difference": float(((grads - reference[1]).norm() / reference[1].norm()).item())}
        if args.device == "cuda":
            row["peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
