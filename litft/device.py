"""Which device a run trains on and in which number formats."""

import ctypes
import os
from typing import Optional

import torch

from litft.errors import LitftError

_PROCESS = ctypes.CDLL(None)  # the symbols already loaded, the C library's among them


def release_freed_host_memory() -> None:
    """Give freed heap pages back to the system (glibc only; elsewhere nothing happens).

    glibc raises its mmap threshold after a large free, so the next buffers of a
    size come from the heap and stay resident once freed: filling a model one part
    at a time would otherwise keep the memory of every transient whole part.
    """
    trim = getattr(_PROCESS, "malloc_trim", None)
    if trim is not None:
        trim(0)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
HOST_MAP_THRESHOLD = 1 << 20


def map_large_host_allocations(threshold: int = HOST_MAP_THRESHOLD) -> bool:
    """Give each host allocation of ``threshold`` bytes or more its own mapping, unmapped when freed (glibc only).

    By default glibc raises its mmap threshold after each large free, up to 32 MiB, so
    the tensors a CPU training step makes and frees (ZeRO-3's gathered weights, FSDP's
    unsharded units, activations) come from the heap and their pages stay with the
    process: its resident memory climbs to the sum of every transient it ever held.
    A fixed threshold keeps resident memory at what is live. Whether it took.
    """
    mallopt = getattr(_PROCESS, "mallopt", None)
    return bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, threshold))


def cuda_allocator_defaults(env=None) -> None:
    """Expandable segments for PyTorch's CUDA allocator unless the user configured it (before CUDA starts).

    Training steps of varied lengths fragment fixed-size segments; expandable ones
    grow in place and typically save several GB of reserved-but-unused memory.
    """
    env = os.environ if env is None else env
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def resolve_accelerator(accelerator: str) -> str:
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator in ("cuda", "gpu") and not torch.cuda.is_available():
        raise LitftError(f"--accelerator {accelerator} was asked for but no CUDA device is visible; use --accelerator cpu")
    return "cuda" if accelerator == "gpu" else accelerator


def resolve_precision(precision: Optional[str], accelerator: str) -> str:
    """bf16-mixed where the GPU supports it, full fp32 elsewhere, unless the user chose."""
    if precision is None:
        if accelerator == "cuda" and torch.cuda.is_bf16_supported():
            return "bf16-mixed"
        return "32-true"
    if precision == "16-mixed" and accelerator == "cpu":
        raise LitftError("--precision 16-mixed needs a GPU (fp16 autocast is not supported on the CPU); use bf16-mixed or 32-true")
    return precision


def param_dtype(precision: str) -> torch.dtype:
    """The dtype weights are stored in: the low-precision one for *-true, fp32 under autocast."""
    return {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision, torch.float32)


def compute_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") else torch.float32


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
