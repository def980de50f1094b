"""The record's ledger: figures appended to ``benchmarks/history.jsonl`` with what ran them (commit, machine, device, versions),
each printed beside its last entry on the same device and its goal. Both records write through it (``record.py`` on the CPU,
``gpu_record.py`` on a GPU).
"""

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
HISTORY = ROOT / "benchmarks" / "history.jsonl"
GOALS = {"zero3_lora_peak": ("<=", 0.8), "zero3_lora_peak_defaults": ("<=", 0.8), "zero3_lora_peak_vocab": ("<=", 0.8),
         "zero3_lora_peak_wide": ("<=", 0.8), "fsdp_accumulation": ("<", 0.25),
         "suite_seconds": ("<", 1800)}
for _shape in ("", "_mb8"):
    for _job in ("lora", "full", "lora_dropout"):
        GOALS[f"{_job}_vs_trainer{_shape}"] = (">=", 1.3)
        GOALS[f"{_job}_memory_vs_trainer{_shape}"] = ("<=", 1.0)
    GOALS[f"lora_dropout_cost{_shape}"] = ("<=", 1.1)


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    # The record's own appends to history.jsonl are not a change to the code measured.
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/history.jsonl"],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return head + ("+changes" if dirty else "")


def machine() -> str:
    return f"{platform.machine()} {os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB, " \
           f"{platform.python_implementation()} {platform.python_version()}"


def software() -> Dict[str, Optional[str]]:
    """The device the figures ran on and the versions that decide them."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def installed(name: str) -> Optional[str]:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "torch": torch.__version__, "transformers": installed("transformers"), "peft": installed("peft")}


def last_values(device: str, history: Path = HISTORY) -> Dict[str, float]:
    """Each figure's last entry on this device (entries from before devices were named count as the CPU's)."""
    last = {}
    if history.is_file():
        for line in history.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                if entry.get("device", "cpu") == device:
                    last[entry["figure"]] = entry["value"]
    return last


def record(figures: Dict[str, float], history: Path = HISTORY, stamp: Optional[dict] = None, goals: Optional[dict] = None) -> List[str]:
    """Append the figures to the history; one printed line each, with its change since its last entry and its goal (the
    CPU record's, and ``goals``: the GPU record's own)."""
    goals = {**GOALS, **(goals or {})}
    stamp = stamp or {"commit": commit(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
                      "machine": machine(), **software()}
    before = last_values(stamp["device"]) if history == HISTORY else {}
    lines = []
    with open(history, "a") as f:
        for figure, value in figures.items():
            f.write(json.dumps({**stamp, "figure": figure, "value": round(value, 4)}) + "\n")
            change = f"{value - before[figure]:+.3f} since the last entry ({before[figure]:.3f})" if figure in before else "first entry"
            goal = goals.get(figure)
            verdict = "no goal" if goal is None else f"goal {goal[0]} {goal[1]}: " + (
                "met" if {"<=": value <= goal[1], "<": value < goal[1], ">=": value >= goal[1]}[goal[0]] else "NOT MET")
            lines.append(f"{figure:<32} {value:11.3f}   {change:<44} {verdict}")
    return lines
