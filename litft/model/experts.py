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

import contextlib
import threading
from typing import Dict, List, Optional, Tuple

import torch

CHOSEN = "grouped_mm"
DEALT = "_litft_experts_dealt"  # (group, size, place) on an experts module dealt out over a group (litft.parallel.expert)
ADAPTERS = "_litft_expert_adapters"  # [(tensor name, peft ParamWrapper)] on an experts module with LoRA (litft.parallel.expert)


def has_experts_interface(model: torch.nn.Module) -> bool:
    """Whether the model's experts run through transformers' experts interface (so their implementation can be set)."""
    return hasattr(model, "set_experts_implementation") and any(is_experts(module) for module in model.modules())


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
    first = experts_modules(model)[0]
    split, adapters = getattr(first, DEALT, None), getattr(first, ADAPTERS, None)
    if split is None and adapters is None:
        how = f" with {grouped_kernel(device_type, dtype)}" if chosen == "grouped_mm" else ""
        return f"experts: {chosen}{how}"
    line = f"experts: litft's grouped dispatch with {grouped_kernel(device_type, dtype)}"
    if split is not None:
        count = expert_count(first)
        line += f", dealt out over {split[1]} ranks ({count // split[1]} of {count} per rank, tokens sent by all-to-all)"
    if adapters is not None:
        line += ", LoRA as grouped low-rank matmuls (no weight delta per expert)"
    return line


def is_experts(module: torch.nn.Module) -> bool:
    """An experts module of transformers' experts interface (its forward takes the tokens and each token's top-k experts)."""
    return hasattr(module, "has_gate") and hasattr(module, "is_concatenated")


# Routers of MoE models whose experts do not run through the interface, that return (scores, logits) and keep ``top_k``.
ROUTERS_OUTSIDE_THE_INTERFACE = ("Llama4Router",)


def routers_outside_the_interface(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """(name, router) of each MoE router outside the experts interface (Llama 4's: an nn.Linear returning scores and logits)."""
    return [(name, module) for name, module in model.named_modules() if type(module).__name__ in ROUTERS_OUTSIDE_THE_INTERFACE]


def experts_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    return [module for module in model.modules() if is_experts(module)]


PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")  # an experts module's 3-D tensors, (experts, ...) first


def expert_count(module: torch.nn.Module) -> int:
    """Experts in an experts module (a DTensor's whole shape, where they are dealt out)."""
    return next(getattr(module, name) for name in PROJECTIONS if hasattr(module, name)).shape[0]


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer in the training forwards since the last read.

    Counted on the device from the top-k indices the router hands the experts (no host
    read per step); the loop reads and clears it at log steps. A layer's imbalance is its
    busiest expert's tokens over the mean (1.0: even), which does not change when every
    count is multiplied alike: ranks of a tensor-parallel group that count the same
    tokens leave it as it is. A block recomputed by activation checkpointing is not
    counted again, and padding (collate's padded rows) is not counted at all.
    """

    def __init__(self, layers: List[torch.nn.Module], routers: bool = False):
        self.layers = layers
        split = getattr(layers[0], DEALT, None) if layers else None
        self.groups = split[1] if split is not None else 1  # ranks the experts are dealt out over (expert parallel)
        self.counts: Optional[torch.Tensor] = None  # (layers, experts)
        if routers:  # a router outside the experts interface (Llama 4's): each token's top-k experts from its logits
            self.handles = [layer.register_forward_hook(self._router_counter(i)) for i, layer in enumerate(layers)]
        else:
            self.handles = [layer.register_forward_pre_hook(self._counter(i), with_kwargs=True) for i, layer in enumerate(layers)]

    @classmethod
    def of(cls, model: torch.nn.Module) -> Optional["ExpertLoad"]:
        layers = experts_modules(model)
        if layers:
            return cls(layers)
        routers = [module for _, module in routers_outside_the_interface(model)]
        return cls(routers, routers=True) if routers else None

    def _router_counter(self, position: int):
        count = self._counter(position)

        def from_logits(module, args, output):
            logits = output[1]
            count(module, (None, logits.topk(module.top_k, dim=-1).indices), {})

        return from_logits

    def _counter(self, position: int):
        def count(module, args, kwargs):
            if not module.training or in_backward():  # activation checkpointing's recompute runs the hook again, without the mask
                return
            index = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
            if index is None:
                return
            experts = int(getattr(module, "num_experts", 0) or module.config.num_local_experts)
            real = getattr(COUNTED, "tokens", None)
            if real is not None and real.numel() == index.shape[0]:  # padded rows: padding reaches the router, not the count
                tokens = count_per_expert(index.reshape(-1), experts, real.reshape(-1, 1).expand_as(index).reshape(-1))
            else:
                tokens = count_per_expert(index.reshape(-1), experts)
            if self.counts is None:
                self.counts = torch.zeros(len(self.layers), experts, dtype=torch.float64, device=tokens.device)
            self.counts[position] += tokens

        return count

    def take(self) -> Optional[torch.Tensor]:
        """The counts since the last take (layers x experts, on the device), or None where no training forward ran."""
        counts, self.counts = self.counts, None
        return counts

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def count_per_expert(expert_ids: torch.Tensor, experts: int, counted: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pairs routed to each of ``experts`` (int64, on the ids' device), into a buffer of fixed size: no device sync; only
    the pairs ``counted`` marks where it is given.

    torch.bincount sizes its output from the largest id, which a GPU must read back to the host first.
    """
    ids = expert_ids.long()
    ones = torch.ones_like(ids) if counted is None else counted.long()
    return torch.zeros(experts, dtype=torch.long, device=ids.device).scatter_add_(0, ids, ones)


def in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


COUNTED = threading.local()  # .tokens: the micro-batch's tokens that are not padding (rows x width, bool), during its forward


@contextlib.contextmanager
def counting_only(real: Optional[torch.Tensor]):
    """Expert loads inside it count the tokens ``real`` marks (collate's padded rows), not the padding after them."""
    previous, COUNTED.tokens = getattr(COUNTED, "tokens", None), real
    try:
        yield
    finally:
        COUNTED.tokens = previous


def load_figures(counts: torch.Tensor, groups: int = 1) -> Dict[str, float]:
    """The log's view of the counts (summed over every rank): the worst and the mean layer's imbalance, each layer's, idle
    experts, and under expert parallel the pairs sent to the busiest place of a group over the mean (over the log window and
    every group: one step of one group can be worse)."""
    mean = counts.mean(dim=1).clamp(min=1e-12)
    imbalance = counts.max(dim=1).values / mean
    figures = {"expert_imbalance_max": float(imbalance.max()), "expert_imbalance_mean": float(imbalance.mean()),
               "experts_idle": int((counts == 0).sum())}
    figures.update({f"expert_imbalance/layer_{i}": float(value) for i, value in enumerate(imbalance.tolist())})
    if groups > 1:
        per_rank = counts.reshape(counts.shape[0], groups, -1).sum(dim=2)
        figures["expert_rank_imbalance_max"] = float((per_rank.max(dim=1).values / per_rank.mean(dim=1).clamp(min=1e-12)).max())
    return figures
