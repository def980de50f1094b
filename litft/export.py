"""Writing the trained model as a Hugging Face folder that ``from_pretrained`` loads."""

import os
import shutil
from pathlib import Path
from typing import Optional

import torch


def save_hf(model, tokenizer, target: Path, state_dict: Optional[dict] = None) -> None:
    """safetensors + config + tokenizer, written beside the target and renamed into place.

    A crash while writing leaves the previous ``target`` (if any) untouched.
    ``state_dict`` replaces the model's own tensors when those are shards.
    """
    staging = target.parent / f".{target.name}.tmp{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    # A quantization entry would make transformers expect 4-bit weights that are not there.
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(staging, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    if target.exists():
        shutil.rmtree(target)
    os.rename(staging, target)


def export_final(model, tokenizer, out_dir: Path, base_source: Optional[str], dtype: torch.dtype, state_dict: Optional[dict] = None) -> Path:
    """``out_dir/final`` for every job; LoRA adds ``out_dir/final-adapter`` (peft) and merges into ``final``.

    Called on rank 0 alone, with the gathered ``state_dict`` when the model is sharded.
    """
    from litft.lora import merge_adapter_into_base

    final = out_dir / "final"
    if base_source is None:
        save_hf(model, tokenizer, final, state_dict)
    else:
        adapter = out_dir / "final-adapter"
        save_hf(model, tokenizer, adapter, state_dict)
        save_hf(merge_adapter_into_base(base_source, str(adapter), dtype), tokenizer, final)
    return final
