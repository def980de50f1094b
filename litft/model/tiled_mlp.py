"""Tiled MLP: each dense MLP runs over the sequence in chunks, each chunk recomputed in the backward.

At long sequences a block's largest activation is its MLP's intermediate (three tensors of tokens x intermediate_size
for a gated MLP, about 3.5x the hidden states each). A dense MLP treats every token alone, so it can run on a chunk of
tokens at a time: with each chunk checkpointed, the forward keeps only the chunk's input (a view of the block's) and
the backward recomputes one chunk's intermediate at a time. Chunks hold as many tokens as the model's hidden size, as
ALST (Arctic Long Sequence Training) chose: a chunk's intermediate is then about the size of one MLP weight.

A mixture of experts is left whole (its router's balancing loss and capacity read all tokens at once), and so is a
block without a dense MLP. The result equals the untiled MLP's up to float rounding (the weights' gradients are summed
chunk by chunk), except where a chunk draws or scales on its own: LoRA dropout's masks come from another stream of the
same generator, and FP8's per-tensor scales are each chunk's. Under ZeRO-3 each chunk gathers the MLP's weights again.
"""

import functools
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from litft.errors import LitftError

MLP_NAMES = ("mlp", "feed_forward")


def dense_mlp(block: torch.nn.Module):
    """The block's per-token MLP, or None (no MLP by these names, or a mixture of experts)."""
    for name in MLP_NAMES:
        mlp = getattr(block, name, None)
        if isinstance(mlp, torch.nn.Module):
            mixture = any("expert" in child.lower() or "router" in child.lower() for child, _ in mlp.named_modules())
            kind = type(mlp).__name__.lower()  # Qwen3MoeSparseMoeBlock, Llama4TextMoe; not Qwen3MoeMLP, a MoE model's dense MLP
            sparse = "sparse" in kind or kind.endswith("moe") or "expert" in kind
            return None if mixture or sparse else mlp
    return None


def tile_mlps(blocks, chunk_tokens: int) -> int:
    """Run each block's dense MLP in chunks of ``chunk_tokens`` tokens; the number of MLPs tiled."""
    tiled = 0
    for block in blocks:
        mlp = dense_mlp(block)
        if mlp is None or getattr(mlp, "litft_tiled", False):
            continue
        # A dropout draws from the RNG (a module's, or LoRA's moved into its A matrix: litft.model.lora.DroppedInputLinear).
        dropout = any((isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p) or getattr(m, "dropout_p", 0) > 0 for m in mlp.modules())
        mlp.forward = functools.partial(_tiled, mlp.forward, chunk_tokens, dropout)
        mlp.litft_tiled = True
        tiled += 1
    return tiled


def _tiled(forward: Callable, chunk_tokens: int, keeps_rng: bool, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if x.dim() < 2 or args or kwargs:
        return forward(x, *args, **kwargs)
    # The rows of a padded batch end to end, one row of tokens: each chunk is then contiguous (a slice of a padded batch
    # would not be, and a copy of it, made by activation offload, could take another kernel path in the recompute).
    tokens = x.reshape(1, -1, x.shape[-1])
    chunks = tokens.split(chunk_tokens, dim=1)
    if torch.is_grad_enabled():
        # RNG state is kept for the recompute only where a dropout (LoRA's) draws from it.
        outs = [checkpoint(forward, chunk, use_reentrant=False, preserve_rng_state=keeps_rng) for chunk in chunks]
    else:
        outs = [forward(chunk) for chunk in chunks]
    if not isinstance(outs[0], torch.Tensor):
        raise LitftError(f"--train.tiled_mlp: this MLP returns {type(outs[0]).__name__}, not a tensor; drop --train.tiled_mlp")
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.reshape(*x.shape[:-1], out.shape[-1])
