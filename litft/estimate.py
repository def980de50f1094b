"""``litft estimate``: GPU and CPU memory of one rank of a training run, from the model's config alone.

A run that does not fit is found out after the model has loaded, the processes
have met and the first step has run; on a queued cluster that is hours. The
estimate builds the same model the job builds (``skeleton``, the bitsandbytes
replacement transformers does, ``apply_lora``) on the meta device, so trained and
frozen parameters, 4-bit layers and FSDP units are counted exactly, and applies
each strategy's layout to them the way ``strategy.model_state_bytes`` measures it
in real runs. Activations are not taken from a formula: a one- and a two-block
copy of the model runs one training step on fake tensors (shapes and dtypes, no
data), while every storage an op creates is followed until it is freed; the
difference between the two is one block's share. So attention kernels, LoRA
dropout, autocast copies and the fp32 loss are whatever this model and this
torch really do.
"""

import copy
import gc
import itertools
import json as jsonlib
import math
import warnings
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Literal, Optional, Tuple, Union

import torch

from litft.args import DeepSpeedArgs, FSDPArgs, TrainArgs
from litft.errors import LitftError
from litft.strategy import Precision, Strategy

GiB = 2**30
# Memory as torch.cuda reports total_memory, in GiB (a little under the marketed size).
GPUS = {
    "H100": 79.2, "H100-80GB": 79.2, "H100-94GB": 93.1, "H200": 139.8, "GH200": 94.5, "B200": 178.4,
    "A100": 79.3, "A100-80GB": 79.3, "A100-40GB": 39.6, "L40S": 44.5, "L40": 44.5, "L4": 22.0, "A10G": 22.0, "A10": 22.0,
    "V100": 31.7, "V100-32GB": 31.7, "V100-16GB": 15.8, "T4": 14.6, "RTX4090": 23.6, "RTX3090": 23.6, "MI300X": 191.5,
}
NO_BF16 = ("V100", "T4")
# The CUDA context with cuBLAS workspaces (about 0.5 GiB with lazy module loading),
# and NCCL's communicators and channel buffers once there is more than one rank.
CUDA_CONTEXT = 0.5 * GiB
NCCL_BUFFERS = 0.5 * GiB
# DeepSpeed's own defaults (deepspeed.runtime.zero.config), used when the config leaves them out.
DS_DEFAULTS = {"reduce_bucket_size": 5e8, "prefetch_bucket_size": 5e7, "param_persistence_threshold": 1e5, "max_live_parameters": 1e9}
BNB_BLOCKSIZE = 64  # bitsandbytes' 4-bit block: one absmax per 64 weights
BNB_NESTED_BLOCKSIZE = 256  # double quantization: one fp32 scale per 256 absmax bytes


# ---------------------------------------------------------------- the model's tensors


@dataclass
class Param:
    """One parameter as this estimate needs it; ``itemsize`` is 0.5 for a packed 4-bit weight."""

    name: str
    shape: Tuple[int, ...]
    itemsize: float
    trainable: bool
    unit: str  # the FSDP unit holding it: "block.<i>", "embeddings", "head" or "root"
    quantized: bool = False
    quant_state: int = 0  # bytes of absmax (and nested quantization) beside a 4-bit weight

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return math.ceil(self.numel * self.itemsize)


def quant_state_bytes(numel: int, nested: bool) -> int:
    """bitsandbytes' QuantState beside a 4-bit weight: absmax per block, the 16-entry code, and the nested state."""
    blocks = math.ceil(numel / BNB_BLOCKSIZE)
    if not nested:
        return 4 * blocks + 16 * 4
    return blocks + 4 * math.ceil(blocks / BNB_NESTED_BLOCKSIZE) + 256 * 4 + 4 + 16 * 4


def build_model(config, precision: str, quantize: Optional[str], lora: Optional[dict], gradient_checkpointing: bool):
    """The job's model on the meta device, built the way ``jobs.run.build_module`` builds it."""
    with warnings.catch_warnings():
        # transformers 5 renamed gradient checkpointing; the jobs call the old name, and so does this.
        warnings.simplefilter("ignore", FutureWarning)
        return _build(config, precision, quantize, lora, gradient_checkpointing)


def _build(config, precision: str, quantize: Optional[str], lora: Optional[dict], gradient_checkpointing: bool):
    from litft.lora import apply_lora, quantization_config
    from litft.strategy import compute_dtype, param_dtype
    from litft.weights import skeleton

    model = skeleton(config, param_dtype(precision))
    if quantize is not None:
        from transformers.quantizers import AutoHfQuantizer

        # transformers' own choice of which Linear layers load in 4 bits (not the output head).
        quantizer = AutoHfQuantizer.from_config(quantization_config(quantize, compute_dtype(precision)), pre_quantized=False)
        quantizer.preprocess_model(model, device_map=None)
        # What loading the weights would set; peft and prepare_model_for_kbit_training read it.
        model.is_loaded_in_4bit = True
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None:
        model = apply_lora(model, **lora, quantized=quantize is not None, gradient_checkpointing=gradient_checkpointing)
    return model


def model_tensors(model, quantize: Optional[str]) -> List[Param]:
    """Every parameter once (tied ones once), with the FSDP unit ``FSDP2Strategy`` puts it in."""
    from litft.weights import transformer_blocks

    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    unit_of: Dict[int, str] = {}
    for i, block in enumerate(transformer_blocks(hf_model)):
        for p in block.parameters():
            unit_of[id(p)] = f"block.{i}"
    embeddings, head = hf_model.get_input_embeddings(), hf_model.get_output_embeddings()
    if head is not None and head.weight is not embeddings.weight:
        unit_of.update({id(p): "embeddings" for p in embeddings.parameters()})
        unit_of.update({id(p): "head" for p in head.parameters()})
    nested = quantize is not None and quantize.endswith("-dq")
    tensors = []
    for name, p in model.named_parameters():
        quantized = type(p).__name__ == "Params4bit"
        tensors.append(
            Param(
                name=name, shape=tuple(p.shape), itemsize=0.5 if quantized else p.element_size(), trainable=p.requires_grad,
                unit=unit_of.get(id(p), "root"), quantized=quantized,
                quant_state=quant_state_bytes(p.numel(), nested) if quantized else 0,
            )
        )
    return tensors


# ---------------------------------------------------------------- what each strategy keeps on the fullest rank


@dataclass
class Row:
    """One line of the table: bytes on the GPU and in CPU memory, and what they are."""

    gpu: float = 0
    cpu: float = 0
    note: str = ""

    def moved_to_cpu(self, note: str) -> "Row":
        return Row(0, self.gpu + self.cpu, note)


@dataclass
class States:
    params: Row
    grads: Row
    optimizer: Row
    buffers: List[Tuple[str, Row]] = field(default_factory=list)
    step: Row = field(default_factory=Row)  # temporaries of the optimizer step, when activations are gone


def fsdp_local(t: Param, shard: int) -> int:
    """Elements of ``t`` on rank 0 of its shard group: FSDP2 chunks dim 0 and rank 0 gets the first (largest) chunk."""
    if shard == 1 or t.quantized:  # 4-bit weights are ignored by FSDP and stay whole
        return t.numel
    rows = t.shape[0] if t.shape else 1
    return min(rows, math.ceil(rows / shard)) * (t.numel // max(rows, 1))


def _resolve(strategy: str, world: int) -> str:
    return ("single" if world == 1 else "ddp") if strategy == "auto" else strategy


def single_or_ddp_states(tensors: List[Param], ddp: bool) -> States:
    trained = [t for t in tensors if t.trainable]
    grads = sum(t.nbytes for t in trained)
    states = States(
        params=Row(sum(t.nbytes + t.quant_state for t in tensors)),
        grads=Row(grads),
        # torch's AdamW keeps exp_avg and exp_avg_sq in each parameter's dtype, and a 4-byte step per tensor.
        optimizer=Row(2 * grads + 4 * len(trained), note="AdamW exp_avg + exp_avg_sq"),
        step=Row(0, note="fused AdamW updates in place"),
    )
    if ddp:
        # DDP copies gradients into flat buckets for the all-reduce (gradient_as_bucket_view is off).
        states.buffers.append(("DDP gradient buckets", Row(grads)))
    return states


def fsdp_states(tensors: List[Param], fsdp: FSDPArgs, shard: int, precision: str) -> States:
    from litft.strategy import compute_dtype

    mixed = precision.endswith("-mixed")
    low = torch.tensor([], dtype=compute_dtype(precision)).element_size()
    trained = [t for t in tensors if t.trainable]
    local = {t.name: fsdp_local(t, shard) for t in tensors}
    grads = sum(local[t.name] * t.itemsize for t in trained)
    params = Row(sum(local[t.name] * t.itemsize + t.quant_state for t in tensors), note=f"shards of 1/{shard}" if shard > 1 else "")
    optimizer = Row(2 * grads + 4 * len(trained), note="AdamW exp_avg + exp_avg_sq of the shards")
    states = States(params=params, grads=Row(grads), optimizer=optimizer, step=Row(0, note="fused AdamW updates in place"))
    if fsdp.cpu_offload:
        states.params = params.moved_to_cpu("sharded, offloaded to CPU")
        states.grads = states.grads.moved_to_cpu("sharded, offloaded to CPU")
        states.optimizer = optimizer.moved_to_cpu("AdamW steps on the CPU")
        states.step = states.step.moved_to_cpu("")
    # All-gathered (unsharded) parameters, in the compute dtype under mixed precision.
    units: Dict[str, float] = {}
    trained_units: Dict[str, float] = {}
    for t in tensors:
        if t.quantized:
            continue
        units[t.unit] = units.get(t.unit, 0) + t.numel * (low if mixed else t.itemsize)
        if t.trainable:
            trained_units[t.unit] = trained_units.get(t.unit, 0) + t.numel
    root = units.pop("root", 0)
    if fsdp.sharding_strategy == "SHARD_GRAD_OP":
        gathered, how = root + sum(units.values()), "every unit stays gathered from forward to backward"
    else:
        # Units run in order (embeddings, blocks, head); the one in use and the next, prefetched, are
        # gathered together. The root is never resharded between forward and backward.
        blocks = sorted((u for u in units if u.startswith("block.")), key=lambda u: int(u.split(".")[1]))
        order = [units[u] for u in ("embeddings", *blocks, "head") if u in units]
        pairs = [a + b for a, b in zip(order, order[1:])] or order
        gathered, how = root + max(pairs, default=0), "root + the unit in use + the next, prefetched"
    states.buffers.append(("FSDP all-gathered parameters", Row(gathered, note=how)))
    reduce_bytes = 4 if mixed else low
    biggest = max(trained_units.values(), default=0)
    states.buffers.append(("FSDP reduce-scatter", Row(biggest * (low + reduce_bytes), note="one unit's unsharded gradients")))
    return states


def _zero_setting(zero: dict, name: str) -> float:
    """A ZeRO size from the config, under its name or its stage3_ alias; DeepSpeed's default when absent or "auto"."""
    for key in (name, f"stage3_{name}"):
        if zero.get(key, "auto") != "auto":
            return float(zero[key])
    return DS_DEFAULTS[name]


def deepspeed_states(tensors: List[Param], zero: dict, world: int, precision: str) -> States:
    """ZeRO's layout: bit16 (or fp32) parameters, an fp32 master partition, Adam on the master, flat buckets."""
    stage = int(zero.get("stage", 0))
    half = precision.startswith(("bf16", "16"))  # DeepSpeed then casts the whole module
    model_bytes = 2 if half else 4

    def stored(t: Param) -> float:
        return t.itemsize if t.quantized else model_bytes

    def part(numel: int) -> int:
        return math.ceil(numel / world)

    trained = [t for t in tensors if t.trainable]
    total_trained = sum(t.numel for t in trained)
    if stage == 3:  # every parameter is partitioned on its own
        params = sum(part(t.numel) * stored(t) + t.quant_state for t in tensors)
        partition = sum(part(t.numel) for t in trained)
    else:
        params = sum(t.numel * stored(t) + t.quant_state for t in tensors)
        partition = part(total_trained)
    states = States(params=Row(params, note=f"partitions of 1/{world}" if stage == 3 else ""), grads=Row(), optimizer=Row())
    if stage == 0:
        states.grads = Row(total_trained * model_bytes)
        if half:  # DeepSpeed's FP16_Optimizer: an fp32 master copy of the whole model, Adam on it
            states.optimizer = Row(12 * total_trained + 4, note="fp32 master + AdamW exp_avg + exp_avg_sq")
            states.step = Row(4 * total_trained, note="fp32 copy of the gradients")
        else:
            states.optimizer = Row(8 * total_trained + 4 * len(trained), note="AdamW exp_avg + exp_avg_sq")
            states.step = Row(0, note="fused AdamW updates in place")
    else:
        # Stage 1 keeps every gradient until the boundary's reduction; 2 and 3 keep their partition.
        states.grads = Row((total_trained if stage == 1 else partition) * model_bytes, note="" if stage == 1 else f"partition of 1/{world}")
        states.optimizer = Row(12 * partition + 4, note=f"fp32 master + AdamW exp_avg + exp_avg_sq, 1/{world}")
        states.step = Row(4 * partition * (2 if half else 1), note="AdamW temporaries on the fp32 partition")
    offload_optimizer = (zero.get("offload_optimizer") or {}).get("device")
    offload_param = (zero.get("offload_param") or {}).get("device")
    if offload_optimizer in ("cpu", "nvme"):
        where = "CPU" if offload_optimizer == "cpu" else "NVMe"
        moved = Row(0, states.optimizer.gpu if offload_optimizer == "cpu" else 0, f"offloaded to {where}")
        states.optimizer = moved
        # The reduced fp32 partition of the gradients lives beside it; the step runs on the CPU.
        states.grads = Row(0, 4 * partition if offload_optimizer == "cpu" else 0, f"fp32 partition, on {where}")
        states.step = Row(0, states.step.gpu if offload_optimizer == "cpu" else 0)
    if offload_param in ("cpu", "nvme"):
        where = "CPU" if offload_param == "cpu" else "NVMe"
        states.params = Row(0, params if offload_param == "cpu" else 0, f"partitions offloaded to {where}")
    if stage >= 1:
        bucket = _zero_setting(zero, "reduce_bucket_size")
        double = stage < 3 and zero.get("overlap_comm") is True
        if zero.get("contiguous_gradients", True):
            note = f"{bucket:.0e} elements" + (" x 2 (overlap_comm)" if double else "")
            states.buffers.append(("DeepSpeed reduce bucket", Row(bucket * model_bytes * (2 if double else 1), note=note)))
    if stage == 3:
        blocks: Dict[str, int] = {}
        for t in tensors:
            blocks[t.unit] = blocks.get(t.unit, 0) + t.numel
        prefetch, live = _zero_setting(zero, "prefetch_bucket_size"), _zero_setting(zero, "max_live_parameters")
        gathered = min(live, 2 * max(blocks.values(), default=0) + prefetch) * model_bytes
        threshold = _zero_setting(zero, "param_persistence_threshold")
        persistent = sum(t.numel * stored(t) for t in tensors if t.numel < threshold)
        note = "2 blocks + prefetch bucket + small persistent ones"
        states.buffers.append(("ZeRO-3 gathered parameters", Row(gathered + persistent, note=note)))
    return states


def per_rank_states(tensors: List[Param], layout, precision: str, zero: Optional[dict]) -> States:
    """Parameters, gradients and optimizer states on the fullest rank, as ``strategy.model_state_bytes`` counts them."""
    kind = _resolve(layout.strategy, layout.world_size)
    if kind == "fsdp":
        return fsdp_states(tensors, layout.fsdp, layout.fsdp_mesh_shape()[1], precision)
    if kind == "deepspeed":
        return deepspeed_states(tensors, zero, layout.world_size, precision)
    return single_or_ddp_states(tensors, ddp=kind == "ddp")


# ---------------------------------------------------------------- activations, traced on fake tensors


class LiveStorages:
    """A dispatch mode that follows every storage an op creates until it is freed (a ledger of +/- bytes)."""

    def __init__(self, known: List[torch.Tensor]):
        self.known = {t.untyped_storage()._cdata for t in known}
        self.live: Dict[int, Tuple[int, int]] = {}
        self.events: List[Tuple[int, int]] = []
        self.tokens = itertools.count()
        self.marks: Dict[str, int] = {}

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        ledger = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        ledger.add(t.untyped_storage(), inputs)
                return out

        return Mode()

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
    from torch._subclasses.fake_tensor import FakeTensor

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
    """A copy of ``config`` with ``layers`` transformer blocks (per-layer lists cut to match)."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    for key in ("layer_types", "mlp_only_layers"):
        value = getattr(config, key, None)
        if isinstance(value, list) and len(value) > layers:
            setattr(config, key, value[:layers])
    return config


@contextmanager
def _masks_as_in_real_steps():
    """transformers takes fake tensors for graph tracing: it then builds an explicit (b, 1, s, s)
    causal mask and repeats k/v for GQA, where a real step of unpacked rows passes ``is_causal``
    to SDPA and builds neither. For the trace, only real tracing counts as tracing, and rows
    are not packed (whether they are is read from the position ids' values, which fakes lack)."""
    try:
        import transformers.masking_utils as masking
    except ImportError:
        masking = None
    patches = {}
    if masking is not None and hasattr(masking, "is_tracing"):
        original = masking.is_tracing
        patches["is_tracing"] = lambda tensor=None: original(None)
    if masking is not None and hasattr(masking, "find_packed_sequence_indices"):
        patches["find_packed_sequence_indices"] = lambda position_ids: None
    saved = {name: getattr(masking, name) for name in patches}
    for name, value in patches.items():
        setattr(masking, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(masking, name, value)


@dataclass
class Trace:
    """Live bytes of one training step, without parameters and gradients."""

    peak: int  # the most at any moment of forward + backward
    saved: int  # what the forward leaves for the backward (the loss computed)


def trace_step(config, layers: int, build: dict, params_dtype, autocast, micro_batch_size: int, seq_len: int) -> Trace:
    """One forward and backward of the job's module (``model.CausalLM``, its loss included) on fake tensors."""
    model = build_model(_with_layers(config, layers), **build)
    with warnings.catch_warnings():
        # torch.utils.checkpoint's advice about use_reentrant, given where peft enables checkpointing for QLoRA.
        warnings.simplefilter("ignore")
        return _trace(model, params_dtype, autocast, micro_batch_size, seq_len)


def _trace(model, params_dtype, autocast, micro_batch_size: int, seq_len: int) -> Trace:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from litft.model import CausalLM

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    _fake_model(model, fake_mode, params_dtype)
    lm = CausalLM(model, TrainArgs())
    lm.train()
    tensors = list(lm.parameters()) + list(lm.buffers())
    gc.collect()
    ledger = LiveStorages(tensors)
    with fake_mode:
        tokens = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
        # Rows of one sequence each (position ids 0..n-1, as unpacked data has them; transformers then makes them itself).
        batch = {"input_ids": tokens, "labels": tokens, "position_ids": None}
        cast = torch.autocast("cpu", dtype=autocast) if autocast is not None else torch.autocast("cpu", enabled=False)
        # The loop's shape: forward and backward inside one autocast region, which caches weight casts for both.
        with _masks_as_in_real_steps(), ledger.mode(), cast:
            loss = lm.training_step(batch)
            ledger.mark("forward")
            loss.backward()
            del loss
    # Gradients are counted on their own row; the storages that became .grad leave the replay.
    grads = [p.grad.untyped_storage()._cdata for p in lm.parameters() if p.grad is not None]
    peak, at = ledger.replay({ledger.live[key][0] for key in grads if key in ledger.live})
    return Trace(peak=peak, saved=at["forward"])


@dataclass
class Activations:
    peak: int
    saved: int
    per_layer: int  # peak's growth per transformer block
    outside_layers: int  # embeddings, logits and the fp32 loss: the peak with no block


def trace_activations(config, build: dict, params_dtype, autocast, micro_batch_size: int, seq_len: int) -> Activations:
    """Traces with 1 and 2 blocks; their difference is one block's share, repeated to the model's depth.

    The first block is traced as it is (its input, from a frozen embedding, may need no
    gradient), and every later one is like the second.
    """
    depth = config.num_hidden_layers
    one = trace_step(config, 1, build, params_dtype, autocast, micro_batch_size, seq_len)
    if depth == 1:
        return Activations(one.peak, one.saved, one.peak, 0)
    two = trace_step(config, 2, build, params_dtype, autocast, micro_batch_size, seq_len)
    per_layer, per_layer_saved = two.peak - one.peak, two.saved - one.saved
    return Activations(
        peak=two.peak + (depth - 2) * per_layer,
        saved=two.saved + (depth - 2) * per_layer_saved,
        per_layer=per_layer,
        outside_layers=one.peak - per_layer,
    )


def compute_view(kind: str, precision: str, zero: Optional[dict]):
    """The dtype each parameter has during forward, and autocast's dtype: what the strategy and precision make of them."""
    from litft.strategy import compute_dtype

    low = compute_dtype(precision)
    if kind == "deepspeed" and precision.startswith(("bf16", "16")):
        return (lambda p: low), None  # DeepSpeed casts the module; Fabric adds no autocast
    if kind == "fsdp" and precision.endswith("-mixed"):
        return (lambda p: low), None  # FSDP2's MixedPrecisionPolicy gathers parameters in the compute dtype
    autocast = low if precision.endswith("-mixed") else None
    return (lambda p: p.dtype), autocast


# ---------------------------------------------------------------- the command


def estimate(
    model: str,
    job: Literal["finetune_lora", "finetune_full", "pretrain"] = "finetune_lora",
    precision: Optional[Precision] = None,
    devices: int = 1,
    num_nodes: int = 1,
    strategy: Strategy = "auto",
    fsdp: FSDPArgs = FSDPArgs(),
    deepspeed: DeepSpeedArgs = DeepSpeedArgs(),
    quantize: Optional[Literal["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq"]] = None,
    lora_r: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.05,
    lora_target_modules: Union[str, List[str]] = "all-linear",
    train: TrainArgs = TrainArgs(micro_batch_size=1),
    seq_len: int = 2048,
    gpu: str = "H100",
    device_memory_gb: Optional[float] = None,
    headroom: float = 0.1,
    attention: Optional[Literal["sdpa", "eager"]] = None,
    json: bool = False,
) -> dict:
    """Estimate the GPU and CPU memory one rank of a training run needs, from the model's config alone.

    Args:
        model: Hugging Face hub id, or a folder (or config.json) with the model's config; no weights are read.
        job: What trains: finetune_lora (adapters on a frozen base), finetune_full or pretrain (every weight).
        precision: 32-true, bf16-mixed, bf16-true or 16-mixed (default: bf16-mixed, or 16-mixed on GPUs without bf16).
        devices: Processes (GPUs) per node.
        num_nodes: Nodes taking part.
        strategy: auto (one device, or DDP for several), ddp, fsdp or deepspeed, as for the jobs.
        fsdp: Sharding options for --strategy fsdp.
        deepspeed: ZeRO stage, offload and config file for --strategy deepspeed.
        quantize: QLoRA's 4-bit base (finetune_lora only).
        lora_r: Rank of the adapters.
        lora_alpha: Adapter scale numerator.
        lora_dropout: Dropout on the adapters' input (it keeps a copy of their input for backward).
        lora_target_modules: Module names to adapt, or "all-linear".
        train: Only micro_batch_size and gradient_checkpointing change memory (accumulation does not).
        seq_len: Tokens in each sample of a micro-batch (the data's max_seq_length, or the packed row length).
        gpu: The device, by name: H100, H200, A100, A100-40GB, L40S, L4, A10G, ... (memory as torch.cuda reports it).
        device_memory_gb: Memory of one device in GiB; overrides --gpu.
        headroom: Share of device memory to leave free for the allocator's fragmentation and what is not counted.
        attention: Attention kernel to estimate for (default: what transformers picks for the model, as the jobs do).
        json: Print the estimate as JSON instead of a table.
    """
    plan = plan_memory(dict(locals()))
    print(jsonlib.dumps(plan, indent=2) if json else render(plan))
    return plan


def memory_plan(**flags) -> dict:
    """The estimate as data, for code: the same keywords and defaults as ``litft estimate``'s flags."""
    import inspect

    bound = inspect.signature(estimate).bind(**flags)
    bound.apply_defaults()
    return plan_memory(dict(bound.arguments))


def check_estimate_flags(flags: dict, precision: str):
    """The jobs' own checks (``check_flags``, ``Parallelism.check``), so an impossible run is refused with their words."""
    from litft.args import EvalArgs
    from litft.jobs.run import LoraSpec, Run, check_flags, layout_of

    train, world = flags["train"], flags["devices"] * flags["num_nodes"]
    if flags["seq_len"] < 1:
        raise LitftError("--seq_len must be at least 1")
    if not 0 <= flags["headroom"] < 1:
        raise LitftError(f"--headroom is a share of device memory between 0 and 1, got {flags['headroom']}")
    lora = None
    if flags["job"] == "finetune_lora":
        lora = LoraSpec(flags["lora_r"], flags["lora_alpha"], flags["lora_dropout"], flags["lora_target_modules"])
    run = Run(
        job=flags["job"], model=flags["model"], data=None, out_dir=Path("."), precision=precision, devices=flags["devices"],
        num_nodes=flags["num_nodes"], strategy=flags["strategy"], accelerator="cuda", seed=0, overwrite=False,
        # Accumulation does not change memory; any global batch the world divides will do for the check.
        train=replace(train, global_batch_size=max(train.micro_batch_size, 1) * max(world, 1)), eval=EvalArgs(),
        fsdp=flags["fsdp"], deepspeed=flags["deepspeed"], lora=lora, quantize=flags["quantize"],
    )
    check_flags(run)
    layout = layout_of(run)
    layout.check("cuda", precision)
    return layout


def device_memory(gpu: str, memory_gb: Optional[float]) -> Tuple[str, float]:
    if memory_gb is not None:
        if memory_gb <= 0:
            raise LitftError(f"--device_memory_gb must be positive, got {memory_gb}")
        return f"{memory_gb:g} GiB device", memory_gb * GiB
    names = {name.upper().replace(" ", "").replace("_", "-"): name for name in GPUS}
    key = gpu.upper().replace(" ", "").replace("_", "-")
    if key not in names:
        raise LitftError(f"--gpu {gpu} is unknown; choose one of {', '.join(GPUS)} or give --device_memory_gb")
    return names[key], GPUS[names[key]] * GiB


def plan_memory(flags: dict) -> dict:
    """Everything ``litft estimate`` prints, as a dict of bytes."""
    from litft.jobs.run import quiet_libraries
    from litft.model import load_config, resolve_model
    from litft.strategy import deepspeed_config

    gpu_name, capacity = device_memory(flags["gpu"], flags["device_memory_gb"])
    precision = flags["precision"] or ("16-mixed" if gpu_name.upper().startswith(NO_BF16) else "bf16-mixed")
    layout = check_estimate_flags(flags, precision)
    train: TrainArgs = flags["train"]
    kind = _resolve(layout.strategy, layout.world_size)
    zero = None
    if kind == "deepspeed":
        one_step = replace(train, global_batch_size=train.micro_batch_size * layout.world_size)
        zero = deepspeed_config(layout.deepspeed, one_step, layout.world_size, precision)["zero_optimization"]

    quiet_libraries()
    source = flags["model"]
    if source.endswith(".json") and Path(source).is_file():
        source = str(Path(source).parent)
    config = load_config(resolve_model(source))
    if flags["attention"] is not None:
        config._attn_implementation = flags["attention"]
    lora = None
    if flags["job"] == "finetune_lora":
        lora = {key: flags[f"lora_{key}"] for key in ("r", "alpha", "dropout", "target_modules")}
    build = dict(precision=precision, quantize=flags["quantize"], lora=lora)
    tensors = model_tensors(build_model(config, **build, gradient_checkpointing=False), flags["quantize"])
    states = per_rank_states(tensors, layout, precision, zero)

    params_dtype, autocast = compute_view(kind, precision, zero)
    traced = {}
    for checkpointing in (train.gradient_checkpointing, not train.gradient_checkpointing):
        traced[checkpointing] = trace_activations(
            config, {**build, "gradient_checkpointing": checkpointing}, params_dtype, autocast, train.micro_batch_size, flags["seq_len"]
        )
    acts = traced[train.gradient_checkpointing]
    buffers = list(states.buffers)
    if flags["quantize"] is not None:
        from litft.strategy import compute_dtype

        biggest = max((t.numel for t in tensors if t.quantized), default=0)
        low = torch.tensor([], dtype=compute_dtype(precision)).element_size()
        buffers.append(("bnb dequantized weight", Row(biggest * low, note="the largest 4-bit layer, during its matmul")))
    context = CUDA_CONTEXT + (NCCL_BUFFERS if layout.world_size > 1 else 0)

    gpu_fixed = states.params.gpu + states.grads.gpu + states.optimizer.gpu + context
    gpu_buffers = sum(row.gpu for _, row in buffers)
    gpu_total = gpu_fixed + max(acts.peak + gpu_buffers, states.step.gpu)
    other = traced[not train.gradient_checkpointing]
    gpu_total_other = gpu_fixed + max(other.peak + gpu_buffers, states.step.gpu)
    cpu_total = states.params.cpu + states.grads.cpu + states.optimizer.cpu + sum(row.cpu for _, row in buffers) + states.step.cpu
    usable = capacity * (1 - flags["headroom"])
    trained = sum(t.numel for t in tensors if t.trainable)

    def row(r: Row) -> dict:
        return {"gpu": int(r.gpu), "cpu": int(r.cpu), "note": r.note}

    names = {"single": "one device", "ddp": "DDP", "fsdp": f"FSDP {layout.fsdp.sharding_strategy}"}
    return {
        "model": flags["model"],
        "job": flags["job"],
        "strategy": names.get(kind) or f"DeepSpeed ZeRO-{int(zero.get('stage', 0))}",
        "world_size": layout.world_size,
        "shard_group": layout.fsdp_mesh_shape()[1] if kind == "fsdp" else None,
        "zero_stage": int(zero.get("stage", 0)) if zero else None,
        "precision": precision,
        "quantize": flags["quantize"],
        "micro_batch_size": train.micro_batch_size,
        "seq_len": flags["seq_len"],
        "gradient_checkpointing": train.gradient_checkpointing,
        "attention": config._attn_implementation,
        "parameters": {
            "total": sum(t.numel for t in tensors), "trained": trained, "quantized": sum(t.numel for t in tensors if t.quantized),
        },
        "per_rank": {
            "params": row(states.params),
            "grads": row(states.grads),
            "optimizer": row(states.optimizer),
            "activations": {"gpu": acts.peak, "cpu": 0, "note": ""},
            "buffers": {name: row(r) for name, r in buffers},
            "cuda_context": {"gpu": int(context), "cpu": 0, "note": "CUDA context" + (" + NCCL" if layout.world_size > 1 else "")},
            "optimizer_step": row(states.step),
        },
        "quant_state_bytes": sum(t.quant_state for t in tensors),
        "activations": {
            "peak": acts.peak,
            "saved": acts.saved,
            "per_layer": acts.per_layer,
            "outside_layers": acts.outside_layers,
            "with_checkpointing": traced[True].peak,
            "without_checkpointing": traced[False].peak,
        },
        "total": {"gpu": int(gpu_total), "cpu": int(cpu_total)},
        # The same run with activation checkpointing switched the other way.
        "total_other_checkpointing": {"gradient_checkpointing": not train.gradient_checkpointing, "gpu": int(gpu_total_other)},
        "device": {"name": gpu_name, "memory": int(capacity), "usable": int(usable), "headroom": flags["headroom"]},
        "fits": gpu_total <= usable,
    }


def _gib(n: float) -> str:
    return f"{n / GiB:8.2f}"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def render(plan: dict) -> str:
    """The estimate as a table, in GiB per rank."""
    rank = plan["per_rank"]
    p = plan["parameters"]
    what = {"finetune_lora": "LoRA", "finetune_full": "full finetune", "pretrain": "pretrain"}[plan["job"]]
    if plan["quantize"]:
        what += f" on a {plan['quantize']} base"
    layout = plan["strategy"]
    if plan["shard_group"] is not None:
        one_group = plan["strategy"].endswith("HYBRID_SHARD") and plan["shard_group"] == plan["world_size"]
        layout += f" (one shard group of {plan['shard_group']}: FULL_SHARD)" if one_group else f" (shard group {plan['shard_group']})"
    acts = plan["activations"]
    lines = [
        f"litft estimate: {plan['model']}, {what}, {layout}, world size {plan['world_size']}, {plan['precision']}",
        f"{_count(p['total'])} parameters, {_count(p['trained'])} trained; "
        f"micro batch {plan['micro_batch_size']} x {plan['seq_len']} tokens, "
        f"activation checkpointing {'on' if plan['gradient_checkpointing'] else 'off'}, {plan['attention']} attention",
        "",
        f"{'per rank (the fullest), GiB':<34}{'GPU':>8}  {'CPU':>8}",
    ]

    def line(label: str, item: dict, note: str = "") -> None:
        note = note or item.get("note", "")
        lines.append(f"{label:<34}{_gib(item['gpu'])}  {_gib(item['cpu'])}  {note}".rstrip())

    line("parameters", rank["params"])
    line("gradients", rank["grads"])
    line("optimizer states", rank["optimizer"])
    other = acts["without_checkpointing"] if plan["gradient_checkpointing"] else acts["with_checkpointing"]
    line(
        "activations (peak)", rank["activations"],
        f"{acts['per_layer'] / GiB:.2f} per layer + {acts['outside_layers'] / GiB:.2f} logits/loss; "
        f"{other / GiB:.2f} {'without' if plan['gradient_checkpointing'] else 'with'} checkpointing",
    )
    for name, item in rank["buffers"].items():
        line(name, item)
    line("CUDA context", rank["cuda_context"])
    step = rank["optimizer_step"]
    if step["gpu"] or step["cpu"]:
        line("optimizer step (temporary)", step, "while activations are freed: counted as max(step, activations + buffers)")
    total = plan["total"]
    lines.append("-" * 54)
    lines.append(f"{'peak':<34}{_gib(total['gpu'])}  {_gib(total['cpu'])}")
    device = plan["device"]
    spare = device["usable"] - total["gpu"]
    verdict = f"fits, {spare / GiB:.1f} GiB to spare" if plan["fits"] else f"does NOT fit, {-spare / GiB:.1f} GiB short"
    lines.append(
        f"{device['name']}: {device['memory'] / GiB:.1f} GiB, {device['usable'] / GiB:.1f} usable with "
        f"{device['headroom']:.0%} headroom -> {verdict}"
    )
    other = plan["total_other_checkpointing"]
    if not plan["fits"] and other["gpu"] < total["gpu"]:
        fits = "fits" if other["gpu"] <= device["usable"] else "still does not fit"
        flag = str(other["gradient_checkpointing"]).lower()
        lines.append(f"with --train.gradient_checkpointing {flag}: {other['gpu'] / GiB:.2f} GiB, {fits}")
    return "\n".join(lines)


# ---------------------------------------------------------------- measuring a real step, to check the estimate


def measure_step(lm, batch: dict, autocast: Optional[torch.dtype] = None, peak: bool = True) -> Dict[str, int]:
    """Activation bytes of one real training step of ``lm``, measured without the trace's code.

    ``saved``: distinct storages that autograd's saved_tensors_hooks receive during
    the forward, parameters and buffers left out (checkpointed blocks hide theirs from
    outer hooks, so this means something only without checkpointing). ``peak`` (when
    asked for; the profiler makes the step several times slower): the most memory at
    any moment of the step in torch.profiler's memory timeline, every category but
    parameters, gradients, optimizer states and the batch itself.
    """
    from torch.profiler import ProfilerActivity, profile

    own = {t.untyped_storage()._cdata for t in itertools.chain(lm.parameters(), lm.buffers())}
    saved: Dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in own:
            saved[storage._cdata] = storage.nbytes()
        return t

    cast = torch.autocast("cpu", dtype=autocast) if autocast is not None else torch.autocast("cpu", enabled=False)
    profiler = nullcontext()
    if peak:  # the memory timeline needs shapes and stacks recorded
        profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True)
    with profiler as prof:
        with cast:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = lm.training_step(batch)
            measured = {"saved": sum(saved.values())}
            loss.backward()
            del loss
    if peak:
        from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, Category, MemoryProfileTimeline

        _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
        # Column 0 of the timeline is unused; category c sits at column _CATEGORY_TO_INDEX[c] + 1.
        left_out = {_CATEGORY_TO_INDEX[c] + 1 for c in (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE, Category.INPUT)}
        measured["peak"] = int(max(sum(v for i, v in enumerate(row) if i not in left_out) for row in sizes))
    return measured
