"""Context parallel (DeepSpeed-Ulysses): each sequence split over N ranks of a node, whole heads exchanged around attention.

Ranks ``g*N .. g*N+N-1`` form a context group. They take the same samples (between
them they are one data-parallel rank) and each keeps one contiguous slice of every
row's tokens, so activations per rank shrink N times. Everything but attention
works on the slice as it is: rotary from the slice's own position ids, the head and
the loss on the slice's targets. Attention needs whole rows: an all-to-all hands
each rank every token of H/N of the heads, attention runs over whole rows with the
boundaries collate computed for them (any kernel litft_segments uses), and a second
all-to-all gives each rank back its own tokens of every head.

Gradients need nothing new. Each rank's loss is the sum over its slice's target
tokens, scaled by the target count of the whole global batch, and every strategy
already averages gradients over all ranks: the sum over a group's slices is the
sum over its samples, so the step is the one a single process takes.
"""

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from litft.data.collate import cumulative_lengths

from litft.data.samples import IGNORE_INDEX
from litft.errors import LitftError
from litft.model.attention import CONTEXT_KEY
from litft.model.loading import own_mask_layers
from litft.model.recurrent import refuse_split

# The varlen key under which a sliced batch hands attention and the objectives its ContextGroup (generation's batches have none).
MARK = CONTEXT_KEY


def check_context_parallel(config, size: int) -> None:
    """One line when the model's attention heads cannot be dealt out over the group."""
    if size > 1:
        refuse_split(config, "--context_parallel")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # multimodal configs keep it apart
    chunked = own_mask_layers(config)
    if size > 1 and chunked:
        raise LitftError(f"--context_parallel exchanges heads around litft's own attention, and {text.model_type}'s {chunked} layers "
                         "attend within chunks only transformers' masks compute; drop --context_parallel")
    heads = getattr(text, "num_attention_heads", None)
    if size > 1 and heads is not None and heads % size:
        raise LitftError(
            f"--context_parallel {size} must divide the model's {heads} attention heads (each rank attends with heads / N of them); "
            f"choose a divisor of {heads}"
        )
    if size > 1:
        from litft.model.weights import per_head_tensors, skeleton

        per_head = per_head_tensors(skeleton(config, torch.float32))
        if per_head:
            raise LitftError(f"--context_parallel deals attention heads out over the group, and {text.model_type}'s per-head "
                             f"{per_head[0]} is not dealt with them yet; drop --context_parallel")


def slice_batch(batch: dict, place: int, size: int, group=None) -> dict:
    """Rows padded to a multiple of ``size`` (padding counts on from the last sample and carries no loss), then cut.

    The targets are collate's, found on the whole rows, so a slice's last token still predicts the first token of the next
    slice; none falls in the padding, which predicts nothing.
    """
    input_ids, position_ids, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    rows, width = input_ids.shape
    part = -(-width // size)
    extra = part * size - width
    if extra:
        input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(rows, extra)], dim=1)
        position_ids = torch.cat([position_ids, position_ids[:, -1:] + torch.arange(1, extra + 1, device=position_ids.device)], dim=1)
        labels = F.pad(labels, (0, extra), value=IGNORE_INDEX)
    targets = batch["targets"]
    row, column = targets["index"] // width, targets["index"] % width
    start = place * part
    mine = (column >= start) & (column < start + part)
    mine_only = slice(start, start + part)
    return {
        **batch,
        "input_ids": input_ids[:, mine_only].contiguous(), "position_ids": position_ids[:, mine_only].contiguous(),
        "labels": labels[:, mine_only].contiguous(),
        "varlen": {**cumulative_lengths(position_ids), MARK: ContextGroup(group, size)},
        "targets": {
            **{key: value[mine] for key, value in targets.items()},  # the labels, and each target's sequence for preference pairs
            "index": row[mine] * part + column[mine] - start,
        },
        "lead_slice": place == 0,  # what an objective counts once per sample (a pair), the group's first slice counts
        "slices": size,
    }


class ContextGroup:
    """What a sliced batch carries to attention and to the objectives (under ``MARK``): the context group and the exchanges
    over it, so that neither of them needs this module (attention calls ``attend_whole_rows``, preference pairs ``sum``)."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def __eq__(self, other) -> bool:
        return isinstance(other, ContextGroup) and (other.group, other.size) == (self.group, self.size)

    def live_group(self):
        if not isinstance(self.group, dist.ProcessGroup):
            raise LitftError("a context-parallel batch reached attention without its context group (litft.parallel.mesh builds it)")
        return self.group

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over the group, with its gradient: per-sequence sums of slices become whole."""
        return _GroupSum.apply(tensor, self.live_group())

    def attend_whole_rows(self, attend: Callable, query, key, value, **kwargs):
        """``attend`` (q (B, H, S, D), k and v (B, KV, S, D) -> (B, S, H, D)) on whole rows from this rank's slice of them."""
        group = self.live_group()
        size = dist.get_world_size(group)
        # K/V heads the group cannot share evenly are copied (each in place, so query head chunk j still meets its K/V in
        # chunk j), as few times as makes them divide: N / gcd(KV, N), which divides H / KV since N divides H.
        copies = size // math.gcd(key.shape[1], size)
        if copies > 1:
            key, value = key.repeat_interleave(copies, dim=1), value.repeat_interleave(copies, dim=1)
        query, key, value = (_SwapHeadsAndTokens.apply(t, 1, 2, group) for t in (query, key, value))  # (B, heads / N, whole rows, D)
        out = attend(query, key, value, **kwargs)  # (B, whole rows, heads / N, D)
        return _SwapHeadsAndTokens.apply(out, 1, 2, group)  # (B, this slice, heads, D)


class _GroupSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _swap_heads_and_tokens(tensor: torch.Tensor, scatter: int, gather: int, group) -> torch.Tensor:
    """Chunk ``i`` of dimension ``scatter`` goes to the group's rank ``i``; what rank ``i`` sends lands as chunk ``i`` of ``gather``."""
    size = dist.get_world_size(group)
    if tensor.shape[scatter] % size:
        raise LitftError(f"context parallel: {tensor.shape[scatter]} heads or tokens cannot be dealt out over {size} ranks")
    outgoing = torch.stack(tensor.chunk(size, dim=scatter)).contiguous()
    incoming = torch.empty_like(outgoing)
    dist.all_to_all_single(incoming, outgoing, group=group)
    return torch.cat(incoming.unbind(0), dim=gather)


class _SwapHeadsAndTokens(torch.autograd.Function):
    """The all-to-all with its gradient: the same exchange with the two dimensions swapped."""

    @staticmethod
    def forward(ctx, tensor, scatter: int, gather: int, group):
        ctx.dims, ctx.group = (scatter, gather), group
        return _swap_heads_and_tokens(tensor, scatter, gather, group)

    @staticmethod
    def backward(ctx, grad):
        scatter, gather = ctx.dims
        return _swap_heads_and_tokens(grad.contiguous(), gather, scatter, ctx.group), None, None, None
