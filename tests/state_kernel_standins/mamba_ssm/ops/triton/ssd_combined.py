"""Mamba2's state-space scan as mamba-ssm computes it, one token at a time, its state zeroed where ``seq_idx`` changes."""

from typing import Optional

import torch
import torch.nn.functional as F

from causal_conv1d import causal_conv1d_fn, check_seq_idx
from mamba_ssm import calls


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                              cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
                              return_varlen_states=False):
    """x (b, l, h, p), dt (b, l, h), A (h), B and C (b, l, g, n): y[t] = C[t] . state[t] + D x[t], with
    state[t] = exp(dt[t] A) state[t - 1] + dt[t] B[t] x[t], restarting from zero at each new sample."""
    if initial_states is not None or return_final_states or return_varlen_states or cu_seqlens is not None:
        raise NotImplementedError("the stand-in runs training's forward only")
    calls["mamba_chunk_scan_combined"] += seq_idx is not None
    batch, length, heads, dim = x.shape
    if seq_idx is not None:
        check_seq_idx(seq_idx, batch, length)
    groups = B.shape[2]
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    B = B.float().repeat_interleave(heads // groups, dim=2)
    C = C.float().repeat_interleave(heads // groups, dim=2)
    xf = x.float()
    state = torch.zeros(batch, heads, dim, B.shape[-1], device=x.device)
    out = []
    for t in range(length):
        if seq_idx is not None and t > 0:
            state = state * (seq_idx[:, t] == seq_idx[:, t - 1]).float()[:, None, None, None]
        decay = torch.exp(dt[:, t] * A.float())[:, :, None, None]
        state = state * decay + (dt[:, t, :, None] * xf[:, t])[..., None] * B[:, t, :, None, :]
        out.append((state * C[:, t, :, None, :]).sum(-1))
    y = torch.stack(out, dim=1)
    if D is not None:
        y = y + xf * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None, seq_idx=None,
                                     dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim: Optional[int] = None,
                                     ngroups=1, norm_before_gate=True):
    """The fused Mamba2 mixer after its input projection: convolution, scan, gated RMSNorm by group, output projection."""
    calls["mamba_split_conv1d_scan_combined"] += seq_idx is not None
    if seq_idx is not None:
        check_seq_idx(seq_idx, *zxbcdt.shape[:2])
    heads = D.shape[0]
    headdim = headdim if D.dim() == 1 else D.shape[1]
    width = heads * headdim
    state = (conv1d_weight.shape[0] - width) // ngroups // 2
    extra = (zxbcdt.shape[-1] - 2 * width - 2 * ngroups * state - heads) // 2
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * extra, width, width + 2 * ngroups * state, heads], dim=-1)
    xBC = causal_conv1d_fn(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx,
                           activation=activation if activation in ("silu", "swish") else None).transpose(1, 2)
    x, B, C = torch.split(xBC, [width, ngroups * state, ngroups * state], dim=-1)
    batch, length = x.shape[:2]
    y = mamba_chunk_scan_combined(x.reshape(batch, length, heads, headdim), dt, A, B.reshape(batch, length, ngroups, state),
                                  C.reshape(batch, length, ngroups, state), chunk_size, D=D, dt_bias=dt_bias, seq_idx=seq_idx,
                                  dt_softplus=True, dt_limit=dt_limit).float().reshape(batch, length, width)
    if rmsnorm_weight is None:
        y = y * F.silu(z.float())
    else:
        gate = F.silu(z.float())
        y = y if norm_before_gate else y * gate
        grouped = y.reshape(batch, length, ngroups, width // ngroups)
        y = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + rmsnorm_eps)).reshape(batch, length, width)
        y = y * rmsnorm_weight.float()
        y = y * gate if norm_before_gate else y
    if extra:
        z0, x0 = zx0.float().chunk(2, dim=-1)
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)
    y = y.to(zxbcdt.dtype)
    if outproj_weight is None:
        return y
    if torch.is_autocast_enabled():
        dtype = torch.get_autocast_dtype("cuda" if y.is_cuda else "cpu")
        y, outproj_weight = y.to(dtype), outproj_weight.to(dtype)
        outproj_bias = None if outproj_bias is None else outproj_bias.to(dtype)
    return F.linear(y, outproj_weight, outproj_bias)
