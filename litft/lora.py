"""LoRA and QLoRA as a transform of the model before it is filled and sharded.

peft is imported where it is used: it imports bitsandbytes and, through it, much of torch's
compiler (seconds on every process start), which a run without LoRA never needs.
"""

from typing import Optional

import torch
from transformers import BitsAndBytesConfig

from litft.config import QUANTIZE_CHOICES, LoraArgs
from litft.errors import LitftError


def quantization_config(quantize: Optional[str], compute_dtype: torch.dtype) -> Optional[BitsAndBytesConfig]:
    """transformers' bitsandbytes config for ``--quantize`` (4-bit base weights for QLoRA)."""
    if quantize is None:
        return None
    if quantize not in QUANTIZE_CHOICES:
        raise LitftError(f"--quantize {quantize} is unknown; choose one of {', '.join(QUANTIZE_CHOICES)}")
    kind, _, double = quantize.removeprefix("bnb.").partition("-")
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=bool(double), bnb_4bit_compute_dtype=compute_dtype,
    )


def peft_config(lora: LoraArgs):
    from peft import LoraConfig

    return LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.targets, task_type="CAUSAL_LM", bias="none"
    )


def apply_lora(model, lora: LoraArgs):
    """Freeze the model and add LoRA adapters; only they get gradients and optimizer state."""
    lora.check()
    # Not peft's prepare_model_for_kbit_training: it casts every bf16 tensor but the 4-bit ones to fp32, which only a
    # later whole-module cast undid, and none reaches ZeRO-3's partitions (a bf16-true QLoRA run attended in fp32 there).
    # Norms and embeddings keep the run's dtype like every other frozen weight; checkpointing is already on, non-reentrant,
    # so gradients reach the adapters through the frozen 4-bit layers without its input hook.
    for param in model.parameters():
        param.requires_grad_(False)
    from peft import get_peft_model

    try:
        return get_peft_model(model, peft_config(lora))
    except ValueError as err:
        raise LitftError(f"--lora_target_modules {lora.targets} does not fit this model ({str(err).splitlines()[0]})") from None
