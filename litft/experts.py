"""How a mixture-of-experts layer computes its experts: transformers' grouped matmul, chosen once and named.

transformers (5 and later) runs the experts of its MoE models through one interface
with several implementations: ``eager`` (a loop over experts, each gathering its
tokens), ``batched_mm`` (each token's top-k expert weights gathered, k copies of an
expert's weights per token) and ``grouped_mm`` (tokens sorted by expert, one grouped
matmul: torch's kernel where the running torch has one for the device, transformers'
exact per-expert fallback elsewhere). All three give the loop's loss and gradients
(tests/unit/test_experts.py); grouped_mm is the one that scales with experts and
tokens (benchmarks/moe_experts.py), so litft trains with it wherever the model and
transformers offer it, and says so on the run's first screen and in ``litft env``.
Older transformers, without the interface, keep the model's own loop.
"""

from typing import Optional

import torch

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
CHOSEN = "grouped_mm"


def has_experts_interface(model: torch.nn.Module) -> bool:
    """Whether the model's experts run through transformers' experts interface (so their implementation can be set)."""
    if not hasattr(model, "set_experts_implementation"):
        return False
    return any(hasattr(module, "has_gate") and hasattr(module, "is_concatenated") for module in model.modules())


def grouped_kernel(device_type: str, dtype: torch.dtype) -> str:
    """What grouped_mm runs on this device and dtype: torch's grouped kernel, or transformers' per-expert fallback."""
    try:
        from transformers.integrations.moe import _can_use_grouped_mm
    except ImportError:
        return "transformers' per-expert fallback"
    device = torch.device(device_type)
    try:
        probe = _can_use_grouped_mm(torch.empty(2, 8, device=device, dtype=dtype), torch.empty(2, 8, 8, device=device, dtype=dtype),
                                    torch.tensor([1, 2], device=device, dtype=torch.int32))
    except Exception:  # noqa: BLE001 - a probe that cannot run means the fallback
        probe = False
    if not probe:
        return "transformers' per-expert fallback"
    return "torch.nn.functional.grouped_mm" if hasattr(torch.nn.functional, "grouped_mm") else "torch._grouped_mm"


def choose(model: torch.nn.Module) -> Optional[str]:
    """The experts implementation litft trains ``model`` with, or None where the model has no experts interface."""
    return CHOSEN if has_experts_interface(model) else None


def use_grouped_experts(model: torch.nn.Module) -> Optional[str]:
    """Set the chosen experts implementation on ``model`` (its config carries it, so a meta skeleton will do); which, or None."""
    chosen = choose(model)
    if chosen is not None and model.config._experts_implementation != chosen:
        model.set_experts_implementation(chosen)
    return chosen


def describe(model: torch.nn.Module, device_type: str, dtype: torch.dtype) -> Optional[str]:
    """The run's first-screen line for a MoE model's experts, or None for a dense one."""
    if not has_experts_interface(model):
        return None
    chosen = model.config._experts_implementation
    how = f" with {grouped_kernel(device_type, dtype)}" if chosen == "grouped_mm" else ""
    return f"experts: {chosen}{how}"
