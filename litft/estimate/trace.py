"""Activation memory from one training step traced on fake tensors (shapes and dtypes, no data).

Not a formula: a one- and a two-block copy of the model runs the job's own module
(its loss included) while every storage an op creates is followed until it is
freed; the difference between the two is one block's share. So attention kernels,
LoRA dropout, autocast copies and the fp32 loss are whatever this model and this
torch really do.
"""

import copy
import gc
import itertools
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import transformers.masking_utils as masking
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from litft.run.build import build_model
from litft.config import TrainArgs
from litft.model.causal_lm import CausalLM
from litft.model.offload import CountedOffload
from litft.model.recurrent import text_config
from litft.model.vision import encoder_inputs, image_features_owner
from litft.objectives import build_objective
from litft.objectives.args import ObjectiveArgs


class _Ledger(TorchDispatchMode):
    """Hands every op's outputs to its ``LiveStorages``."""

    def __init__(self, storages: "LiveStorages"):
        super().__init__()
        self.storages = storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.storages.add(t.untyped_storage(), inputs)
        return out


class LiveStorages:
    """A dispatch mode that follows every storage an op creates until it is freed (a ledger of +/- bytes)."""

    def __init__(self, known: List[torch.Tensor]):
        self.known = {t.untyped_storage()._cdata for t in known}
        self.live: Dict[int, Tuple[int, int]] = {}
        self.events: List[Tuple[int, int]] = []
        self.tokens = itertools.count()
        self.marks: Dict[str, int] = {}

    def mode(self) -> TorchDispatchMode:
        return _Ledger(self)

    def add(self, storage, inputs) -> None:
        key = storage._cdata
        if key in self.live or key in self.known or key in inputs:  # a view, or written in place
            return
        token = next(self.tokens)
        self.live[key] = (token, storage.nbytes())
        self.events.append((token, storage.nbytes()))
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        token, size = self.live.pop(key)
        self.events.append((token, -size))

    def mark(self, name: str) -> None:
        self.marks[name] = len(self.events)

    def replay(self, leave_out: set) -> Tuple[int, Dict[str, int]]:
        """Peak of the live bytes, and the live bytes at each mark, without the storages in ``leave_out``."""
        live = peak = 0
        at = {}
        for i, (token, size) in enumerate(self.events + [(None, 0)]):
            for name, position in self.marks.items():
                if position == i:
                    at[name] = live
            if token in leave_out:
                continue
            live += size
            peak = max(peak, live)
        return peak, at


class _Dequantized4bit(torch.nn.Linear):
    """Stands in for bnb's Linear4bit on fake tensors: the same dtype casts, a frozen compute-dtype weight.

    bitsandbytes saves only the packed weight for backward and dequantizes again
    there, so like ``F.linear`` on a frozen weight it adds no saved activation.
    """

    def forward(self, x):
        return torch.nn.functional.linear(x.to(self.compute_dtype), self.weight, self.bias).to(x.dtype)


def _fake_model(model, fake_mode, dtype_for):
    """Swap the meta parameters and buffers of ``model`` for fake CPU tensors (shapes and dtypes, no memory)."""
    swapped: Dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return FakeTensor(fake_mode, torch.empty(t.shape, dtype=dtype, device="meta"), torch.device("cpu"))

    for module in model.modules():
        if type(module._parameters.get("weight")).__name__ == "Params4bit":  # bnb's Linear4bit (not peft's wrapper of it)
            module.__class__ = _Dequantized4bit
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in swapped:
                    quantized = type(p).__name__ == "Params4bit"
                    dtype = module.compute_dtype if quantized else dtype_for(p)
                    swapped[id(p)] = torch.nn.Parameter(fake(p, dtype), requires_grad=p.requires_grad)
                module._parameters[name] = swapped[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = fake(b, b.dtype)
    return model


def _with_layers(config, layers: int):
    """A copy of ``config`` with ``layers`` transformer blocks (per-layer lists cut to match); a vision-language model's
    language model is cut, its image encoder kept whole."""
    config = copy.deepcopy(config)
    text = text_config(config)
    text.num_hidden_layers = layers
    for key in ("layer_types", "mlp_only_layers"):
        value = getattr(text, key, None)
        if isinstance(value, list) and len(value) > layers:
            setattr(text, key, value[:layers])
    return config


@contextmanager
def _masks_as_in_real_steps():
    """transformers takes fake tensors for graph tracing: it then builds an explicit (b, 1, s, s)
    causal mask and repeats k/v for GQA, where a real step of unpacked rows passes ``is_causal``
    to SDPA and builds neither. For the trace, only real tracing counts as tracing, and rows
    are not packed (whether they are is read from the position ids' values, which fakes lack)."""
    patches = {}
    if hasattr(masking, "is_tracing"):
        original = masking.is_tracing
        patches["is_tracing"] = lambda tensor=None: original(None)
    if hasattr(masking, "find_packed_sequence_indices"):
        patches["find_packed_sequence_indices"] = lambda position_ids: None
    saved = {name: getattr(masking, name) for name in patches}
    for name, value in patches.items():
        setattr(masking, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(masking, name, value)


@contextmanager
def _grouped_experts_traceable():
    """torch's fake grouped_mm takes bf16 alone (its CUDA fast path's rule), where the real CPU and CUDA kernels take every
    float dtype; for the trace, other dtypes take transformers' per-expert fallback, whose buffers are the same size."""
    try:
        import transformers.integrations.moe as moe
    except ImportError:
        yield
        return
    original = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda input, weight, offs: weight.dtype == torch.bfloat16 and original(input, weight, offs)
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


@dataclass
class Trace:
    """Live bytes of one training step, without parameters and gradients."""

    peak: int  # the most at any moment of forward + backward
    saved: int  # what the forward leaves for the backward (the loss computed)
    offloaded: int = 0  # host bytes under activation offload


def trace_step(config, layers: int, build: dict, params_dtype, autocast, micro_batch_size: int, seq_len: int, objective=None,
               offload: bool = False) -> Trace:
    """One forward and backward of the job's module (``model.CausalLM``, its loss included) on fake tensors; ``offload``: under
    activation offload, what stays on the device (the host's share in ``offloaded``)."""
    model = build_model(_with_layers(config, layers), **build)
    with warnings.catch_warnings():
        # torch.utils.checkpoint's advice about use_reentrant, given where peft enables checkpointing for QLoRA.
        warnings.simplefilter("ignore")
        return _trace(model, params_dtype, autocast, micro_batch_size, seq_len, objective, offload)


def _trace(model, params_dtype, autocast, micro_batch_size: int, seq_len: int, objective=None, offload: bool = False) -> Trace:
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    _fake_model(model, fake_mode, params_dtype)
    lm = CausalLM(model, TrainArgs(activation_offload=offload), build_objective(objective or ObjectiveArgs(), lora=hasattr(model, "disable_adapter")))
    lm.offload_kind = CountedOffload
    lm.train()
    tensors = list(lm.parameters()) + list(lm.buffers())
    gc.collect()
    ledger = LiveStorages(tensors)
    rows = micro_batch_size * lm.objective.rows_per_sample  # a preference micro-batch holds two sequences per pair
    with fake_mode:
        tokens = torch.zeros(rows, seq_len, dtype=torch.long)
        # Rows of one sequence each (position ids 0..n-1, as unpacked data has them; transformers then makes them itself).
        # Every token but each row's last carries loss (the index is made without reading the fake tokens); what else the
        # objective's batch holds, it adds (a pair's sequences, a reference's scores where they were computed before training).
        batch = lm.objective.fake_batch(rows, seq_len, tokens)
        cast = torch.autocast("cpu", dtype=autocast) if autocast is not None else torch.autocast("cpu", enabled=False)
        # The loop's shape: forward and backward inside one autocast region, which caches weight casts for both.
        with _masks_as_in_real_steps(), _grouped_experts_traceable(), ledger.mode(), cast:
            loss = lm.training_step(batch)
            ledger.mark("forward")
            if loss.requires_grad:  # a lone block that skips text-only rows (Mllama's cross-attention) leaves nothing to train
                loss.backward()
            del loss
    # Gradients are counted on their own row; the storages that became .grad leave the replay.
    grads = [p.grad.untyped_storage()._cdata for p in lm.parameters() if p.grad is not None]
    peak, at = ledger.replay({ledger.live[key][0] for key in grads if key in ledger.live})
    return Trace(peak=peak, saved=at["forward"], offloaded=lm.offloaded_bytes)


class _RealWithoutFakes(TorchDispatchMode):
    """Runs an op that touches no fake tensor for real: the processor's image tensors (pixels, patch grids, masks) are real,
    so the steps an encoder takes from their values (patches per image from the grid, padding images found from the pixels)
    read real values, and only what the faked weights touch is traced."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not any(isinstance(t, FakeTensor) for t in tree_leaves((args, kwargs))):
            with _disable_current_modes():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def trace_image_encoder(config, build: dict, params_dtype, autocast, processor, width: int, height: int, per_sample: int,
                        samples: int) -> Optional[Trace]:
    """A micro-batch's images through the image encoder (and the projector where ``get_image_features`` runs it) on fake
    weights: the live bytes' peak, and what its forward leaves live for the language model's forward and the backward (the
    image features, what a trained projector saves). None where the encoder runs only inside the model's forward (Mllama)."""
    model = build_model(_with_layers(config, 1), **build)
    owner = image_features_owner(model.get_base_model() if hasattr(model, "get_base_model") else model)
    if owner is None:
        return None
    inputs = encoder_inputs(owner, processor, width, height, per_sample, samples)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    _fake_model(model, fake_mode, params_dtype)
    encoder_dtype = next(p.dtype for p in owner.parameters() if p.is_floating_point())
    inputs = {k: v.to(encoder_dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    gc.collect()
    ledger = LiveStorages(list(model.parameters()) + list(model.buffers()) + list(inputs.values()))
    cast = torch.autocast("cpu", dtype=autocast) if autocast is not None else torch.autocast("cpu", enabled=False)
    with warnings.catch_warnings(), fake_mode, _RealWithoutFakes(), ledger.mode(), cast:  # the ledger above: real ops count too
        warnings.simplefilter("ignore")
        features = owner.get_image_features(**inputs)
        ledger.mark("forward")
        del features
    peak, at = ledger.replay(set())
    return Trace(peak=peak, saved=at["forward"])


@dataclass
class Activations:
    peak: int
    saved: int
    per_layer: int  # peak's growth per transformer block
    outside_layers: int  # embeddings, logits and the fp32 loss: the peak with no block
    offloaded: int = 0  # host bytes under activation offload


def trace_activations(config, build: dict, params_dtype, autocast, micro_batch_size: int, seq_len: int, objective=None,
                      offload: bool = False) -> Activations:
    """Traces with 1 and 2 blocks; their difference is one block's share, repeated to the model's depth.

    The first block is traced as it is (its input, from a frozen embedding, may need no
    gradient), and every later one is like the second.
    """
    depth = text_config(config).num_hidden_layers
    one = trace_step(config, 1, build, params_dtype, autocast, micro_batch_size, seq_len, objective, offload)
    if depth == 1:
        return Activations(one.peak, one.saved, one.peak, 0, one.offloaded)
    two = trace_step(config, 2, build, params_dtype, autocast, micro_batch_size, seq_len, objective, offload)
    per_layer_saved = two.saved - one.saved
    # Offloaded, a block adds on the device only what stays there; the two-block peak's growth is the backward's prefetch
    # overlapping one block's recompute, which more blocks do not repeat.
    per_layer = per_layer_saved if offload else two.peak - one.peak
    return Activations(
        peak=two.peak + (depth - 2) * per_layer,
        saved=two.saved + (depth - 2) * per_layer_saved,
        per_layer=per_layer,
        outside_layers=one.peak - per_layer,
        offloaded=two.offloaded + (depth - 2) * (two.offloaded - one.offloaded),
    )
