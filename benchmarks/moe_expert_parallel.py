"""Expert parallel's speed and memory: one MoE model trained under FSDP alone and with its experts dealt out, rank by rank.

    python benchmarks/moe_expert_parallel.py                       # CPU: 4 gloo ranks, EP 1, 2 and 4
    python benchmarks/moe_expert_parallel.py --accelerator cuda    # every GPU here: EP 1 and EP = the GPUs, and one GPU's
                                                                   # LoRA side by side with HF Trainer (vs_hf_trainer.py)

Every run is ``litft pretrain`` of the same random Qwen3-MoE-shaped model on the
same packed rows of text, under ``--strategy fsdp`` over the same ranks; only
``--expert_parallel`` changes. With EP 1 FSDP all-gathers every expert of a layer on
every rank; with EP N a rank gathers its 1/N of them and sends each token to the
ranks that hold its experts. Printed per run: tokens/s (all ranks), tokens/s per
rank, MFU on the active parameters (GPU), and each rank's peak memory (the CPU's
peak resident memory of each process; on a GPU the allocator's peak). The per-expert
loop against grouped experts is benchmarks/moe_experts.py's.

The CPU shape is small but, like the MoEs people train, mostly experts (hidden 512,
64 experts of width 512, 4 per token: 200 MB of experts per layer in fp32, 5 MB of
attention), and 2 cores share 4 ranks: it shows memory per rank and what the
dispatch costs against FSDP's gathers, not GPU speed.
The GPU shape is Qwen3-30B-A3B's (hidden 2048, 128 experts of width 768, 8 per token)
with ``--layers`` of its 48 layers, so that it fits one node.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchkit import python_path  # noqa: E402


def model_folder(work: Path, accelerator: str, layers: int) -> Path:
    """A random Qwen3-MoE of the mode's shape (config only: pretrain initializes it) with litft-tiny's tokenizer."""
    from transformers import AutoTokenizer, Qwen3MoeConfig

    from litft.model.tiny import ensure_tiny_model

    folder = work / f"qwen3-moe-{accelerator}-{layers}"
    if accelerator == "cuda":
        shape = json.loads((ROOT / "config_hub" / "models" / "qwen3-30b-a3b" / "config.json").read_text())
        shape.update(num_hidden_layers=layers, vocab_size=384, tie_word_embeddings=False)
        shape.pop("architectures", None), shape.pop("model_type", None), shape.pop("transformers_version", None)
        config = Qwen3MoeConfig(**shape)
    else:
        config = Qwen3MoeConfig(vocab_size=384, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_hidden_layers=layers,
                                num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=4,
                                max_position_embeddings=4096, tie_word_embeddings=False)
    config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(ensure_tiny_model()).save_pretrained(folder)
    return folder


def run(args, model: Path, work: Path, expert_parallel: int) -> dict:
    out = work / f"ep{expert_parallel}"
    flags = [
        "pretrain", str(model), "--data", "TextFiles", "--data.train_data_path", str(work / "text"), "--data.max_seq_length", str(args.seq_len),
        "--data.val_split_fraction", "0", "--strategy", "fsdp", "--devices", str(args.devices), "--expert_parallel", str(expert_parallel),
        "--precision", args.precision, "--accelerator", args.accelerator, "--train.micro_batch_size", str(args.micro_batch),
        "--train.global_batch_size", str(args.micro_batch * args.devices), "--train.max_steps", str(args.steps), "--train.warmup_steps", "1",
        "--train.save_interval", "null", "--train.gradient_checkpointing", str(args.accelerator == "cuda").lower(),
        "--eval.initial_validation", "false", "--eval.final_validation", "false", "--eval.interval", "0",
        "--out_dir", str(out), "--overwrite", "true", "--logger_name", "csv",
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1", PYTHONPATH=python_path(ROOT))  # this checkout's litft
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "litft", *flags], cwd=work, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"EP {expert_parallel} exited {done.returncode}: {done.stderr[-3000:]}")
    from vs_hf_trainer import steady_rates

    rows, rates = steady_rates(out, args.skip)
    per_rank = [max(r.get(f"rank_peak_gb/{rank}", 0.0) for r in rows) for rank in range(args.devices)]
    return {
        "expert_parallel": expert_parallel, **rates, "tokens_per_s_per_rank": rates["tokens_per_s"] / args.devices,
        "peak_gb_per_rank": [round(gb, 3) for gb in per_rank], "peak_gb_max": max(per_rank), "wall_s": time.perf_counter() - started,
        "losses": [round(r["loss"], 4) for r in rows],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--devices", type=int, default=None, help="ranks (default: 4 on the CPU, every GPU)")
    parser.add_argument("--expert_parallel", default=None, help="comma-separated (default: 1,2,4 on the CPU, 1 and the GPUs)")
    parser.add_argument("--layers", type=int, default=None, help="of the shape's layers (default: 4 on the CPU, 12 of Qwen3-30B-A3B's 48)")
    parser.add_argument("--seq_len", type=int, default=None, help="tokens per row (default: 256 on the CPU, 4096)")
    parser.add_argument("--micro_batch", type=int, default=None, help="rows per rank per step (default: 2 on the CPU, 1)")
    parser.add_argument("--precision", default=None, help="default: 32-true on the CPU, bf16-mixed")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of tokens/s")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--work_dir", type=Path, default=None)
    parser.add_argument("--skip_trainer", action="store_true", help="with cuda: leave out the one-GPU comparison with HF Trainer")
    args = parser.parse_args()
    cuda = args.accelerator == "cuda"
    if cuda:
        import torch

        if not torch.cuda.is_available():
            print("moe_expert_parallel: --accelerator cuda, but torch.cuda.is_available() is False here; nothing to measure")
            return
        gpus = torch.cuda.device_count()
    args.devices = args.devices or (gpus if cuda else 4)
    args.layers = args.layers or (12 if cuda else 4)
    args.seq_len = args.seq_len or (4096 if cuda else 256)
    args.micro_batch = args.micro_batch or (1 if cuda else 2)
    args.precision = args.precision or ("bf16-mixed" if cuda else "32-true")
    sizes = [int(n) for n in args.expert_parallel.split(",")] if args.expert_parallel else sorted({1, args.devices} if cuda else {1, 2, 4})
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="litft-moe-ep-"))
    work.mkdir(parents=True, exist_ok=True)
    from gpu_throughput import random_text

    random_text(work, args.seq_len * args.micro_batch * args.devices * (args.steps + 2))
    model = model_folder(work, args.accelerator, args.layers)
    print(f"{args.accelerator}: Qwen3-MoE shape, {args.layers} layers, {args.devices} ranks, rows of {args.seq_len} x {args.micro_batch} per rank, "
          f"{args.precision}, {args.steps} steps (first {args.skip} left out)", flush=True)
    results = []
    for size in sizes if args.devices > 1 else [1]:
        result = run(args, model, work, size)
        results.append(result)
        mfu = f"  MFU {result['mfu']:.1%}" if result["mfu"] is not None else ""
        print(f"EP {size}: {result['tokens_per_s']:9.1f} tokens/s ({result['tokens_per_s_per_rank']:.1f} per rank){mfu}  "
              f"peak per rank {result['peak_gb_max']:.2f} GB  ({result['wall_s']:.0f} s)", flush=True)
    for result in results:
        print(json.dumps({"accelerator": args.accelerator, "layers": args.layers, "devices": args.devices, **result}))
    if cuda and not args.skip_trainer:
        # One GPU, side by side with HF Trainer: LoRA on the same shape (vs_hf_trainer.py's 30b-a3b-lora run).
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_hf_trainer.py"), "--accelerator", "cuda", "--runs", "30b-a3b-lora",
                        "--seq_len", str(args.seq_len), "--work_dir", str(work / "vs-trainer")], check=False)


if __name__ == "__main__":
    main()
