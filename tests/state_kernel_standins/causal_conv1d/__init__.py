"""Stand-in for causal-conv1d: a depthwise causal convolution whose window restarts where ``seq_idx`` changes."""

from collections import Counter
from typing import Optional

import torch
import torch.nn.functional as F

litft_device_type = "cpu"
calls = Counter()  # calls told where samples start, by function, for the tests to read


def check_seq_idx(seq_idx: torch.Tensor, batch: int, length: int) -> None:
    """What the CUDA kernels ask of seq_idx: int32, contiguous, one index per token of each row."""
    if seq_idx.dtype != torch.int32 or not seq_idx.is_contiguous() or tuple(seq_idx.shape) != (batch, length):
        raise RuntimeError(f"seq_idx must be contiguous int32 of shape {(batch, length)}, got {seq_idx.dtype} {tuple(seq_idx.shape)}")


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, seq_idx: Optional[torch.Tensor] = None,
                     initial_states=None, return_final_states: bool = False, final_states_out=None, activation: Optional[str] = None):
    """x (batch, dim, length), weight (dim, width): out[t] sums weight over x[t - width + 1 .. t] within t's own sample."""
    if initial_states is not None or return_final_states:
        raise NotImplementedError("the stand-in runs training's forward only")
    calls["causal_conv1d_fn"] += seq_idx is not None
    batch, dim, length = x.shape
    if seq_idx is not None:
        check_seq_idx(seq_idx, batch, length)
        if x.stride(1) != 1:
            raise RuntimeError("causal_conv1d with seq_idx is only supported for channel last layout")
    width = weight.shape[1]
    padded = F.pad(x.float(), (width - 1, 0))
    windows = padded.unfold(2, width, 1)  # batch, dim, length, width: window j holds x[t - width + 1 + j]
    if seq_idx is not None:
        place = torch.arange(length, device=x.device)
        source = place[:, None] - (width - 1) + torch.arange(width, device=x.device)[None, :]  # length, width
        same = torch.zeros(batch, length, width, dtype=torch.bool, device=x.device)
        inside = source >= 0
        same[:, inside] = (seq_idx[:, source.clamp(min=0)] == seq_idx[:, :, None])[:, inside]
        windows = windows * same[:, None].to(windows.dtype)
    out = (windows * weight.float()[None, :, None, :]).sum(-1)
    if bias is not None:
        out = out + bias.float()[None, :, None]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    return out.to(x.dtype)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None, conv_state_indices=None):
    raise NotImplementedError("the stand-in runs training's forward only (no decoding)")
