"""LoRA and QLoRA as a transform of the model before it is filled and sharded."""

from typing import List, Optional, Union

import torch

from litft.errors import LitftError

QUANTIZE_CHOICES = ("bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq")


def quantization_config(quantize: Optional[str], compute_dtype: torch.dtype):
    """transformers' bitsandbytes config for ``--quantize`` (4-bit base weights for QLoRA)."""
    if quantize is None:
        return None
    if quantize not in QUANTIZE_CHOICES:
        raise LitftError(f"--quantize {quantize} is unknown; choose one of {', '.join(QUANTIZE_CHOICES)}")
    from transformers import BitsAndBytesConfig

    kind, _, double = quantize.removeprefix("bnb.").partition("-")
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=kind,
        bnb_4bit_use_double_quant=bool(double),
        bnb_4bit_compute_dtype=compute_dtype,
    )


def apply_lora(model, r: int, alpha: int, dropout: float, target_modules: Union[str, List[str]], quantized: bool, gradient_checkpointing: bool):
    """Freeze the model and add LoRA adapters; only they get gradients and optimizer state."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if r < 1:
        raise LitftError(f"--lora_r must be at least 1, got {r}")
    if quantized:
        # Keeps norms in fp32 and lets gradients reach the adapters through frozen 4-bit layers.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM", bias="none")
    try:
        return get_peft_model(model, config)
    except ValueError as err:
        raise LitftError(f"--lora_target_modules {targets} does not fit this model ({str(err).splitlines()[0]})") from None
