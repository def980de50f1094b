"""Validation loss and exact-match scoring by generation, over every rank."""

from typing import Callable, List, Optional

import torch

from litft.data.base import PreparedData, Prompted
from litft.data.collate import collate
from litft.data.order import eval_batches
from litft.parallel.mesh import DataPlace


@torch.no_grad()
def validate(fabric, module, data: PreparedData, micro_batch_size: int, max_batches: Optional[int], pad_id: int, padding_free: bool,
             context: DataPlace, count: Callable[[dict], int]) -> float:
    """Mean loss over the validation set (per what the objective's ``count`` counts), every sample counted once across ranks
    (each rank of a context group its slice)."""
    module.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=fabric.device)
    for n, idx in enumerate(eval_batches(len(data.val), micro_batch_size, context.data_rank, context.data_world)):
        if max_batches is not None and n >= max_batches:
            break
        # Every rank makes the same number of forward passes (wrapped forwards may communicate);
        # a rank out of samples runs sample 0 and does not count it.
        batch = context.split(collate([data.val[i] for i in (idx or [0])], pad_id, padding_free))
        if not idx:
            batch["counted"] = False  # the stand-in adds nothing to the objective's figures either
        batch = fabric.to_device(batch)
        with fabric.autocast():
            loss = module.validation_step(batch).double()
        if idx:
            totals[0] += loss
            totals[1] += count(batch)
    totals = fabric.all_reduce(totals, reduce_op="sum")
    module.train()
    return float(totals[0] / totals[1].clamp(min=1))


def score(generation, prompts: List[Prompted], tokenizer, max_new_tokens: int, per_call: int = 64) -> float:
    """Share of prompts whose greedy answer equals the reference exactly, over all ranks (litft.model.generation deals them out;
    the ranks of a tensor-parallel or context group answer the same prompts, which scales both sums alike)."""
    answers = generation.greedy([p.prompt_ids for p in prompts], max_new_tokens, per_call)
    answered = [(p, a) for p, a in zip(prompts, answers) if a is not None]
    correct = sum(tokenizer.decode(a.tokens, skip_special_tokens=True).strip() == p.reference for p, a in answered)
    fabric = generation.fabric
    totals = fabric.all_reduce(torch.tensor([correct, len(answered)], dtype=torch.float64, device=fabric.device), reduce_op="sum")
    return float(totals[0] / totals[1].clamp(min=1))
