"""``litft env``: what a bug report needs about this machine, and ``--check``: two real steps under each strategy it can run.

The report imports no optional package (versions come from the installed
metadata), so it works where an import would fail, which is when it is needed.
"""

import importlib.metadata
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist

from litft.model.attention import SEGMENTS
from litft.model.varlen import VARLEN, segments_path
from litft.model.experts import CHOSEN, grouped_kernel
from litft.model.recurrent import KERNEL_PACKAGES
from litft.cli.selfcheck import Case, run_matrix, summary_line
from litft.run.plan import Facts, choose_attention, installed_packages

PACKAGES = ("litft", "torch", "lightning-fabric", "transformers", "peft", "bitsandbytes", "deepspeed", "liger-kernel", "flash-attn", "datasets", "accelerate")
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


def installed(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def nccl_version() -> str:
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "nccl"):
        return "-"
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build without NCCL says so in many ways
        return "not built"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def report_lines() -> List[str]:
    """The report, a line each: versions, accelerators, distributed backends, and the attention path per precision."""
    lines = [f"Python        {sys.version.split()[0]} ({sys.executable})", f"OS            {platform.platform()}"]
    lines.append(f"torch         {torch.__version__} (CUDA build {torch.version.cuda or '-'}, NCCL {nccl_version()})")
    for package in PACKAGES:
        if package != "torch":
            lines.append(f"{package:<13} {installed(package) or 'not installed'}")
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            lines.append(
                f"cuda:{index}        {props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability {props.major}.{props.minor}, "
                f"bf16 {'yes' if torch.cuda.is_bf16_supported() else 'no'}"
            )
    else:
        lines.append("accelerator   none visible (CUDA_VISIBLE_DEVICES, the driver and the torch build decide): the CPU trains, with gloo")
    backends = [name for name, available in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()), ("mpi", dist.is_mpi_available())) if available]
    lines.append(f"distributed   {', '.join(backends) or 'none'}")
    kernel = "none (torch < 2.10)" if VARLEN is None else ("torch's varlen_attn" + (", enable_gqa" if VARLEN.takes_gqa else ", no enable_gqa"))
    lines.append(f"varlen kernel {kernel}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for precision in PRECISIONS:
        chosen = choose_attention(Facts(accelerator=device, precision=precision, installed=installed_packages()))
        if chosen == SEGMENTS:
            path, why = segments_path(device, precision)
            how = "varlen flash kernel" if path == "varlen" else "SDPA"
            lines.append(f"attention     {precision:<10} -> {SEGMENTS} with {how}: {why}")
        else:
            lines.append(f"attention     {precision:<10} -> {chosen}: flash-attn is installed and takes {precision}")
    lines.append(f"MoE experts   {experts_line(device)}")
    kernels = ", ".join(f"{name} {installed(name) or 'not installed'}" for name in KERNEL_PACKAGES.values())
    lines.append(f"state layers  {kernels} (transformers' CUDA kernels for Mamba, short convolutions, gated delta rules; PyTorch otherwise)")
    return lines


def experts_line(device: str) -> str:
    """How a mixture-of-experts model's experts would run here (litft.model.experts)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return "the model's own per-expert loop (this transformers has no experts interface)"
    if CHOSEN not in ALL_EXPERTS_FUNCTIONS:
        return f"the model's own per-expert loop (this transformers has no {CHOSEN})"
    dtype, name = (torch.bfloat16, "bf16") if device == "cuda" else (torch.float32, "fp32")
    return f"{CHOSEN} with {grouped_kernel(device, dtype)} ({name})"


def skipped_strategies(world: int) -> List[str]:
    """What ``--check`` leaves out on this machine, and why, one line each."""
    skipped = []
    if world < 2:
        skipped.append("DDP: one GPU here, and DDP needs two processes")
    if not dist.is_available():
        skipped.append("FSDP: this torch has no torch.distributed")
    if not installed("deepspeed"):
        skipped.append("ZeRO-2 and ZeRO-3: DeepSpeed is not installed (DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)")
    return skipped


def check_cases() -> tuple:
    """The strategies this machine can run, at its default precision: ``(cases, accelerator, world)``."""
    cuda = torch.cuda.is_available()
    accelerator = "cuda" if cuda else "cpu"
    precision = "bf16-mixed" if cuda and torch.cuda.is_bf16_supported() else "32-true"
    world = min(2, torch.cuda.device_count()) if cuda else 2  # two gloo processes on the CPU
    strategies = ["single"]
    if world > 1:
        strategies.append("ddp")
    if dist.is_available():
        strategies.append("fsdp")
    if installed("deepspeed"):
        strategies += ["zero2", "zero3"]
    return [Case("finetune_full", s, precision) for s in strategies], accelerator, world


def env(check: bool = False) -> None:
    """Print what a bug report needs about this machine; with --check, also train two steps under each strategy it can run.

    Args:
        check: Also run two real steps of a tiny model under each strategy (one process, DDP, FSDP, ZeRO-2, ZeRO-3) on this machine's accelerator, a pass/fail line each.
    """
    print("\n".join(report_lines()), flush=True)
    if not check:
        return
    cases, accelerator, world = check_cases()
    print(f"\nchecking {len(cases)} strategies on {accelerator} ({world} processes where distributed), two steps each:", flush=True)
    for line in skipped_strategies(world):
        print(f"skipped  {line}", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="litft-env-check-") as scratch:
        results = run_matrix(cases, Path(scratch), accelerator=accelerator, world=world, timeout=600, say=lambda r: print(summary_line(r), flush=True))
    failed = [r for r in results if not r["passed"]]
    print(f"litft env --check: {len(results) - len(failed)} of {len(results)} strategies trained and checked in {time.perf_counter() - started:.0f} s")
    if failed:
        sys.exit(1)
