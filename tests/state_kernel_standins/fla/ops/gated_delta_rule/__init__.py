"""The gated delta rule as fla computes it, one token at a time, its state zeroed at each sample ``cu_seqlens`` starts."""

import torch

from fla import calls


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                           use_qk_l2norm_in_kernel=False, **_):
    """q, k (b, t, hk, dk), v (b, t, hv, dv), g and beta (b, t, hv): S = S exp(g) + k (beta (v - S^T k))^T, o = S^T q."""
    if initial_state is not None or output_final_state:
        raise NotImplementedError("the stand-in runs training's forward only")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError("The batch size is expected to be 1 rather than {} when using `cu_seqlens`".format(q.shape[0]))
    calls["chunk_gated_delta_rule"] += cu_seqlens is not None
    heads = v.shape[2]
    q, k = (t.float().repeat_interleave(heads // t.shape[2], dim=2) for t in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    starts = set() if cu_seqlens is None else set(cu_seqlens.tolist())
    state = torch.zeros(q.shape[0], heads, q.shape[-1], v.shape[-1], device=q.device)
    out = []
    for t in range(q.shape[1]):
        if t in starts:
            state = torch.zeros_like(state)
        state = state * g[:, t].float().exp()[..., None, None]
        remembered = (state * k[:, t, :, :, None]).sum(-2)
        delta = (v[:, t].float() - remembered) * beta[:, t].float()[..., None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append((state * q[:, t, :, :, None]).sum(-2))
    return torch.stack(out, dim=1).to(v.dtype), None


fused_recurrent_gated_delta_rule = chunk_gated_delta_rule
