"""Activation memory of one real training step, measured without the estimate's code (its reference)."""

import itertools
from contextlib import nullcontext
from typing import Dict, Optional

import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, Category, MemoryProfileTimeline


def measure_step(lm, batch: dict, autocast: Optional[torch.dtype] = None, peak: bool = True) -> Dict[str, int]:
    """Activation bytes of one real training step of ``lm``, measured without the trace's code.

    ``saved``: distinct storages that autograd's saved_tensors_hooks receive during
    the forward, parameters and buffers left out (checkpointed blocks hide theirs from
    outer hooks, so this means something only without checkpointing). ``peak`` (when
    asked for; the profiler makes the step several times slower): the most memory at
    any moment of the step in torch.profiler's memory timeline, every category but
    parameters, gradients, optimizer states and the batch itself.
    """
    own = {t.untyped_storage()._cdata for t in itertools.chain(lm.parameters(), lm.buffers())}
    saved: Dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in own:
            saved[storage._cdata] = storage.nbytes()
        return t

    cast = torch.autocast("cpu", dtype=autocast) if autocast is not None else torch.autocast("cpu", enabled=False)
    profiler = nullcontext()
    if peak:  # the memory timeline needs shapes and stacks recorded
        profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True)
    with profiler as prof:
        with cast:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = lm.training_step(batch)
            measured = {"saved": sum(saved.values())}
            loss.backward()
            del loss
    if peak:
        _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
        # Column 0 of the timeline is unused; category c sits at column _CATEGORY_TO_INDEX[c] + 1.
        left_out = {_CATEGORY_TO_INDEX[c] + 1 for c in (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE, Category.INPUT)}
        measured["peak"] = int(max(sum(v for i, v in enumerate(row) if i not in left_out) for row in sizes))
    return measured
