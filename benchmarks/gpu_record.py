"""The GPU figures of ``benchmarks/record.py --accelerator cuda``: litft and its peer in the same call, on one H100 or H200.

``--figures`` names groups; the default is the four that fit one 8-minute call
(1b, 1b_fp8, 8b_lora, moe), ``--figures all`` adds 8b_qlora and dpo. Each group
runs the measuring script a user would run, reads its JSON lines, and
turns them into figures; a group whose peer is not installed (bitsandbytes, TRL)
says so and is skipped. Groups run in the order below, most important first, each
under its own time limit, so a call cut short still records what it reached. All
models are random-weight shapes built on the device (it has no network).

| group | what | figures (``gpu_`` prefix) |
|---|---|---|
| 1b | Llama-3.2-1B shape, seq 2048: full bf16-true, LoRA bf16-mixed, chat SFT, each against HF Trainer | tok/s, MFU, speed and memory over Trainer |
| 1b_fp8 | the same full run with ``--fp8 tensorwise``, and with ``--compile false`` | FP8 over Trainer's bf16, what compile gives |
| 8b_lora | Llama-3.1-8B shape, seq 4096, LoRA bf16-true, micro 2, global 8 | tok/s, MFU, speed and memory over Trainer |
| 8b_qlora | the same with the base in NF4 (bitsandbytes) | tok/s, speed and memory over Trainer + bitsandbytes |
| moe | a Qwen3-MoE training step, grouped experts against the per-expert loop (benchmarks/moe_experts.py) | speed-up |
| dpo | DPO with LoRA on the 1B shape against TRL's DPOTrainer (benchmarks/vs_trl_dpo.py) | speed and memory over TRL |

``--dry`` checks the plan on the CPU in seconds: every command's flags parse with
its script's own parser, and each group's reader turns a sample of its script's
output into figures; nothing runs on a GPU and nothing is appended.
"""

import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
GOALS = {  # issue 41's targets
    "gpu_1b_full_vs_trainer": (">=", 1.15), "gpu_1b_full_mfu": (">=", 0.45), "gpu_1b_full_fp8_vs_trainer_bf16": (">=", 1.35),
    "gpu_1b_lora_vs_trainer": (">=", 1.6), "gpu_1b_chat_vs_trainer": (">=", 2.3), "gpu_8b_lora_tok_s": (">=", 14000),
    "gpu_8b_lora_vs_trainer": (">=", 2.0), "gpu_8b_lora_memory_vs_trainer": ("<=", 0.6), "gpu_8b_qlora_vs_trainer": (">=", 2.0),
    "gpu_dpo_vs_trl": (">=", 1.5), "gpu_moe_grouped_vs_loop": (">=", 4.0),
}


@dataclass
class Group:
    """One measuring command, what it needs installed, its time limit and how its output becomes figures."""

    script: str
    args: List[str]
    seconds: int
    read: Callable[[List[dict], Dict[str, float]], Dict[str, float]]
    needs: tuple = ()
    sample: tuple = ()  # output lines of the script, for --dry


def trainer_rows(rows: List[dict], _: Dict[str, float]) -> Dict[str, float]:
    """vs_hf_trainer.py's summary lines: litft's tok/s and MFU per run, and its speed and memory over Trainer's."""
    figures = {}
    for row in rows:
        run = "gpu_" + row["run"].replace("-", "_")
        if row["side"] == "litft":
            figures[f"{run}_tok_s"] = row["tokens_per_s"]
            if row.get("mfu") is not None:
                figures[f"{run}_mfu"] = row["mfu"]
        elif row["side"] == "trainer":
            figures[f"{run}_vs_trainer"] = row["litft_speed_over_this"]
            figures[f"{run}_memory_vs_trainer"] = row["litft_memory_over_this"]
        elif row["side"].startswith("litft-"):
            figures[f"{run}_{row['side'].removeprefix('litft-')}_tok_s"] = row["tokens_per_s"]
    return figures


def fp8_rows(rows: List[dict], earlier: Dict[str, float]) -> Dict[str, float]:
    """The FP8 run over Trainer's bf16 (from group 1b of the same call), and compile's gain (litft at its defaults over eager)."""
    figures = trainer_rows(rows, earlier)
    full, fp8, eager = earlier.get("gpu_1b_full_tok_s"), figures.get("gpu_1b_full_fp8_tok_s"), figures.get("gpu_1b_full_eager_tok_s")
    trainer = full / earlier["gpu_1b_full_vs_trainer"] if full and earlier.get("gpu_1b_full_vs_trainer") else None
    if fp8 and trainer:
        figures["gpu_1b_full_fp8_vs_trainer_bf16"] = fp8 / trainer
    if full and eager:
        figures["gpu_1b_full_compile_gain"] = full / eager
    return figures


def moe_rows(rows: List[dict], _: Dict[str, float]) -> Dict[str, float]:
    speed = {row["experts"]: row["tokens_per_s"] for row in rows if "tokens_per_s" in row}
    return {"gpu_moe_grouped_vs_loop": speed["grouped_mm"] / speed["eager"], "gpu_moe_grouped_tok_s": speed["grouped_mm"]}


def dpo_rows(rows: List[dict], _: Dict[str, float]) -> Dict[str, float]:
    by_side = {row["side"]: row for row in rows if "side" in row}
    litft, trl = by_side["litft"], by_side["trl"]
    return {"gpu_dpo_tok_s": litft["tokens_per_s"], "gpu_dpo_vs_trl": litft["tokens_per_s"] / trl["tokens_per_s"],
            "gpu_dpo_memory_vs_trl": litft["peak_gb"] / trl["peak_gb"]}


def _trainer_line(run: str, side: str, speed: float, over: Optional[float] = None) -> str:
    row = {"run": run, "side": side, "tokens_per_s": speed, "mfu": 0.4, "peak_gb": 20.0}
    if over is not None:
        row.update(litft_speed_over_this=over, litft_memory_over_this=0.6)
    return json.dumps(row)


VS = "vs_hf_trainer.py"
GROUPS = {
    "1b": Group(VS, ["--accelerator", "cuda", "--runs", "1b-full,1b-lora,1b-chat", "--sides", "litft,trainer", "--steps", "8"], 240,
                trainer_rows, sample=(_trainer_line("1b-full", "litft", 60000.0), _trainer_line("1b-full", "trainer", 48000.0, 1.25))),
    "1b_fp8": Group(VS, ["--accelerator", "cuda", "--runs", "1b-full", "--sides", "litft-fp8,litft-eager", "--steps", "8"], 80, fp8_rows,
                    needs=("torchao",), sample=(_trainer_line("1b-full", "litft-fp8", 70000.0), _trainer_line("1b-full", "litft-eager", 50000.0))),
    "8b_lora": Group(VS, ["--accelerator", "cuda", "--runs", "8b-lora", "--seq_len", "4096", "--steps", "5"], 160, trainer_rows,
                     sample=(_trainer_line("8b-lora", "litft", 14000.0), _trainer_line("8b-lora", "trainer", 8000.0, 1.75))),
    "8b_qlora": Group(VS, ["--accelerator", "cuda", "--runs", "8b-qlora", "--seq_len", "4096", "--steps", "6"], 200, trainer_rows,
                      needs=("bitsandbytes",), sample=(_trainer_line("8b-qlora", "litft", 12000.0), _trainer_line("8b-qlora", "trainer", 7000.0, 1.7))),
    "moe": Group("moe_experts.py", ["--device", "cuda", "--tokens", "8192", "--steps", "5"], 60, moe_rows,
                 sample=(json.dumps({"experts": "eager", "tokens_per_s": 60000.0}), json.dumps({"experts": "grouped_mm", "tokens_per_s": 300000.0}))),
    "dpo": Group("vs_trl_dpo.py", ["--accelerator", "cuda", "--sides", "litft,trl", "--steps", "10", "--micro_batch", "8", "--global_batch", "32"],
                 150, dpo_rows, needs=("trl",),
                 sample=(json.dumps({"side": "litft", "tokens_per_s": 30000.0, "peak_gb": 10.0}),
                         json.dumps({"side": "trl", "tokens_per_s": 15000.0, "peak_gb": 20.0}))),
}


# What fits one call of 8 minutes (about 540 s with the models' builds); "all" adds 8B QLoRA and DPO (about 6 minutes more).
DEFAULT = ("1b", "1b_fp8", "8b_lora", "moe")


def command(group: Group, work: Path) -> List[str]:
    """The script's arguments: the models built once in ``work`` (no network on the device)."""
    args = list(group.args)
    if group.script == VS:
        args += ["--work_dir", str(work)]
    if group.script == "vs_trl_dpo.py":
        args += ["--model", str(work / "llama-3.2-1b-random")]
    return args


def check_flags(group: Group, argv: List[str]) -> None:
    """The command's flags, parsed by its script's own parser (raises SystemExit on a flag it does not take)."""
    sys.path.insert(0, str(BENCH))
    if group.script == VS:
        import vs_hf_trainer

        args = vs_hf_trainer.parse_args(argv)
        unknown = set(args.runs.split(",")) - set(vs_hf_trainer.CUDA_RUNS) | set(args.sides.split(",")) - set(vs_hf_trainer.SIDES)
        if unknown:
            raise SystemExit(f"{group.script}: unknown runs or sides {sorted(unknown)}")
    elif group.script == "vs_trl_dpo.py":
        import vs_trl_dpo

        vs_trl_dpo.parse_args(argv)


def run_gpu_record(chosen: Optional[List[str]], dry: bool, history: Path) -> None:
    from record import GOALS as CPU_GOALS
    from record import record

    CPU_GOALS.update(GOALS)
    names = list(GROUPS) if chosen == ["all"] else chosen or list(DEFAULT)
    unknown = set(names) - set(GROUPS)
    if unknown:
        raise SystemExit(f"unknown GPU groups {sorted(unknown)}; choose from {', '.join(GROUPS)}")
    if not dry:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("record.py --accelerator cuda: no CUDA device here; --dry checks the plan on the CPU")
    work = Path(tempfile.mkdtemp(prefix="litft-gpu-record-"))
    figures: Dict[str, float] = {}
    for name in names:
        group = GROUPS[name]
        missing = [package for package in group.needs if importlib.util.find_spec(package) is None]
        argv = command(group, work)
        if dry:
            check_flags(group, argv)
            got = group.read([json.loads(line) for line in group.sample], figures)
            print(f"dry {name}: {' '.join(argv)} -> {', '.join(sorted(got))}" + (f" (would skip: {', '.join(missing)} missing)" if missing else ""))
            figures.update(got)
            continue
        if missing:
            print(f"{name}: skipped, {', '.join(missing)} not installed", flush=True)
            continue
        if group.script == "vs_trl_dpo.py":
            from gpu_throughput import random_weights

            random_weights("llama-3.2-1b", work)
        started = time.perf_counter()
        try:
            out = subprocess.run([sys.executable, str(BENCH / group.script), *argv], cwd=ROOT, capture_output=True, text=True,
                                 timeout=group.seconds)
        except subprocess.TimeoutExpired:
            print(f"{name}: past its {group.seconds} s limit, nothing recorded", flush=True)
            continue
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode != 0 or not rows:
            print(f"{name}: exited {out.returncode}: {out.stderr.strip().splitlines()[-1:] or ['?']}", flush=True)
            continue
        got = group.read(rows, figures)
        figures.update(got)
        print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
        for line in record(got, history):  # each group's figures as soon as they exist: a call cut short keeps them
            print(line, flush=True)
    if dry:
        print(f"dry: {len(names)} groups, {len(figures)} figures; nothing ran on a GPU and nothing was appended")
