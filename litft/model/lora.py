"""LoRA and QLoRA as a transform of the model before it is filled and sharded.

peft is imported where it is used: it imports bitsandbytes and, through it, much of torch's
compiler (seconds on every process start), which a run without LoRA never needs.
"""

import contextlib
import dataclasses
import math
import threading
import types
import warnings
from typing import Optional, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from transformers import BitsAndBytesConfig

from litft.config import QUANTIZE_CHOICES, LoraArgs
from litft.errors import LitftError
from litft.model.experts import is_experts, routers_outside_the_interface
from litft.model.recurrent import carries_state
from litft.model.vision import beside_language_model, lora_targets, sees_images


def quantization_config(quantize: Optional[str], compute_dtype: torch.dtype, config=None) -> Optional[BitsAndBytesConfig]:
    """transformers' bitsandbytes config for ``--quantize`` (4-bit base weights for QLoRA). Where Mamba mixers' fused
    kernels read ``out_proj.weight`` as a matrix, those layers stay unquantized, beside transformers' own exceptions."""
    if quantize is None:
        return None
    if quantize not in QUANTIZE_CHOICES:
        raise LitftError(f"--quantize {quantize} is unknown; choose one of {', '.join(QUANTIZE_CHOICES)}")
    kind, _, double = quantize.removeprefix("bnb.").partition("-")
    skip = None
    if config is not None and (carries_state(config) or sees_images(config)):
        from transformers.quantizers.base import get_keys_to_not_convert

        from litft.model.weights import skeleton

        model = skeleton(config, torch.float32)
        kept = (read_past_adapters(model) if carries_state(config) else []) + (beside_language_model(model) if sees_images(config) else [])
        skip = sorted(set(get_keys_to_not_convert(model)) | set(kept)) or None  # a VLM's encoder and projector stay in 16 bits
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=bool(double), bnb_4bit_compute_dtype=compute_dtype,
        llm_int8_skip_modules=skip,
    )


# Linear layers of a Mamba mixer whose weight the mixer reads as a plain matrix: mamba-ssm's fused kernels take out_proj's (and
# Mamba1's x_proj's and dt_proj's), and Mamba1's PyTorch path multiplies by dt_proj.weight itself.
READ_AS_MATRIX = ("out_proj", "x_proj", "dt_proj")


def read_past_adapters(model) -> list:
    """The Mamba mixers' layers read past any adapter or 4-bit layout (peft refuses LoRA on out_proj for Falcon-H1, Mamba,
    Mamba2 and Nemotron-H; an adapter on Mamba1's dt_proj would get no gradient at all)."""
    mixers = {name for name, module in model.named_modules() if "Mamba" in type(module).__name__ or type(module).__name__.endswith("Mixer")}
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear) and name.rpartition(".")[0] in mixers
            and name.rpartition(".")[2] in READ_AS_MATRIX]


def peft_config(lora: LoraArgs, model, adapt_encoder: bool = False):
    from peft import LoraConfig

    return LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=resolved_targets(lora, model, adapt_encoder), task_type="CAUSAL_LM",
        bias="none",
    )


def resolved_targets(lora: LoraArgs, model, adapt_encoder: bool = False):
    """``all-linear`` without what Mamba kernels read past an adapter (:func:`read_past_adapters`): peft refuses those layers
    for some of these models and would let others lose the adapter on a GPU; nor MoE routers that only look linear. A
    vision-language model's: the language model's linear layers, and the image encoder's with ``adapt_encoder``
    (litft.model.vision)."""
    # A router that subclasses nn.Linear but returns (scores, logits) (Llama 4's) is no linear layer to adapt.
    routers = {name for name, _ in routers_outside_the_interface(model)}
    left_out = (set(read_past_adapters(model)) if carries_state(model.config) else set()) | routers
    if sees_images(model.config) and (lora.targets == "all-linear" or isinstance(lora.targets, list)):
        # Short names (q_proj...) name layers of the image encoder too: they are taken in the language model, and in the
        # encoder only where it trains.
        chosen = None if lora.targets == "all-linear" else set(lora.targets)
        return [name for name in lora_targets(model, adapt_encoder) if name not in left_out
                and (chosen is None or name in chosen or name.rpartition(".")[2] in chosen)]
    if lora.targets != "all-linear" or not (carries_state(model.config) or routers):
        return lora.targets
    head = model.get_output_embeddings()
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear) and module is not head and name not in left_out]


@contextlib.contextmanager
def quiet_peft():
    """peft's advice for itself, kept off the run's screen: its all-linear patterns name the fused gate_up_proj that
    ParamWrapper targets by parameter instead, and it calls transformers' old checkpointing names."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The following (rank|alpha)_pattern keys did not match", category=RuntimeWarning)
        warnings.filterwarnings("ignore", message=".*(is_gradient_checkpointing|gradient_checkpointing_enable).*", category=FutureWarning)
        yield


def expert_lora_config(config, lora: LoraArgs):
    """peft's config for a model whose targets include MoE experts' 3-D tensors, resolved once on a meta copy and sorted.

    peft nests one ParamWrapper per expert tensor in the order of ``target_parameters``, and the adapters' names
    depend on that nesting; resolved from ``all-linear`` it is a set's order, which differs from process to process.
    Sorted, every rank, every resumed run and the exported adapter's loader nest them alike.
    """
    from peft import LoraConfig, get_peft_model

    from litft.model.weights import skeleton

    probe_model = skeleton(config, torch.float32)
    with quiet_peft():
        probe = get_peft_model(probe_model, peft_config(dataclasses.replace(lora, dropout=0.0), probe_model))
    resolved = probe.peft_config["default"]
    return LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=sorted(resolved.target_modules or []),
        target_parameters=sorted(resolved.target_parameters or []) or None, task_type="CAUSAL_LM", bias="none",
    )


def apply_lora(model, lora: LoraArgs, adapt_encoder: bool = False):
    """Freeze the model and add LoRA adapters; only they get gradients and optimizer state."""
    lora.check()
    # Not peft's prepare_model_for_kbit_training: it casts every bf16 tensor but the 4-bit ones to fp32, which only a
    # later whole-module cast undid, and none reaches ZeRO-3's partitions (a bf16-true QLoRA run attended in fp32 there).
    # Norms and embeddings keep the run's dtype like every other frozen weight; checkpointing is already on, non-reentrant,
    # so gradients reach the adapters through the frozen 4-bit layers without its input hook.
    for param in model.parameters():
        param.requires_grad_(False)
    from peft import get_peft_model

    # MoE experts stored as one 3-D tensor per layer take adapters through peft's ParamWrapper, which has no dropout:
    # adapters are added without it, then every adapter on an ordinary layer gets the dropout back.
    experts = any(is_experts(module) for module in model.modules())
    if experts and lora.writes_merged:
        raise LitftError("--export merged cannot yet fold adapters into MoE experts' 3-D tensors; use --export adapter (peft loads it onto the model)")
    try:
        with quiet_peft() if experts else contextlib.nullcontext():
            peft_model = get_peft_model(model, expert_lora_config(model.config, lora) if experts else peft_config(lora, model, adapt_encoder))
    except ValueError as err:
        raise LitftError(f"--lora_target_modules {lora.targets} does not fit this model ({str(err).splitlines()[0]})") from None
    for module in peft_model.modules() if experts else ():
        dropouts = getattr(module, "lora_dropout", None)
        if isinstance(dropouts, torch.nn.ModuleDict) and type(module).__name__ != "ParamWrapper":
            for name in dropouts:
                dropouts[name] = torch.nn.Dropout(p=lora.dropout) if lora.dropout > 0 else torch.nn.Identity()
    return add_adapters_in_one_matmul(keep_one_input_per_layer(peft_model))


DROP_LEVELS = 2**16  # on an accelerator a drop probability is taken to the nearest 1/65536; the kept inputs are scaled by the rate taken


def dropout_mask(shape, p: float, device) -> Tuple[torch.Tensor, float]:
    """Which elements dropout keeps (a bool tensor of ``shape``) and the drop probability it used, as the adapters draw
    them: on the CPU from ``dropped_positions`` (p exact), elsewhere from random words (``_dropped_by_words``)."""
    if torch.device(device).type != "cpu":
        return _dropped_by_words(shape, p, device)
    keep = torch.ones(math.prod(shape), dtype=torch.bool)
    keep[dropped_positions(keep.numel(), p)] = False
    return keep.view(shape), p


def _dropped_by_words(shape, p: float, device) -> Tuple[torch.Tensor, float]:
    """A keep mask from four elements a random 64-bit word, each 16-bit quarter one uniform draw (p to 1/65536): one
    kernel and no host synchronisation on an accelerator, where torch's Bernoulli sampling spent a float per element."""
    threshold = round(p * DROP_LEVELS)
    numel = math.prod(shape)
    words = torch.empty((numel + 3) // 4, dtype=torch.int64, device=device).random_(-(2**63), 2**63 - 1)  # every bit random
    keep = words.view(torch.int16)[:numel].view(shape) >= threshold - DROP_LEVELS // 2
    return keep, threshold / DROP_LEVELS


def dropped_positions(numel: int, p: float) -> torch.Tensor:
    """The flat positions that dropout drops among ``numel`` elements, in order, each with probability p independently.

    Drawn as the gaps between them: the number of kept elements before each drop is geometric, floor(log(U) / log(1 - p))
    for a uniform U, so about numel * p draws stand for a draw per element. U is float32 (24 random bits, a third cheaper
    to draw than float64's 53): a gap's probabilities move by at most 2^-24, and gaps past log(2^-24) / log(1 - p) (a
    chance of 6e-8 whatever p) are not drawn. From torch's generator (seeded, and saved in checkpoints as the run's RNG
    state); each adapter draws its own, as peft's dropout does.
    """
    log_kept = math.log1p(-p)
    parts, start = [], 0  # start: the first element not yet decided
    while start < numel:
        expected = (numel - start) * p
        count = int(expected + 8 * math.sqrt(expected) + 16)  # enough draws to pass the end but about once in 1e15
        gaps = torch.rand(count).neg_().log1p_().div_(log_kept).long()  # 1 - U lies in (0, 1]; the gaps >= 0: long() floors
        dropped = gaps.add_(1).cumsum_(0).add_(start - 1)
        start = int(dropped[-1]) + 1
        parts.append(dropped)
    dropped = parts[0] if len(parts) == 1 else torch.cat(parts)
    return dropped[: int(torch.searchsorted(dropped, numel))]


_SCRATCH = threading.local()  # this thread's host buffers for dropped inputs, one per dtype, as large as the largest asked


def _zeroed_at(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x`` with its flat ``positions`` (in x's logical order) set to zero, in a buffer that the next call reuses: the
    caller reads it at once and keeps nothing of it. A fresh tensor of an input's size came from newly mapped pages at
    every call, and filling them cost more than the copy itself."""
    if isinstance(x, FakeTensor):  # the estimate's trace: a buffer of its own, counted while it lives
        return x.clone(memory_format=torch.contiguous_format).view(-1).index_fill_(0, positions, 0).view(x.shape)
    numel, buffers = x.numel(), _SCRATCH.__dict__
    buffer = buffers.get(x.dtype)
    if buffer is None or buffer.numel() < numel:
        buffers[x.dtype] = buffer = torch.empty(numel, dtype=x.dtype)
    out = buffer[:numel]
    out.view(x.shape).copy_(x)
    return out.index_fill_(0, positions, 0).view(x.shape)


class _DroppedPositionsMatmul(torch.autograd.Function):
    """The CPU's ``linear(dropout(x), weight)``: the dropped positions drawn as a list (``dropped_positions``: about p of
    the elements) and zeroed in place, where a mask's select read and wrote every element three times an adapter (the
    forward, the weight's gradient, the input's gradient); the input's gradient is zeroed in place at the positions,
    the dropped input made again for the weight's gradient. Keeps x (shared by the layer's adapters), the positions (8
    bytes each: 0.4 bytes an element at p = 0.05, where the mask took 1) and the weight. Scaling as ``_DroppedInputMatmul``.
    """

    @staticmethod
    def forward(ctx, x, weight, p: float):
        if isinstance(x, FakeTensor):  # the estimate's trace: as many positions as expected, no values to draw them from
            dropped = torch.empty(round(x.numel() * p), dtype=torch.int64)
        else:
            dropped = dropped_positions(x.numel(), p)
        ctx.scale = 1.0 / (1.0 - p)
        out = torch.nn.functional.linear(_zeroed_at(x, dropped), weight).mul_(ctx.scale)
        ctx.save_for_backward(x, dropped, weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, dropped, weight = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1]) * ctx.scale
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad @ weight.to(grad.dtype)).view(-1).index_fill_(0, dropped, 0).view(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            kept = _zeroed_at(x, dropped).reshape(-1, x.shape[-1]).to(grad.dtype)
            grad_weight = (grad.t() @ kept).to(weight.dtype)
        return grad_x, grad_weight, None


def _zero_like(x: torch.Tensor):
    """where()'s zero: on the CPU a 0-dim tensor of ``x``'s dtype (a quarter faster there than the literal 0); elsewhere the
    literal, which a GPU takes as a kernel argument (a device tensor would cost a fill kernel per select)."""
    return torch.zeros((), dtype=x.dtype) if x.device.type == "cpu" else 0


class _DroppedInputMatmul(torch.autograd.Function):
    """An accelerator's ``linear(dropout(x), weight)``: keeps ``x`` and a one-byte mask for the
    backward, and scales the adapter's narrow output instead of its wide input.

    peft keeps each adapter's dropped input until the backward: q, k and v (and the MLP's projections) each hold their
    own copy of the layer's input, at the input's full width and dtype. Here they keep the input they share and a boolean
    mask each; the dropped input is made again in the backward by one select. Dropout's scaling 1 / (1 - p) is applied to
    the rank-r output and to the incoming gradient (r wide) rather than to the input (as wide as the layer): the same
    product, one rounding apart. Under autocast ``x`` comes in the run's low precision (``_input_as_it_comes``) and the
    select keeps it there: zeroing is exact in any dtype.
    """

    @staticmethod
    def forward(ctx, x, weight, p: float):
        keep, taken = _dropped_by_words(x.shape, p, x.device)
        ctx.scale = 1.0 / (1.0 - taken)
        out = torch.nn.functional.linear(torch.where(keep, x, _zero_like(x)), weight) * ctx.scale
        ctx.save_for_backward(x, keep, weight)
        ctx.dtype = out.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        x, keep, weight = ctx.saved_tensors
        grad = grad.to(ctx.dtype) * ctx.scale
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ weight.to(ctx.dtype)
            grad_x = torch.where(keep, grad_x, _zero_like(grad_x)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dropped = torch.where(keep, x, _zero_like(x)).to(ctx.dtype)
            grad_weight = (grad.reshape(-1, grad.shape[-1]).t() @ dropped.reshape(-1, x.shape[-1])).to(weight.dtype)
        return grad_x, grad_weight, None


class DroppedInputLinear(torch.nn.Linear):
    """A LoRA A matrix that applies its adapter's dropout itself (``_DroppedInputMatmul``); the same weights and names as peft's."""

    dropout_p: float = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.dropout_p > 0 and torch.is_grad_enabled()):
            return super().forward(x)
        if self.bias is None and not (isinstance(x, DTensor) or isinstance(self.weight, DTensor)):  # plain, ZeRO-3's, fake
            if x.device.type == "cpu":
                return _DroppedPositionsMatmul.apply(x, self.weight, self.dropout_p)
            return _DroppedInputMatmul.apply(x, self.weight, self.dropout_p)
        # Tensor parallel's DTensors (a row-split A takes a sharded input): torch's own dropout, which DTensor draws itself.
        return super().forward(torch.nn.functional.dropout(x, self.dropout_p, training=True))


def _input_as_it_comes(self, x, dtype):
    """peft's cast of an adapter's input to the adapter's dtype, left out under autocast.

    Under bf16-mixed the frozen base is bf16 and the adapters fp32: peft copied each LoRA layer's bf16 input to fp32,
    and autocast copied it back to bf16 for the adapter's matmul, in the forward and again for the gradient, for every
    adapter of every layer. The values are the same either way (bf16 -> fp32 -> bf16 is exact); the adapter's matmul
    now reads the input the base layer read, and keeps that one for its backward instead of a copy of its own.
    """
    if x is not None and x.dtype != dtype and torch.is_autocast_enabled(x.device.type):
        return x
    peft_cast = getattr(type(self), "_cast_input_dtype", None)  # peft 0.15 on; before, its forward cast with .to
    return peft_cast(self, x, dtype) if peft_cast is not None else x.to(dtype)


def keep_one_input_per_layer(peft_model):
    """Each adapter's dropout moved into its A matrix (``DroppedInputLinear``): in training, the adapters of a layer keep the
    input they share and a mask each instead of a copy each (ZeRO-3 LoRA on a 0.97 GB Llama: 0.79 -> 0.72 of the model
    per rank at the default dropout, as at none); under bf16-mixed each keeps its bf16 dropped input where peft kept an
    fp32 one. Under autocast the input reaches the adapters uncast (``_input_as_it_comes``)."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    for module in peft_model.modules():
        dropouts, a_matrices = getattr(module, "lora_dropout", None), getattr(module, "lora_A", None)
        if not isinstance(dropouts, torch.nn.ModuleDict) or not isinstance(a_matrices, torch.nn.ModuleDict):
            continue
        if isinstance(module, LoraLinear):  # its adapters are nn.Linear, which autocast casts; not 4-bit or expert layers
            module._cast_input_dtype = types.MethodType(_input_as_it_comes, module)
        for name, dropout in list(dropouts.items()):
            a = a_matrices[name] if name in a_matrices else None
            if isinstance(dropout, torch.nn.Dropout) and dropout.p > 0 and type(a) is torch.nn.Linear and a.bias is None:
                a.__class__ = DroppedInputLinear
                a.dropout_p = dropout.p
                dropouts[name] = torch.nn.Identity()
    return peft_model


def _base_plus_adapter(self, x, *args, **kwargs):
    """peft's LoRA Linear forward, ``base(x) + B(A(x)) * scaling``, with the second matmul adding into the base's output.

    peft writes ``B(A(x))``, scales it and adds it to the base output: three passes over an output-sized tensor in the
    forward and one more in the backward, for every adapted layer. ``addmm`` does the scaling and the sum inside the
    matmul (one rounding instead of three in low precision). The plain case only: one active adapter without a
    variant (DoRA...), a bias on B or a dropout module of its own (litft moves dropout into A), plain tensors (not
    tensor parallel's DTensors, not ZeRO-3's partitions), and dtypes that autocast makes one or that already are;
    anything else is peft's own forward.
    """
    active = self.active_adapters
    name = active[0] if len(active) == 1 else None
    plain = (
        name is not None and not args and not kwargs and not self.disable_adapters and not self.merged and name in self.lora_A
        and name not in getattr(self, "lora_variant", {}) and not getattr(self, "use_dora", {}).get(name, False)  # peft < 0.16: no variants
        and self.lora_B[name].bias is None and type(self.lora_dropout[name]) is torch.nn.Identity
        and all(type(w.data) is torch.Tensor for w in (self.base_layer.weight, self.lora_A[name].weight, self.lora_B[name].weight))
        and not hasattr(self.lora_B[name].weight, "ds_id")  # ZeRO-3 gathers B's weight only around B's own forward
    )
    if plain and not torch.is_autocast_enabled(x.device.type):
        plain = x.dtype == self.lora_A[name].weight.dtype == self.lora_B[name].weight.dtype == self.base_layer.weight.dtype
    if not plain:
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x)
    low = self.lora_A[name](_input_as_it_comes(self, x, self.lora_A[name].weight.dtype))
    if low.dtype != result.dtype:  # a base layer that returns another dtype than autocast's: peft's own sum
        return (result + self.lora_B[name](low) * self.scaling[name]).to(result.dtype)
    summed = torch.addmm(result.reshape(-1, result.shape[-1]), low.reshape(-1, low.shape[-1]), self.lora_B[name].weight.t(),
                         alpha=self.scaling[name])
    return summed.view(result.shape)  # result's dtype: the operands' own, or autocast's, which low showed result to have


def add_adapters_in_one_matmul(peft_model):
    """Every LoRA Linear layer runs ``_base_plus_adapter``: the adapter's output summed into the base's by its second matmul."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    for module in peft_model.modules():
        if isinstance(module, LoraLinear) and isinstance(module.base_layer, torch.nn.Linear):
            module.forward = types.MethodType(_base_plus_adapter, module)
    return peft_model
