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

import contextlib
import sys
import threading
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers import masking_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from litft.model import varlen
from litft.data.collate import cumulative_lengths
from litft.errors import LitftError
from litft.model.varlen import segments_path

SEGMENTS = "litft_segments"
# A batch split over a context group carries, under this varlen key, the object that attends over its whole rows.
CONTEXT_KEY = "litft_context"
# What --attn_implementation takes; "auto" picks the fastest that keeps packed samples apart.
CHOICES = ("auto", SEGMENTS, "flash_attention_2", "sdpa", "eager")
# Implementations that keep packed samples apart without a dense mask (padding-free batches are safe with them).
PACKED_SAFE = (SEGMENTS, "flash_attention_2")

# On the CPU, samples are gathered into one padded call while that pads the attention by at most this factor.
GATHER_PADDING_LIMIT = 1.25



class AttentionRecord:
    """What attention actually ran in this process: path and dtypes, once per kind (read by litft env --check and the tests).

    A set, added to only when a kind is new: torch.compile guards on what a traced function reads, so a counter
    bumped on every call would fail its guard on every call and recompile each block until dynamo gives up.
    """

    def __init__(self):
        self.seen: set = set()

    def note(self, path: str, received: torch.dtype, computed: torch.dtype) -> None:
        if torch.compiler.is_compiling():  # a compiled block would guard on the set and compile again once the key is in it
            return
        key = (path, str(received).removeprefix("torch."), str(computed).removeprefix("torch."))
        if key not in self.seen:
            self.seen.add(key)

    def clear(self) -> None:
        self.seen.clear()

    def paths(self) -> set:
        return {path for path, _, _ in self.seen}

    def computed(self) -> set:
        return {dtype for _, _, dtype in self.seen}

    def received(self) -> set:
        return {dtype for _, dtype, _ in self.seen}


RECORD = AttentionRecord()


def compute_dtype_of(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in: autocast's where it is on (q and k leave rotary in fp32 there, v does not), else the query's."""
    device = query.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype


def segments_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: Optional[float] = None, **kwargs):
    """transformers' attention interface: q (B, H, S, D), k and v (B, KV, S, D) -> (B, S, H, D), attending inside samples.

    A padding mask (generation of left-padded prompts) or a KV cache goes to transformers' SDPA path as it is. A batch
    split over a context group carries, under ``CONTEXT_KEY``, the group's exchange (litft.parallel.context.ContextGroup),
    which attends over its whole rows with heads dealt out over the group.
    """
    exchange = kwargs.get(CONTEXT_KEY)
    if exchange is not None:
        if attention_mask is not None:  # each rank would attend inside its own slice only
            raise LitftError("--context_parallel needs a model whose attention takes no mask for packed rows (transformers' masking_utils)")

        def whole_rows(q, k, v, **rest):
            return _attend_in_samples(module, q, k, v, None, dropout, scaling, **rest)[0]

        # One dtype before the exchange: q and k leave rotary in fp32 under autocast, and would travel at twice the bytes.
        dtype = compute_dtype_of(query, key, value)
        return exchange.attend_whole_rows(whole_rows, *(t.to(dtype) for t in (query, key, value)), **kwargs), None
    return _attend_in_samples(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def model_eager_attention(module) -> Callable:
    """The eager attention function of the module's own modeling file: the reference for what SDPA and the kernels lack."""
    function = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if function is None:
        raise LitftError(
            f"{type(module).__name__} asks for attention logit softcapping or sinks, and its modeling file has no eager_attention_forward "
            "for litft to compute them with; use --attn_implementation eager"
        )
    return function


def _beyond_sdpa(module, kwargs) -> bool:
    """Whether this layer's attention needs more than a causal (windowed) softmax: logit softcapping or attention sinks."""
    if kwargs.get("position_bias") is not None:
        raise LitftError(f"{type(module).__name__} adds a position bias to its attention scores, which {SEGMENTS} does not apply; "
                         "use --attn_implementation sdpa")
    return (kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None
            or isinstance(getattr(module, "sinks", None), torch.Tensor))


def layer_window(module, kwargs) -> Optional[int]:
    """The layer's sliding window: as the model passes it, else from its config where transformers applies it through the
    mask alone (Qwen2-MoE's and PhiMoE's layers are windowed by their mask, not by an argument)."""
    if kwargs.get("sliding_window") is not None:
        return kwargs["sliding_window"]
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and index is not None:
        return window if types[index] == "sliding_attention" else None
    return window if getattr(config, "use_sliding_window", True) else None


class _GroupsOf:
    """The attention module as its eager function sees it, with the query heads per K/V head of the tensors at hand
    (context parallel deals heads out and may copy K/V heads, so the module's own count no longer holds)."""

    def __init__(self, module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def _seen(q_len: int, k_len: int, window: Optional[int], device) -> torch.Tensor:
    """Which keys each query attends: causal, aligned to the end (a KV cache), within the window where there is one."""
    seen = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)
    if window is not None:
        seen &= ~torch.ones_like(seen).tril(k_len - q_len - window)
    return seen


def _additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive one eager attention functions take."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, torch.finfo(dtype).min)


def _eager_in_samples(module, query, key, value, bounds, window: Optional[int], dropout: float, scaling, kwargs):
    """The model's own eager attention (softcapping, sinks: exact for whatever it computes) inside each sample."""
    eager = model_eager_attention(module)
    batch, heads, width, dim = query.shape
    if getattr(module, "num_key_value_groups", None) != heads // key.shape[1]:
        module = _GroupsOf(module, heads // key.shape[1])
    tokens = batch * width
    flat = [t.transpose(0, 1).reshape(t.shape[1], tokens, dim) for t in (query, key, value)]  # heads, tokens, dim
    out = query.new_zeros(tokens, heads, dim)
    for start, end in zip(bounds, bounds[1:]):
        q, k, v = (t[None, :, start:end] for t in flat)
        mask = _additive(_seen(end - start, end - start, window, query.device), query.dtype)[None, None]
        out[start:end] = eager(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)[0][0]
    return out.reshape(batch, width, heads, dim), None


def _eager_with_mask(module, query, key, value, attention_mask, dropout: float, scaling, kwargs):
    """The model's eager attention under transformers' own (boolean SDPA) mask: generation of padded prompts, a KV cache."""
    if attention_mask is None:  # no mask given: causal, aligned to the end for a cache
        attention_mask = _seen(query.shape[2], key.shape[2], layer_window(module, kwargs), query.device)[None, None]
    if attention_mask.dtype == torch.bool:
        attention_mask = _additive(attention_mask, query.dtype)
    return model_eager_attention(module)(module, query, key, value, attention_mask, dropout=dropout if module.training else 0.0,
                                         scaling=scaling, **kwargs)


def _attend_in_samples(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: Optional[float] = None, **kwargs):
    window = layer_window(module, kwargs)
    beyond = _beyond_sdpa(module, kwargs)
    if attention_mask is not None or query.shape[2] != key.shape[2]:
        if beyond or (attention_mask is None and window is not None):
            return _eager_with_mask(module, query, key, value, attention_mask, dropout, scaling, kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    cu = kwargs.get("cu_seq_lens_q", kwargs.get("litft_cu"))  # litft_cu: rows of one sequence each (litft.model.recurrent)
    bounds = kwargs.get("litft_bounds")
    if cu is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:  # every row one sample
            bounds = tuple(range(0, query.shape[0] * query.shape[2] + 1, query.shape[2]))
            cu = torch.tensor(bounds, dtype=torch.int32)
        else:
            cu = cumulative_lengths(position_ids.expand(query.shape[0], -1).cpu())["cu_seq_lens_q"]  # transformers' default ids are (1, S)
    received = query.dtype
    dtype = compute_dtype_of(query, key, value)
    # One dtype for all three: under autocast q and k come out of rotary in fp32 while v is already low precision.
    query, key, value = (t.to(dtype) for t in (query, key, value))
    gqa = query.shape[1] != key.shape[1]
    dropout = dropout if module.training else 0.0
    batch, heads, width, dim = query.shape
    # Collate computed the longest sample on the host; reading it here would stall the GPU once per layer.
    longest = kwargs.get("max_length_q") or kwargs.get("litft_longest") or int(torch.diff(cu).max())
    if window is not None and window >= longest:
        window = None  # no sample is longer than the window: plain causal attention is the same
    if beyond:
        # Softcapping or sinks: no fused kernel here computes them, so the model's own definition runs, a sample at a time.
        RECORD.note("eager", received, dtype)
        return _eager_in_samples(module, query, key, value, bounds or tuple(cu.tolist()), window, dropout, scaling, kwargs)
    kernel = varlen.VARLEN
    if (kernel is not None and dropout == 0.0 and kernel.runs(query.device.type, dtype, scaling, dim)
            and (window is None or kernel.takes_window)):
        # Every sample of the batch in one call: tokens flattened, samples found by their cumulative lengths.
        RECORD.note("varlen", received, dtype)
        flat = lambda t: t.transpose(1, 2).reshape(batch * width, t.shape[1], dim)  # noqa: E731
        out = kernel(flat(query), flat(key), flat(value), cu.to(query.device, torch.int32), longest, scaling, window)
        return out.reshape(batch, width, heads, dim), None
    # A window the kernel cannot take goes to SDPA with a windowed mask, a sample at a time (the gathered call is causal only).
    RECORD.note("sdpa" if window is None else "windowed sdpa", received, dtype)
    return _sdpa_in_samples(query, key, value, cu, bounds, longest, window, dropout, scaling, gqa), None


def _sdpa_in_samples(query, key, value, cu, bounds, longest: int, window: Optional[int], dropout: float, scaling, gqa: bool):
    """SDPA on the samples of packed rows: one causal call on samples gathered into rows where their lengths are close, else
    a call per sample (with a windowed mask where the layer has a window)."""
    batch, heads, width, dim = query.shape
    cu = cu.to(query.device, torch.long)
    lengths = torch.diff(cu)
    tokens = batch * width
    if window is None and len(lengths) * longest <= GATHER_PADDING_LIMIT * tokens:
        # Samples of similar length: one causal SDPA call, each gathered into a row of its own, padded at its end
        # with copies of its last token. Causality keeps real queries off that padding; what padding queries
        # produce is never read back. Only attention sees the padding; every other layer stays padding-free.
        place = torch.arange(longest, device=cu.device)
        index = cu[:-1, None] + torch.minimum(place[None, :], lengths[:, None] - 1)  # samples, longest
        q, k, v = (t.transpose(0, 1).reshape(t.shape[1], tokens, dim)[:, index].transpose(0, 1) for t in (query, key, value))
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
        # Each token read back from its sample's row (a gather: no boolean mask, so nothing waits on the device).
        token = torch.arange(tokens, device=cu.device)
        sample = torch.searchsorted(cu[1:], token, right=True)
        inside = sample < len(lengths)  # tokens after the last sample (a row's tail) stay zero
        sample = sample.clamp(max=len(lengths) - 1)
        picked = attended[sample, :, (token - cu[sample]).clamp(0, longest - 1)]  # tokens, heads, dim
        out = torch.where(inside[:, None, None], picked, 0).permute(1, 0, 2)
    else:
        # Lengths far apart (padding them to the longest would cost more than a call per sample), or a window.
        bounds = bounds or cu.tolist()
        q, k, v = (t.transpose(0, 1).reshape(t.shape[1], 1, tokens, dim) for t in (query, key, value))  # heads, 1, tokens, dim
        out = query.new_zeros(heads, 1, tokens, dim)
        for start, end in zip(bounds, bounds[1:]):
            mask = None if window is None else _seen(end - start, end - start, window, query.device)
            out[:, :, start:end] = F.scaled_dot_product_attention(
                q[None, :, 0, start:end], k[None, :, 0, start:end], v[None, :, 0, start:end],
                attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling, enable_gqa=gqa,
            )[0][:, None]
    return out.reshape(heads, batch, width, dim).permute(1, 2, 0, 3).contiguous()


def segments_mask(*args, attention_mask=None, **kwargs):
    """No mask for rows of whole samples (the attention keeps them apart); SDPA's mask where padding needs one."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(SEGMENTS, segments_attention)
AttentionMaskInterface.register(SEGMENTS, segments_mask)

# transformers looks for packed rows in the position ids of every forward without a mask, and its check reads a value
# back from the device: on a GPU, a stall at the start of every micro-batch. Where litft's collate already found the
# samples and the attention keeps them apart itself, the block-diagonal mask that check leads to is never built, so the
# check is skipped (only inside ``packed_rows_known``; every other forward scans as transformers does).
_PACKED = threading.local()
_SCAN_POSITIONS = getattr(masking_utils, "find_packed_sequence_indices", None)


def _scan_unless_known(position_ids):
    return None if getattr(_PACKED, "known", False) else _SCAN_POSITIONS(position_ids)


if _SCAN_POSITIONS is not None:
    masking_utils.find_packed_sequence_indices = _scan_unless_known


@contextlib.contextmanager
def packed_rows_known():
    """Forwards inside it give the attention the samples' bounds (litft_segments, flash_attention_2): no scan of the positions."""
    previous, _PACKED.known = getattr(_PACKED, "known", False), True
    try:
        yield
    finally:
        _PACKED.known = previous


def describe(implementation: str, device_type: str, precision: str) -> str:
    """One line for the log: what attends, in which kernel and why, and how packed samples are kept apart."""
    if implementation == SEGMENTS:
        path, why = segments_path(device_type, precision)
        how = "torch's varlen flash kernel" if path == "varlen" else "SDPA, one causal call with a row per sample"
        return f"attention: {SEGMENTS} with {how} ({why}); samples of a row kept apart without a mask"
    if implementation == "flash_attention_2":
        return "attention: flash_attention_2 (varlen from the position ids; samples of a row kept apart without a mask)"
    return f"attention: {implementation} (padded batches, a row per sequence: packed rows would need a dense block-diagonal mask)"
