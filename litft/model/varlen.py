"""torch's varlen flash kernel: whether this torch has one, which signature, and the call built for it.

Every sample of a padding-free batch attends inside itself in one call, cut by
cumulative sequence lengths. torch gained the kernel in 2.10 and changed its
signature twice since; the signature is read once from the function itself, so no
torch sees a keyword it does not know. ``LITFT_VARLEN_KERNEL`` names another kernel
with the same contract: the tests run the CUDA path on the CPU with stand-ins
(tests/varlen_standins.py).
"""

import importlib
import inspect
import os
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from litft.errors import LitftError

KERNEL_VARIABLE = "LITFT_VARLEN_KERNEL"  # "module:function" of a kernel with varlen_attn's contract


@dataclass(frozen=True)
class VarlenKernel:
    """A varlen flash kernel and what its signature takes, read once from the function itself.

    torch shipped three signatures: 2.10 takes ``is_causal`` and no scale, 2.11 and
    2.12 a keyword ``window_size`` and ``scale``, 2.13 adds ``enable_gqa``. The call is
    built from what this one accepts, so no torch sees a keyword it does not know.
    """

    function: Callable
    parameters: frozenset
    device_type: str = "cuda"  # where the kernel runs; a stand-in says "cpu"
    dtypes: Tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)  # flash kernels refuse fp32

    @classmethod
    def of(cls, function: Callable) -> "VarlenKernel":
        return cls(function, frozenset(inspect.signature(function).parameters), getattr(function, "device_type", "cuda"))

    @property
    def causal(self) -> bool:
        """Whether it can mask causally at all (every torch release so far can)."""
        return bool({"window_size", "is_causal"} & self.parameters)

    @property
    def takes_gqa(self) -> bool:
        return "enable_gqa" in self.parameters

    def runs(self, device_type: str, dtype: torch.dtype, scaling: Optional[float], head_dim: int) -> bool:
        """Whether this call can go to the kernel: its device, a half dtype, and a scale it can be given."""
        default_scale = scaling is None or abs(scaling - head_dim**-0.5) < 1e-12
        return self.causal and device_type == self.device_type and dtype in self.dtypes and ("scale" in self.parameters or default_scale)

    @property
    def takes_window(self) -> bool:
        return "window_size" in self.parameters

    def __call__(self, query, key, value, cu, longest: int, scaling: Optional[float], window: Optional[int] = None):
        """Causal attention over flattened tokens (T, H, D) split into samples by ``cu``; K and V repeated where GQA is not taken.

        ``window``: each query sees itself and the ``window - 1`` tokens before it (transformers' sliding window).
        """
        kwargs = {}
        if self.takes_window:
            kwargs["window_size"] = (-1 if window is None else window - 1, 0)
        elif window is not None:
            raise ValueError("this varlen kernel has no window_size")
        else:
            kwargs["is_causal"] = True
        if "scale" in self.parameters:
            kwargs["scale"] = scaling
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            if self.takes_gqa:
                kwargs["enable_gqa"] = True
            else:
                key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        return self.function(query, key, value, cu, cu, longest, longest, **kwargs)


def find_varlen_kernel(variable: Optional[str] = None) -> Optional[VarlenKernel]:
    """The kernel ``LITFT_VARLEN_KERNEL`` names, else torch's varlen_attn (torch 2.10 and later), else None."""
    named = os.environ.get(KERNEL_VARIABLE) if variable is None else variable
    if named:
        module, _, name = named.partition(":")
        try:
            function = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as err:
            raise LitftError(f"{KERNEL_VARIABLE}={named} cannot be imported ({err}); give module:function or unset it") from None
        return VarlenKernel.of(function)
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return VarlenKernel.of(varlen_attn)


VARLEN: Optional[VarlenKernel] = find_varlen_kernel()


def use_varlen_kernel(kernel: Optional[VarlenKernel]) -> Optional[VarlenKernel]:
    """Make ``kernel`` the one every later attention call uses; the previous one is returned (tests swap stand-ins)."""
    global VARLEN
    previous, VARLEN = VARLEN, kernel
    return previous


def segments_path(device_type: str, precision: str, kernel: Optional[VarlenKernel] = None) -> Tuple[str, str]:
    """How litft_segments will attend on this device at this precision, and why: ``("varlen" | "sdpa", reason)``."""
    kernel = VARLEN if kernel is None else kernel
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") else torch.float32
    if kernel is None:
        return "sdpa", f"torch {torch.__version__.split('+')[0]} has no varlen flash kernel (torch 2.10 and later do)"
    if device_type != kernel.device_type:
        return "sdpa", f"the varlen flash kernel runs on {kernel.device_type} only"
    if dtype not in kernel.dtypes:
        return "sdpa", f"{precision} attends in {str(dtype).removeprefix('torch.')} and the varlen flash kernel takes fp16/bf16 only"
    gqa = "enable_gqa" if kernel.takes_gqa else "K/V heads repeated for grouped-query attention (this torch's kernel has no enable_gqa)"
    return "varlen", f"{str(dtype).removeprefix('torch.')} on {device_type}; {gqa}"
