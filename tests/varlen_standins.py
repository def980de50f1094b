"""Stand-ins for torch's varlen flash kernel, one per signature torch has shipped, that run on the CPU.

Each keeps the real kernel's contract where litft could break it: only the
keywords that release takes (Python refuses any other, as torch does), fp16/bf16
only with the kernel's own message, q/k/v of one dtype, int32 cumulative lengths,
and as many K/V heads as query heads unless ``enable_gqa`` is given. They compute
with SDPA, one causal call per sample, so a run through them trains for real.
Select one with ``LITFT_VARLEN_KERNEL=tests.varlen_standins:varlen_attn_2_11``.
"""

from typing import Optional

import torch
import torch.nn.functional as F


def _attend(query, key, value, cu_seq_q, cu_seq_k, causal: bool, scale: Optional[float], enable_gqa: bool, left: int = -1):
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if not (query.dtype == key.dtype == value.dtype):
        raise RuntimeError("query and key must have the same dtype")
    if cu_seq_q.dtype != torch.int32 or cu_seq_k.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_q must have dtype int32")
    if query.device.type != "cpu":
        raise RuntimeError("this stand-in runs on the CPU")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise RuntimeError(f"number of heads in key/value ({key.shape[1]}) must equal that of query ({query.shape[1]}) without enable_gqa")
    out = torch.empty_like(query)
    bounds = cu_seq_q.tolist()
    for start, end in zip(bounds, bounds[1:]):
        q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))
        mask = None
        if left >= 0:  # a sliding window: each query sees itself and the `left` tokens before it
            place = torch.arange(end - start)
            mask = (place[None, :] <= place[:, None]) & (place[None, :] >= place[:, None] - left)
        out[start:end] = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale, enable_gqa=enable_gqa)[0].transpose(0, 1)
    return out


def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10: causal by flag, no scale, no window, no GQA."""
    return _attend(query, key, value, cu_seq_q, cu_seq_k, is_causal, None, False)


def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
    """torch 2.11 and 2.12: a sliding window ((-1, 0) is causal) and a scale, no GQA."""
    return _attend(query, key, value, cu_seq_q, cu_seq_k, window_size[1] == 0, scale, False, window_size[0])


def varlen_attn_2_13(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False,
    seqused_k=None, block_table=None, num_splits=None,
):
    """torch 2.13: adds enable_gqa."""
    return _attend(query, key, value, cu_seq_q, cu_seq_k, window_size[1] == 0, scale, enable_gqa, window_size[0])


for _kernel in (varlen_attn_2_10, varlen_attn_2_11, varlen_attn_2_13):
    _kernel.device_type = "cpu"  # what litft reads to know where the kernel runs
STANDINS = {"2.10": varlen_attn_2_10, "2.11": varlen_attn_2_11, "2.13": varlen_attn_2_13}
