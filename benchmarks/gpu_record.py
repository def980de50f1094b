"""The GPU figures of ``benchmarks/record.py --accelerator cuda``: litft and its peer in the same call, on one H100 or H200.

Groups run in the order below, most important first, while the call's time
(``--seconds``, 470 by default: one 8-minute call) has room for the group's
measured length; the rest are named as left out. Each group runs the measuring
script a user would run and reads its JSON lines as they come, so a group cut at
its time limit, or a side that fails (out of memory, say), still records the
sides that finished, and a failure is printed with the line it died of. A group
whose peer is not installed (torchao, bitsandbytes, TRL) is skipped. All models
are random-weight shapes built on the device (it has no network).

| group | what | figures (``gpu_`` prefix) |
|---|---|---|
| 1b_full | Llama-3.2-1B shape, seq 2048, full bf16-true against HF Trainer; litft also with ``--compile true`` | tok/s, MFU, speed and memory over Trainer, compiled over eager |
| 1b_lora | the same shape, LoRA bf16-mixed | the same |
| 1b_fp8 | the full run with ``--fp8 tensorwise`` (compiled, as ``auto`` does with FP8) | FP8 over Trainer's bf16 |
| compile_ablation | a bare step of the 1B shape, eager and compiled, with litft's model changes added one at a time (benchmarks/compile_ablation.py) | compiled over eager for each |
| moe | a Qwen3-MoE training step, grouped experts against the per-expert loop (benchmarks/moe_experts.py) | speed-up |
| 8b_lora | Llama-3.1-8B shape, seq 4096, LoRA bf16-true, micro 1, global 8 | tok/s, MFU, speed and memory over Trainer |
| 1b_chat | chat SFT on the 1B shape: varied lengths, prompt masked | tok/s, speed and memory over Trainer |
| 8b_qlora | the 8B run with the base in NF4 (bitsandbytes) | tok/s, speed and memory over Trainer + bitsandbytes |
| dpo | DPO with LoRA on the 1B shape against TRL's DPOTrainer (benchmarks/vs_trl_dpo.py); litft also with activations checkpointed, as TRL does by default | speed and memory over TRL |
| grpo | GRPO with LoRA on the 1B shape against TRL's GRPOTrainer (benchmarks/vs_trl_grpo.py): 16 prompts x 8 completions of up to 128 tokens a step | steps/s and memory over TRL, each side as it comes and with litft's activations checkpointed |
| vlm | vision-language LoRA SFT on a LLaVA built on the device (a 2048 x 16 Llama, 64 image tokens a picture) against TRL's SFTTrainer (benchmarks/vs_trl_vlm.py) | steps/s and memory over TRL |
| 8b_long | the 8B QLoRA run at one 65,536-token sequence a step: checkpointing alone, and with activation offload and the tiled MLP | tok/s and peak of each, offload over checkpointed |
| 8b_qlora_max_seq, 8b_lora_max_seq | the longest single sequence 8B QLoRA (LoRA in bf16) trains a step at, with checkpointing, offload and the tiled MLP (benchmarks/longest_sequence.py: from the estimate, each try a real step) | the longest length that fitted |

``--dry`` checks the plan on the CPU in seconds: every command's flags parse with
its script's own parser, and each group's reader turns a sample of its script's
output into figures; nothing runs on a GPU and nothing is appended.
"""

import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
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
    "gpu_1b_lora_dropout_cost": ("<=", 1.1),  # issue 57: LoRA's step at --lora_dropout 0.05 over its step at 0
}


@dataclass
class Group:
    """One measuring command, what it needs installed, its time limit and how its output becomes figures."""

    script: str
    args: List[str]
    seconds: int  # its measured length on an H100 (builds included); its limit is half as much again
    read: Callable[[List[dict], Dict[str, float]], Dict[str, float]]
    needs: tuple = ()
    sample: tuple = ()  # output lines of the script, for --dry


def trainer_rows(rows: List[dict], _: Dict[str, float]) -> Dict[str, float]:
    """vs_hf_trainer.py's side lines: litft's tok/s and MFU per run, its speed and memory over Trainer's, each
    ``litft-<change>`` side's tok/s, and what compiling gives (the compiled side over litft's default, eager blocks)."""
    figures = {}
    for row in rows:
        if "error" in row:
            continue
        run = "gpu_" + row["run"].replace("-", "_")
        if row["side"] == "litft":
            figures[f"{run}_tok_s"] = row["tokens_per_s"]
            if row.get("mfu") is not None:
                figures[f"{run}_mfu"] = row["mfu"]
        elif row["side"] == "trainer":
            figures[f"{run}_vs_trainer"] = row["litft_speed_over_this"]
            figures[f"{run}_memory_vs_trainer"] = row["litft_memory_over_this"]
        elif row["side"] == "litft-dropout-alternating":
            figures[f"{run}_dropout_cost"] = row["dropout_cost"]
        elif row["side"].startswith("litft-"):
            figures[f"{run}_{row['side'].removeprefix('litft-')}_tok_s"] = row["tokens_per_s"]
            if row.get("peak_gb") is not None:
                figures[f"{run}_{row['side'].removeprefix('litft-')}_peak_gb"] = row["peak_gb"]
    for run in {name[: -len("_offload_tok_s")] for name in figures if name.endswith("_offload_tok_s")}:
        if figures.get(f"{run}_checkpointed_tok_s"):
            figures[f"{run}_offload_over_checkpointed"] = figures[f"{run}_offload_tok_s"] / figures[f"{run}_checkpointed_tok_s"]
    for run in {name[: -len("_compiled_tok_s")] for name in figures if name.endswith("_compiled_tok_s")}:
        if figures.get(f"{run}_tok_s"):
            figures[f"{run}_compile_gain"] = figures[f"{run}_compiled_tok_s"] / figures[f"{run}_tok_s"]
    return figures


def fp8_rows(rows: List[dict], earlier: Dict[str, float]) -> Dict[str, float]:
    """The FP8 run (compiled, as ``auto`` does with FP8) over Trainer's bf16, from group 1b_full of the same call."""
    figures = trainer_rows(rows, earlier)
    full, fp8 = earlier.get("gpu_1b_full_tok_s"), figures.get("gpu_1b_full_fp8_tok_s")
    if fp8 and full and earlier.get("gpu_1b_full_vs_trainer"):
        figures["gpu_1b_full_fp8_vs_trainer_bf16"] = fp8 / (full / earlier["gpu_1b_full_vs_trainer"])
    return figures


def ablation_rows(rows: List[dict], _: Dict[str, float]) -> Dict[str, float]:
    """compile_ablation.py's lines: compiled over eager for each step of litft's model changes (plain HF blocks first)."""
    return {f"gpu_compile_gain_{row['variant'].replace('+', '_')}": row["compiled_over_eager"] for row in rows if "compiled_over_eager" in row}


def moe_rows(rows: List[dict], _: Dict[str, float]) -> Dict[str, float]:
    speed = {row["experts"]: row["tokens_per_s"] for row in rows if "tokens_per_s" in row}
    figures = {"gpu_moe_grouped_tok_s": speed["grouped_mm"]} if "grouped_mm" in speed else {}
    if "eager" in speed and figures:
        figures["gpu_moe_grouped_vs_loop"] = speed["grouped_mm"] / speed["eager"]
    return figures


def over_trl(rows: List[dict], prefix: str, speed: Callable[[dict, dict], float]) -> Dict[str, float]:
    """Each litft side's tok/s, and its speed (``speed(litft's row, TRL's)``) and memory over TRL's. TRL checkpoints
    activations by default, litft does not: its checkpointed side puts the two at one memory policy."""
    by_side = {row["side"]: row for row in rows if "tokens_per_s" in row}
    trl, figures = by_side.get("trl"), {}
    for side, name in (("litft", prefix), ("litft-checkpointed", f"{prefix}_checkpointed")):
        ours = by_side.get(side)
        if ours:
            figures[f"{name}_tok_s"] = ours["tokens_per_s"]
        if ours and trl:
            figures[f"{name}_vs_trl"] = speed(ours, trl)
            figures[f"{name}_memory_vs_trl"] = ours["peak_gb"] / trl["peak_gb"]
    return figures


def dpo_rows(rows: List[dict], _: Dict[str, float]) -> Dict[str, float]:
    return over_trl(rows, "gpu_dpo", lambda ours, trl: ours["tokens_per_s"] / trl["tokens_per_s"])


def grpo_rows(rows: List[dict], _: Dict[str, float]) -> Dict[str, float]:
    """Steps per second over TRL's: the sides sample their own completions, so a step's tokens differ a little."""
    return over_trl(rows, "gpu_grpo", lambda ours, trl: trl["s_per_step"] / ours["s_per_step"])


def vlm_rows(rows: List[dict], _: Dict[str, float]) -> Dict[str, float]:
    """Steps per second over TRL's on the same image records and batches (each side counts its own tokens)."""
    return over_trl(rows, "gpu_vlm", lambda ours, trl: trl["s_per_step"] / ours["s_per_step"])


def longest_rows(figure: str) -> Callable[[List[dict], Dict[str, float]], Dict[str, float]]:
    """longest_sequence.py's last line: the longest length that trained a step (its tries' lines come before it)."""
    def read(rows: List[dict], _: Dict[str, float]) -> Dict[str, float]:
        ended = [row["longest_fitting"] for row in rows if "longest_fitting" in row]
        # Cut short, it printed no result: the longest try that fitted, from the tries' own lines.
        longest = ended[-1] if ended else max((row["seq_len"] for row in rows if row.get("fits")), default=None)
        return {figure: float(longest)} if longest else {}
    return read


def _longest_lines(run: str, fitting: int) -> tuple:
    return (json.dumps({"run": run, "side": "offload", "device_gib": 139.8, "start": fitting}),
            json.dumps({"seq_len": fitting, "fits": True, "s": 200.0, "peak_gb": 120.0}),
            json.dumps({"run": run, "side": "offload", "longest_fitting": fitting, "shortest_failing": None, "tries": 1}))


def _trainer_line(run: str, side: str, speed: float, over: Optional[float] = None) -> str:
    row = {"run": run, "side": side, "tokens_per_s": speed, "mfu": 0.4, "peak_gb": 20.0}
    if over is not None:
        row.update(litft_speed_over_this=over, litft_memory_over_this=0.6)
    return json.dumps(row)


VS = "vs_hf_trainer.py"
AGAINST_TRL = ("vs_trl_dpo.py", "vs_trl_grpo.py")  # on the 1B folder built in the call's work directory


def _vs(runs: str, *more: str, steps: int = 8) -> List[str]:
    return ["--accelerator", "cuda", "--runs", runs, "--steps", str(steps), *more]


# Lengths measured on one H100 (2026-11-27): 1b-full litft 49 s + Trainer 20 s; 1b-lora 37 + 27 s; FP8 56 s; the MoE step 19 s.
# On one H200 (the same day): 1b_full 85 s, 1b_lora 77, 1b_fp8 114 (two sides), moe 17, 8b_lora 124, 1b_chat 99, dpo 96;
# later (10a465b): 1b_full 95 s, 1b_lora 94, 1b_fp8 180 (three sides of ~55 s), 8b_qlora's litft side 89.
GROUPS = {
    "1b_full": Group(VS, _vs("1b-full", "--sides", "litft,trainer,litft-compiled"), 150, trainer_rows,
                     sample=(_trainer_line("1b-full", "litft", 60000.0), _trainer_line("1b-full", "trainer", 48000.0, 1.25),
                             _trainer_line("1b-full", "litft-compiled", 57000.0))),
    "1b_lora": Group(VS, _vs("1b-lora", "--sides", "litft,trainer,litft-compiled"), 150, trainer_rows,
                     sample=(_trainer_line("1b-lora", "litft", 60000.0), _trainer_line("1b-lora", "trainer", 38000.0, 1.6),
                             _trainer_line("1b-lora", "litft-compiled", 62000.0))),
    # What LoRA dropout costs a step: each step's batch timed with dropout and without, in two runs (issue 57).
    "1b_lora_dropout": Group(VS, _vs("1b-lora", "--sides", "litft-dropout-alternating", "--lora_dropout", "0.05", steps=10), 120, trainer_rows,
                             sample=(json.dumps({"run": "1b-lora", "side": "litft-dropout-alternating", "tokens_per_s": 60000.0,
                                                 "peak_gb": 20.0, "dropout": 0.05, "dropout_cost": 1.05}),)),
    "1b_fp8": Group(VS, _vs("1b-full", "--sides", "litft-fp8"), 65, fp8_rows, needs=("torchao",),
                    sample=(_trainer_line("1b-full", "litft-fp8", 70000.0),)),
    "compile_ablation": Group("compile_ablation.py", ["--device", "cuda"], 170, ablation_rows,
                              sample=tuple(json.dumps({"variant": name, "compiled": True, "tokens_per_s": 60000.0, "compiled_over_eager": 1.1})
                                           for name in ("hf", "segments", "segments+head", "segments+liger", "litft"))),
    "moe": Group("moe_experts.py", ["--device", "cuda", "--tokens", "8192", "--steps", "5"], 25, moe_rows,
                 sample=(json.dumps({"experts": "eager", "tokens_per_s": 60000.0}), json.dumps({"experts": "grouped_mm", "tokens_per_s": 300000.0}))),
    "8b_lora": Group(VS, _vs("8b-lora", "--seq_len", "4096", "--sides", "litft,trainer", steps=5), 150, trainer_rows,
                     sample=(_trainer_line("8b-lora", "litft", 14000.0), _trainer_line("8b-lora", "trainer", 8000.0, 1.75))),
    "1b_chat": Group(VS, _vs("1b-chat", "--sides", "litft,trainer"), 90, trainer_rows,
                     sample=(_trainer_line("1b-chat", "litft", 18000.0), _trainer_line("1b-chat", "trainer", 7000.0, 2.5))),
    "8b_qlora": Group(VS, _vs("8b-qlora", "--seq_len", "4096", "--sides", "litft,trainer", steps=6), 200, trainer_rows,
                      needs=("bitsandbytes",), sample=(_trainer_line("8b-qlora", "litft", 12000.0), _trainer_line("8b-qlora", "trainer", 7000.0, 1.7))),
    "dpo": Group("vs_trl_dpo.py", ["--accelerator", "cuda", "--sides", "litft,trl,litft-checkpointed", "--steps", "10", "--micro_batch", "8",
                                   "--global_batch", "32"], 140, dpo_rows, needs=("trl",),
                 sample=(json.dumps({"side": "litft", "tokens_per_s": 30000.0, "peak_gb": 10.0}),
                         json.dumps({"side": "trl", "tokens_per_s": 15000.0, "peak_gb": 20.0}),
                         json.dumps({"side": "litft-checkpointed", "tokens_per_s": 24000.0, "peak_gb": 6.0}))),
    "grpo": Group("vs_trl_grpo.py", ["--accelerator", "cuda", "--sides", "litft,trl,litft-checkpointed", "--prompts", "16", "--group", "8",
                                     "--max_new_tokens", "128", "--micro_batch", "32", "--steps", "4"], 240, grpo_rows, needs=("trl",),
                  sample=tuple(json.dumps({"side": side, "tokens_per_s": speed, "s_per_step": 10000.0 / speed, "peak_gb": gb})
                               for side, speed, gb in (("litft", 3000.0, 12.0), ("trl", 1500.0, 10.0), ("litft-checkpointed", 2500.0, 8.0)))),
    "vlm": Group("vs_trl_vlm.py", ["--accelerator", "cuda", "--hidden", "2048", "--layers", "16", "--records", "256", "--micro_batch", "16",
                                   "--global_batch", "32", "--steps", "8"], 150, vlm_rows, needs=("trl", "PIL"),
                 sample=(json.dumps({"side": "litft", "tokens_per_s": 30000.0, "s_per_step": 0.5, "peak_gb": 10.0}),
                         json.dumps({"side": "trl", "tokens_per_s": 20000.0, "s_per_step": 0.75, "peak_gb": 14.0}))),
    "8b_long": Group(VS, _vs("8b-qlora-long", "--seq_len", "65536", "--sides", "litft-checkpointed,litft-offload", steps=4), 240,
                     trainer_rows, needs=("bitsandbytes",),
                     sample=(_trainer_line("8b-qlora-long", "litft-checkpointed", 4000.0), _trainer_line("8b-qlora-long", "litft-offload", 3600.0))),
    # The longest sequence that trains a step (issue 53), each its own call: a try at 300k tokens takes minutes.
    "8b_qlora_max_seq": Group("longest_sequence.py", ["--runs", "8b-qlora-long", "--side", "offload", "--seconds", "440"], 450,
                              longest_rows("gpu_8b_qlora_max_seq"), needs=("bitsandbytes",), sample=_longest_lines("8b-qlora-long", 400384)),
    "8b_lora_max_seq": Group("longest_sequence.py", ["--runs", "8b-lora-long", "--side", "offload", "--seconds", "440"], 450,
                             longest_rows("gpu_8b_lora_max_seq"), sample=_longest_lines("8b-lora-long", 200704)),
}
TAKE_WORK_DIR = (VS, "longest_sequence.py")  # scripts that build the random-weight shapes in the call's work folder


def command(group: Group, work: Path) -> List[str]:
    """The script's arguments: the models built once in ``work`` (no network on the device)."""
    args = list(group.args)
    if group.script in TAKE_WORK_DIR:
        args += ["--work_dir", str(work)]
    if group.script in AGAINST_TRL:
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
    else:
        module = importlib.import_module(Path(group.script).stem)
        if hasattr(module, "parse_args"):
            module.parse_args(argv)


def stream_rows(argv: List[str], limit: float) -> tuple:
    """Run a measuring script; its JSON lines as far as it got within ``limit`` seconds, and why it stopped (None when it ended well)."""
    from vs_hf_trainer import died_of

    rows = []

    def read(stdout) -> None:
        for line in stdout:
            if line.startswith("{"):
                rows.append(json.loads(line))

    with tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        reader = threading.Thread(target=read, args=(process.stdout,), daemon=True)
        reader.start()
        try:
            process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the sides' own processes too
            process.wait()
            reader.join(5)
            return rows, f"past its {limit:.0f} s limit"
        reader.join(5)
        if process.returncode != 0:
            err.seek(0)
            return rows, f"exited {process.returncode}: {died_of(err.read())}"
    return rows, None


def run_gpu_record(chosen: Optional[List[str]], dry: bool, history: Path, seconds: float = 470.0) -> None:
    """Run the groups in order while the call's ``seconds`` leave room for each, recording each group's figures as it ends."""
    from figures import record

    names = list(GROUPS) if chosen in (None, ["all"]) else chosen
    unknown = set(names) - set(GROUPS)
    if unknown:
        raise SystemExit(f"unknown GPU groups {sorted(unknown)}; choose from {', '.join(GROUPS)}")
    if not dry:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("record.py --accelerator cuda: no CUDA device here; --dry checks the plan on the CPU")
    # --dry only prints the commands: it names a folder without making one (CI runs it on every test run)
    work = Path(tempfile.gettempdir()) / "litft-gpu-record-dry" if dry else Path(tempfile.mkdtemp(prefix="litft-gpu-record-"))
    figures: Dict[str, float] = {}
    began, left_out = time.monotonic(), []
    for name in names:
        group = GROUPS[name]
        missing = [package for package in group.needs if importlib.util.find_spec(package) is None]
        argv = command(group, work)
        if dry:
            check_flags(group, argv)
            got = group.read([json.loads(line) for line in group.sample], figures)
            print(f"dry {name} (~{group.seconds} s): {' '.join(argv)} -> {', '.join(sorted(got))}"
                  + (f" (would skip: {', '.join(missing)} missing)" if missing else ""))
            figures.update(got)
            continue
        if missing:
            print(f"{name}: skipped, {', '.join(missing)} not installed", flush=True)
            continue
        remaining = seconds - (time.monotonic() - began)
        if remaining < group.seconds:
            left_out.append(name)
            continue
        if group.script in AGAINST_TRL:
            from gpu_throughput import random_weights

            random_weights("llama-3.2-1b", work)
        started = time.monotonic()
        rows, stopped = stream_rows([sys.executable, str(BENCH / group.script), *argv], min(1.5 * group.seconds, remaining))
        for row in rows:  # every side's own line in the log: its compile counts, profile folder and peak beside the figures
            print(f"{name}: {row['error']}" if "error" in row else f"  {json.dumps(row)}", flush=True)
        got = group.read(rows, figures)
        figures.update(got)
        print(f"{name}: {time.monotonic() - started:.0f} s" + (f", {stopped}" if stopped else "")
              + ("" if got else ", nothing recorded"), flush=True)
        for line in record(got, history, goals=GOALS):  # each group's figures as soon as they exist: a call cut short keeps them
            print(line, flush=True)
    if left_out:
        print(f"left out, past --seconds {seconds:.0f}: {', '.join(left_out)} (run them with --figures {' '.join(left_out)})")
    if dry:
        total = sum(GROUPS[name].seconds for name in names)
        print(f"dry: {len(names)} groups, {len(figures)} figures, about {total} s measured on an H100 (--seconds {seconds:.0f}); "
              "nothing ran on a GPU and nothing was appended")
