"""Validation loss and exact-match scoring by generation, over every rank."""

import math
from typing import Callable, List, Optional

import torch

from litft.compiling import eager_blocks
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


def stop_tokens(model, tokenizer) -> List[int]:
    """The tokenizer's EOS and the model's own end-of-turn tokens (chat models often have several)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    return sorted({t for t in [tokenizer.eos_token_id, *configured] if t is not None})


@torch.no_grad()
def score(fabric, module, prompts: List[Prompted], tokenizer, max_new_tokens: int, batch_size: int = 64, tensor: int = 1) -> float:
    """Share of prompts whose greedy answer equals the reference exactly, over all ranks.

    Under FSDP and ZeRO-3 every forward is a collective, so every rank makes the same
    generate calls and the same number of forwards in each: a rank with fewer prompts
    answers a stand-in chunk it does not count, and generation goes on (``synced_gpus``)
    until every rank's answers have ended. The ranks of a tensor-parallel group (``tensor``) answer the same prompts
    together, and count them once each.
    """
    model = module.module.model if hasattr(module, "module") else module.model
    was_training = model.training
    model.eval()
    mine = prompts[fabric.global_rank // tensor :: fabric.world_size // tensor]
    chunks = math.ceil(len(mine) / batch_size)
    if fabric.world_size > 1:
        chunks = int(fabric.all_reduce(torch.tensor(float(chunks), device=fabric.device), reduce_op="max").item())
    correct = 0
    for i in range(0, chunks * batch_size, batch_size):
        chunk = mine[i : i + batch_size] or prompts[:1]  # a stand-in, not counted
        counted = i < len(mine)
        width = max(len(p.prompt_ids) for p in chunk)
        # Left padding, so that every answer starts at the same column.
        input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, p in enumerate(chunk):
            input_ids[row, width - len(p.prompt_ids) :] = torch.tensor(p.prompt_ids)
            attention[row, width - len(p.prompt_ids) :] = 1
        with fabric.autocast(), eager_blocks():
            out = model.generate(
                input_ids=input_ids.to(fabric.device), attention_mask=attention.to(fabric.device), max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=stop_tokens(model, tokenizer),
                synced_gpus=fabric.world_size > 1,
            )
        if counted:
            for p, row in zip(chunk, out[:, width:]):
                correct += tokenizer.decode(row, skip_special_tokens=True).strip() == p.reference
    totals = fabric.all_reduce(torch.tensor([correct, len(mine)], dtype=torch.float64, device=fabric.device), reduce_op="sum")
    model.train(was_training)
    return float(totals[0] / totals[1].clamp(min=1))
