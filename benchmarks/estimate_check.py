"""``litft estimate`` against measured memory: real runs' logged model states, and real steps' activations.

Model states: each configuration trains litft-tiny for one step on CPU processes
(one run at a time), as a user runs it; the loop logs the fullest rank's
``params_bytes``, ``grads_bytes`` and ``optimizer_bytes`` (the strategy's ``state_bytes``)
to ``logs/csv/metrics.csv``, and the estimate for the same flags is set beside them.
QLoRA's logged parameters are the packed 4-bit weights alone; the estimate's
bitsandbytes absmax bytes, measured in-process by tests/unit/test_estimate.py,
are left out of that comparison.

Activations: a small Llama (random weights) takes one real training step in this
process; ``activation_probe.measure_step`` measures what the forward saves for backward
(saved_tensors_hooks) and the step's peak (torch.profiler's memory timeline),
and the estimate (fake-tensor trace of 2 and 3 blocks, extrapolated) is set beside them.

    python benchmarks/estimate_check.py                    # both parts, about 10 minutes on 2 cores
    python benchmarks/estimate_check.py --part activations
"""

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from activation_probe import measure_step
from transformers import LlamaConfig, LlamaForCausalLM

from litft.run.build import build_model
from litft.config import DeepSpeedArgs, FSDPArgs, LoraArgs, TrainArgs
from litft.objectives import next_token
from litft.estimate import memory_plan
from litft.run.logs import quiet_libraries
from litft.model.causal_lm import CausalLM
from litft.model.loading import load_config
from litft.model.tiny import ensure_tiny_model
from litft.model.weights import Materializer

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "--data", "TinyTasks", "--data.num_train", "32", "--data.num_val", "8", "--train.global_batch_size", "4",
    "--train.micro_batch_size", "2", "--train.max_steps", "1", "--eval.interval", "0", "--eval.initial_validation", "false",
    "--eval.final_validation", "false", "--precision", "32-true", "--accelerator", "cpu",
]
LORA = ["--lora_r", "4", "--lora_dropout", "0"]
# name: (job, CLI flags, the same as estimate keywords)
STATE_RUNS = {
    "full, 1 process": ("finetune_full", [], {}),
    "LoRA r=4, 1 process": ("finetune_lora", LORA, {}),
    "QLoRA nf4, 1 process": ("finetune_lora", LORA + ["--quantize", "bnb.nf4"], {"quantize": "bnb.nf4"}),
    "full, DDP 2 ranks": ("finetune_full", ["--strategy", "ddp", "--devices", "2"], {"strategy": "ddp", "devices": 2}),
    "full, FSDP FULL_SHARD 2 ranks": (
        "finetune_full", ["--strategy", "fsdp", "--fsdp.sharding_strategy", "FULL_SHARD", "--devices", "2"],
        {"strategy": "fsdp", "fsdp": ("FULL_SHARD",), "devices": 2},
    ),
    "LoRA, FSDP SHARD_GRAD_OP 2 ranks": (
        "finetune_lora", LORA + ["--strategy", "fsdp", "--fsdp.sharding_strategy", "SHARD_GRAD_OP", "--devices", "2"],
        {"strategy": "fsdp", "fsdp": ("SHARD_GRAD_OP",), "devices": 2},
    ),
    "full, ZeRO-2 2 ranks": (
        "finetune_full", ["--strategy", "deepspeed", "--deepspeed.stage", "2", "--devices", "2"],
        {"strategy": "deepspeed", "zero": 2, "devices": 2},
    ),
    "full, ZeRO-3 2 ranks": (
        "finetune_full", ["--strategy", "deepspeed", "--deepspeed.stage", "3", "--devices", "2"],
        {"strategy": "deepspeed", "zero": 3, "devices": 2},
    ),
    "QLoRA nf4, ZeRO-3 2 ranks": (
        "finetune_lora", LORA + ["--quantize", "bnb.nf4", "--strategy", "deepspeed", "--deepspeed.stage", "3", "--devices", "2"],
        {"quantize": "bnb.nf4", "strategy": "deepspeed", "zero": 3, "devices": 2},
    ),
}
STATE_KEYS = (("params", "params_bytes"), ("grads", "grads_bytes"), ("optimizer", "optimizer_bytes"))


def error(estimated: float, measured: float) -> str:
    return f"{(estimated - measured) / measured:+7.1%}" if measured else ("   exact" if estimated == measured else "    n/a")


def estimate_flags(job: str, keywords: dict) -> dict:
    flags = dict(keywords)
    if "fsdp" in flags:
        flags["fsdp"] = FSDPArgs(sharding_strategy=flags["fsdp"][0])
    if "zero" in flags:
        flags["deepspeed"] = DeepSpeedArgs(stage=flags.pop("zero"))
    if job == "finetune_lora":
        flags.update(lora_r=4, lora_dropout=0.0)
    return dict(flags, job=job, precision="32-true", train=TrainArgs(micro_batch_size=2), seq_len=64)


def model_states(work: Path) -> None:
    tiny = str(ensure_tiny_model())
    print("model states per rank (fullest rank), bytes: estimate vs logged by the real run")
    print(f"{'configuration':<34}{'component':<11}{'estimate':>11}{'measured':>11}{'error':>9}")
    for name, (job, flags, keywords) in STATE_RUNS.items():
        out = work / name.replace(" ", "_").replace(",", "").replace("=", "")
        metrics = out / "logs" / "csv" / "metrics.csv"
        if not metrics.is_file():
            proc = subprocess.run(
                [sys.executable, "-m", "litft", job, tiny, *COMMON, *flags, "--out_dir", str(out)],
                cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
            if proc.returncode != 0:
                last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
                print(f"{name:<34}the run exited {proc.returncode} ({last[:80]})")
        logged = None
        if metrics.is_file():
            with open(metrics) as f:
                logged = next((row for row in csv.DictReader(f) if row.get("params_bytes")), None)
        if logged is None:
            continue
        plan = memory_plan(model=tiny, **estimate_flags(job, keywords))
        rank = plan["per_rank"]
        for component, key in STATE_KEYS:
            estimated = rank[component]["gpu"] + rank[component]["cpu"]
            if component == "params":
                estimated -= plan["quant_state_bytes"]  # not a parameter, so not in the logged bytes
            measured = float(logged[key])
            label = name if component == "params" else ""
            print(f"{label:<34}{component:<11}{estimated:>11,.0f}{measured:>11,.0f}{error(estimated, measured):>9}", flush=True)


# name: (job, precision, checkpointing, estimate keywords)
ACTIVATION_CASES = {
    "full 32-true": ("finetune_full", "32-true", False, {}),
    "full 32-true, checkpointing": ("finetune_full", "32-true", True, {}),
    "full bf16-mixed (autocast)": ("finetune_full", "bf16-mixed", False, {}),
    "full bf16-mixed, checkpointing": ("finetune_full", "bf16-mixed", True, {}),
    "full bf16-true, eager attention": ("finetune_full", "bf16-true", False, {"attention": "eager"}),
    "LoRA bf16-true": ("finetune_lora", "bf16-true", False, {}),
    "LoRA bf16-true, checkpointing": ("finetune_lora", "bf16-true", True, {}),
    "QLoRA nf4 bf16-mixed": ("finetune_lora", "bf16-mixed", False, {"quantize": "bnb.nf4"}),
    "QLoRA nf4 bf16-mixed, checkpointing": ("finetune_lora", "bf16-mixed", True, {"quantize": "bnb.nf4"}),
}


def real_module(folder: str, job: str, precision: str, checkpointing: bool, quantize, attention):
    """The module a job trains, with real (random) weights, built by the project's own code."""
    lora = LoraArgs(r=8, alpha=16, dropout=0.05, target_modules="all-linear", quantize=quantize) if job == "finetune_lora" else None
    config = load_config(folder)
    if attention:
        config._attn_implementation = attention
    model = build_model(config, precision, lora, checkpointing, source=folder, device=torch.device("cpu"))
    lm = CausalLM(model, TrainArgs(), next_token())
    if not quantize:
        Materializer(lm.model, lm.hf_model, None, 0)(lm)
    lm.train()
    return lm


def activations(work: Path, batch_size: int, seq_len: int) -> None:
    folder = work / "small-llama"
    config = LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
    print(f"\nactivations of one training step, MiB: Llama 6 x 256 hidden, vocab 2048, micro batch {batch_size} x {seq_len} tokens")
    print(f"{'configuration':<38}{'':<7}{'estimate':>9}{'measured':>9}{'error':>9}")
    for name, (job, precision, checkpointing, keywords) in ACTIVATION_CASES.items():
        lm = real_module(str(folder), job, precision, checkpointing, keywords.get("quantize"), keywords.get("attention"))
        tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len))
        batch = {"input_ids": tokens, "labels": tokens, "position_ids": torch.arange(seq_len).expand(batch_size, -1)}
        measured = measure_step(lm, batch, torch.bfloat16 if precision.endswith("-mixed") else None)
        plan = memory_plan(
            model=str(folder), job=job, precision=precision, seq_len=seq_len,
            train=TrainArgs(micro_batch_size=batch_size, gradient_checkpointing=checkpointing), **keywords,
        )
        rows = [("peak", plan["activations"]["peak"], measured["peak"])]
        if not checkpointing:  # checkpointed blocks hide what they save from outer hooks
            rows.insert(0, ("saved", plan["activations"]["saved"], measured["saved"]))
        for i, (what, estimated, real) in enumerate(rows):
            label = name if i == 0 else ""
            print(f"{label:<38}{what:<7}{estimated / 2**20:9.2f}{real / 2**20:9.2f}{error(estimated, real):>9}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "states", "activations"), default="all")
    parser.add_argument("--work", type=Path, default=None, help="folder for runs and the small model (default: a new temporary one)")
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=256)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    quiet_libraries()
    work = args.work or Path(tempfile.mkdtemp(prefix="litft-estimate-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.part in ("all", "states"):
        model_states(work)
    if args.part in ("all", "activations"):
        activations(work, args.batch_size, args.seq_len)


if __name__ == "__main__":
    main()
