"""Attention that keeps the samples of a packed row apart without an S x S mask.

A packed (or padding-free) row holds several samples end to end, each with
position ids that start at 0. transformers' own SDPA and eager paths turn such a
row into a dense block-diagonal (B, 1, S, S) mask, which costs memory, turns off
SDPA's fused causal kernels and makes it copy K and V for grouped-query attention.
``segments`` instead attends inside each sample: on the CPU one causal SDPA call
with a row per sample (padding inside attention only), and torch's varlen flash kernel over the whole row on CUDA (one call,
cumulative sequence lengths). FlashAttention-2, where installed, does the same
from the position ids by itself. Which one a run uses is chosen once
(:func:`choose`) and said in the log.
"""

import importlib.util
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from litft.data.base import cumulative_lengths
from litft.errors import LitftError

SEGMENTS = "litft_segments"
# What --attn_implementation takes; "auto" picks the fastest that keeps packed samples apart.
CHOICES = ("auto", SEGMENTS, "flash_attention_2", "sdpa", "eager")
# Implementations that keep packed samples apart without a dense mask (padding-free batches are safe with them).
PACKED_SAFE = (SEGMENTS, "flash_attention_2")

# On the CPU, samples are gathered into one padded call while that pads the attention by at most this factor.
GATHER_PADDING_LIMIT = 1.25

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None


def segments_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: Optional[float] = None, **kwargs):
    """transformers' attention interface: q (B, H, S, D), k and v (B, KV, S, D) -> (B, S, H, D), attending inside samples.

    A padding mask (generation of left-padded prompts) or a KV cache goes to transformers' SDPA path as it is.
    """
    if attention_mask is not None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
        cu = cumulative_lengths(position_ids.expand(query.shape[0], -1).cpu())["cu_seq_lens_q"]  # transformers' default ids are (1, S)
    gqa = query.shape[1] != key.shape[1]
    dropout = dropout if module.training else 0.0
    batch, heads, width, dim = query.shape
    if query.is_cuda and varlen_attn is not None and dropout == 0.0:
        # Every sample of the batch in one call: tokens flattened, samples found by their cumulative lengths.
        flat = lambda t: t.transpose(1, 2).reshape(batch * width, t.shape[1], dim)  # noqa: E731
        longest = kwargs.get("max_length_q") or int(torch.diff(cu).max())
        cu = cu.to(query.device, torch.int32)
        out = varlen_attn(flat(query), flat(key), flat(value), cu, cu, longest, longest, scale=scaling, window_size=(-1, 0), enable_gqa=gqa)
        return out.reshape(batch, width, heads, dim), None
    cu = cu.to(torch.long)
    lengths = torch.diff(cu)
    longest = int(lengths.max())
    if len(lengths) * longest <= GATHER_PADDING_LIMIT * int(cu[-1]):
        # Samples of similar length: one causal SDPA call, each gathered into a row of its own, padded at its end
        # with copies of its last token. Causality keeps real queries off that padding; what padding queries
        # produce is dropped. Only attention sees the padding; every other layer stays padding-free.
        place = torch.arange(longest)
        index = cu[:-1, None] + torch.minimum(place[None, :], lengths[:, None] - 1)  # samples, longest
        real = place[None, :] < lengths[:, None]
        q, k, v = (t.transpose(0, 1).reshape(t.shape[1], batch * width, dim)[:, index].transpose(0, 1) for t in (query, key, value))
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
        out = query.new_zeros(heads, batch * width, dim)  # tokens outside every sample (a row's tail) stay zero
        out[:, index[real]] = attended.transpose(0, 1)[:, real]
    else:
        # Lengths far apart: padding them to the longest would cost more than a call per sample.
        bounds = cu.tolist()
        q, k, v = (t.transpose(0, 1).reshape(t.shape[1], 1, batch * width, dim) for t in (query, key, value))  # heads, 1, tokens, dim
        out = query.new_zeros(heads, 1, batch * width, dim)
        for start, end in zip(bounds, bounds[1:]):
            out[:, :, start:end] = F.scaled_dot_product_attention(
                q[None, :, 0, start:end], k[None, :, 0, start:end], v[None, :, 0, start:end],
                dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa,
            )[0][:, None]
    return out.reshape(heads, batch, width, dim).permute(1, 2, 0, 3).contiguous(), None


def segments_mask(*args, attention_mask=None, **kwargs):
    """No mask for rows of whole samples (the attention keeps them apart); SDPA's mask where padding needs one."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(SEGMENTS, segments_attention)
AttentionMaskInterface.register(SEGMENTS, segments_mask)


def choose(requested: str, accelerator: str) -> str:
    """The attention implementation a run uses: the user's, or the fastest here that keeps packed samples apart."""
    if requested not in CHOICES:
        raise LitftError(f"--attn_implementation {requested} is unknown; choose one of {', '.join(CHOICES)}")
    if requested == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise LitftError("--attn_implementation flash_attention_2 needs the flash-attn package (pip install flash-attn); use auto")
    if requested != "auto":
        return requested
    if accelerator == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return SEGMENTS


def describe(implementation: str, accelerator: str) -> str:
    """One line for the log: what attends, and how packed samples are kept apart."""
    if implementation == SEGMENTS:
        how = "torch's varlen flash kernel" if accelerator == "cuda" and varlen_attn is not None else "one causal SDPA call, a row per sample"
        return f"attention: {SEGMENTS} ({how}; samples of a row kept apart without a mask)"
    if implementation == "flash_attention_2":
        return "attention: flash_attention_2 (varlen from the position ids; samples of a row kept apart without a mask)"
    return f"attention: {implementation} (padded batches; packed rows need a dense block-diagonal mask)"


def choose_kernels(requested: str, accelerator: str) -> bool:
    """Whether Liger's fused Triton kernels (RMSNorm, RoPE, SwiGLU) replace the model's own: ``--kernels``."""
    installed = importlib.util.find_spec("liger_kernel") is not None
    if requested == "liger" and not installed:
        raise LitftError("--kernels liger needs liger-kernel: pip install 'litft[kernels]' (or drop --kernels)")
    if requested == "liger" and accelerator != "cuda":
        raise LitftError("--kernels liger runs Triton kernels on a GPU; on the CPU use --kernels none")
    return requested == "liger" or (requested == "auto" and installed and accelerator == "cuda")
