"""The model a run trains, built by one function for the jobs and for ``litft estimate``.

Every model is built on the meta device (no memory), LoRA is applied there, and it
gets real values only later, one unit at a time (``weights.Materializer``), as the
strategy asks. A 4-bit base is the exception: bitsandbytes quantizes while
loading, so a job loads it for real onto its device, unless its strategy
quantizes a unit at a time as it fills (ZeRO-3); the estimate, and that strategy,
put the same 4-bit layers in place without weights.
"""

import dataclasses
from typing import Callable, Optional, Tuple, Union

import torch

from transformers.quantizers import AutoHfQuantizer

from litft.model.compiling import compile_blocks
from litft.config import LoraArgs, TrainArgs
from litft.device import compute_dtype, param_dtype
from litft.model.experts import use_grouped_experts
from litft.model.fp8 import convert as convert_to_fp8
from litft.model.kernels import use_liger_kernels
from litft.model.lora import apply_lora, quantization_config, quiet_peft
from litft.model.loss import fuse_target_loss
from litft.model.recurrent import text_config
from litft.model.tiled_mlp import tile_mlps
from litft.model.vision import freeze_encoder, sees_images
from litft.objectives import Objective, next_token
from litft.run.plan import RunPlan
from litft.model.causal_lm import CausalLM
from litft.model.loading import keep_4bit_training_layout, load_causal_lm, load_config
from litft.parallel.expert import compute_expert_lora
from litft.parallel.strategies.base import Fill, TrainingStrategy
from litft.model.weights import (
    AdapterInit, Materializer, language_model_blocks, locate_checkpoint, skeleton, transformer_blocks,
)
from litft.model.hub_layout import model_layout_weights


def build_model(
    config, precision: str, lora: Optional[LoraArgs], gradient_checkpointing: bool, *, source: Optional[str] = None, device=None,
    attention: Optional[str] = None, structure: Callable = skeleton, liger: bool = False, dtype: Optional[torch.dtype] = None,
    frozen_dtype: Optional[torch.dtype] = None, fp8: Optional[str] = None, fp8_all_gather: bool = False, tiled_mlp: bool = False,
    vision_encoder: str = "frozen",
):
    """The job's model: its structure (on the meta device, or as the strategy builds it), LoRA applied.

    A 4-bit base (``lora.quantize``) is loaded for real from ``source`` onto
    ``device`` when a source is given (a job); without one (the estimate, or a
    strategy that fills 4-bit layers itself) its layers are replaced as
    transformers replaces them while loading, on the meta device. ``frozen_dtype``
    is a LoRA base's dtype where it differs from the trained weights' ``dtype``
    (the strategy's ``frozen_base_dtype``: bf16 under bf16-mixed). ``fp8``: torchao's
    recipe for the Linear layers that convert (litft.model.fp8), after LoRA so that only
    the frozen base's layers do; their names are kept as ``model.fp8_layers``. ``tiled_mlp``: each dense MLP over the
    sequence in chunks (litft.model.tiled_mlp), counted in ``model.tiled_mlps``. ``vision_encoder``: a vision-language model's
    image encoder frozen (full fine-tuning trains the rest; LoRA adapts the language model) or trained (litft.model.vision).
    """
    quantize = lora.quantize if lora is not None else None
    quantization = quantization_config(quantize, compute_dtype(precision), config)
    dtype = dtype or param_dtype(precision)
    base_dtype = frozen_dtype if lora is not None and frozen_dtype is not None else dtype
    if quantize is not None and source is not None:
        model = load_causal_lm(source, random_init=False, dtype=base_dtype, quantization_config=quantization, device=device,
                               config=config)
    else:
        model = structure(config, base_dtype)
        if quantize is not None:
            # transformers' own choice of which Linear layers load in 4 bits (not the output head).
            AutoHfQuantizer.from_config(quantization, pre_quantized=False).preprocess_model(model, device_map=None)
            model.is_loaded_in_4bit = True  # what loading the weights would set; peft reads it
            keep_4bit_training_layout(model)
    if attention is not None:
        model.set_attn_implementation(attention)
    use_grouped_experts(model)
    if liger:
        use_liger_kernels(model)
    with quiet_peft():  # peft calls transformers' old checkpointing names: advice for peft, not the user
        if gradient_checkpointing:
            enable_checkpointing(model)
        if lora is not None:
            model = apply_lora(model, lora, adapt_encoder=vision_encoder == "trained")
            compute_expert_lora(model)  # LoRA on MoE experts by grouped low-rank matmuls, no weight delta per expert
            for param in model.parameters():
                if param.requires_grad and param.dtype != dtype:
                    param.data = param.data.to(dtype)  # the adapters: fp32 masters under autocast whatever the base
    base = model.get_base_model() if lora is not None else model
    if lora is None and vision_encoder == "frozen" and sees_images(config):
        freeze_encoder(model)
    if tiled_mlp:
        model.tiled_mlps = tile_mlps(transformer_blocks(base), text_config(config).hidden_size)
    if fp8 is not None:
        model.fp8_layers = convert_to_fp8(base, fp8, fp8_all_gather)
    fuse_target_loss(base)
    return model


def switch_off_dropout(model: torch.nn.Module) -> int:
    """Every dropout of the model at 0 (``nn.Dropout`` modules, and the rates attention layers read as plain floats), as TRL's
    ``disable_dropout``: RL samples in eval mode, and with dropout in training the loss would score another policy than the
    one that sampled. The number of rates set to 0."""
    switched = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p:
            module.p, switched = 0.0, switched + 1
        for name, value in list(vars(module).items()):
            if "dropout" in name and type(value) is float and value:
                setattr(module, name, 0.0)
                switched += 1
    return switched


def enable_checkpointing(model) -> None:
    """Recompute each block in the backward; transformers 5 calls it activation checkpointing, older releases gradient checkpointing."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def build_module(
    source: str, plan: Union[RunPlan, str], lora: Optional[LoraArgs], train: TrainArgs, total_steps: int, objective: Optional[Objective] = None,
    *, random_init: bool, seed: int, device, strategy: TrainingStrategy, config=None,
) -> Tuple[CausalLM, Fill, bool]:
    """The CausalLM module, the fill that gives its tensors their first values, and whether it is already on ``device``.

    The strategy builds the structure (on the meta device, or partitioned as it is built) and says how it is filled; the
    plan says what runs (attention, compile, kernels, FP8; a precision alone: a plain run's plan). ``objective``: the
    run's (the next-token loss where none is given). ``config``: the model's, where the caller read it already.
    """
    plan = RunPlan.plain(plan) if isinstance(plan, str) else plan
    objective = objective or next_token(lora is not None)
    args = objective.args
    without_dropout = args.rl and args.disable_dropout
    if without_dropout and lora is not None and lora.dropout:
        lora = dataclasses.replace(lora, dropout=0.0)
    quantized = lora is not None and lora.quantize is not None
    # A 4-bit base is loaded whole by transformers unless the strategy quantizes it unit by unit as it fills (ZeRO-3).
    loads_4bit = quantized and not strategy.fills_4bit
    fp8, precision = plan.fp8, plan.precision
    model = build_model(
        config if config is not None else load_config(source), precision, lora, train.gradient_checkpointing, source=source if loads_4bit else None,
        device=device, attention=plan.attention, structure=skeleton if quantized else strategy.structure, liger=plan.liger,
        dtype=strategy.model_dtype, frozen_dtype=strategy.frozen_base_dtype(precision), fp8=fp8,
        fp8_all_gather=fp8 == "tensorwise" and strategy.gathers_fp8, tiled_mlp=train.tiled_mlp,
        vision_encoder="trained" if random_init else train.vision_encoder,  # a random encoder is not kept
    )
    if without_dropout:
        switch_off_dropout(model)
    lm = CausalLM(model, train, objective, total_steps=total_steps)
    lm.fp8_all_gather = fp8 == "tensorwise" and strategy.gathers_fp8
    if plan.compile.enabled:
        # Each block on its own, before any strategy wraps or shards it; compiled lazily, at its first call.
        blocks = language_model_blocks(lm.hf_model) if sees_images(lm.hf_model.config) else transformer_blocks(lm.hf_model)
        lm.compiled_kinds = compile_blocks(blocks)
    if loads_4bit:
        return lm, AdapterInit(Materializer(lm.model, lm.hf_model, None, seed)), True
    weights = None if random_init else model_layout_weights(locate_checkpoint(source), lm.hf_model.config)
    return lm, strategy.filler(lm, weights, seed), False
