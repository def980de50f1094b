"""The model's tensors as the estimate counts them: shapes, dtypes, what trains, which FSDP unit holds each."""

import math
from typing import Dict, List, Optional

from litft.estimate.memory import Param
from litft.model.weights import transformer_blocks

BNB_BLOCKSIZE = 64  # bitsandbytes' 4-bit block: one absmax per 64 weights
BNB_NESTED_BLOCKSIZE = 256  # double quantization: one fp32 scale per 256 absmax bytes


def quant_state_bytes(numel: int, nested: bool) -> int:
    """bitsandbytes' QuantState beside a 4-bit weight: absmax per block, the 16-entry code, and the nested state."""
    blocks = math.ceil(numel / BNB_BLOCKSIZE)
    if not nested:
        return 4 * blocks + 16 * 4
    return blocks + 4 * math.ceil(blocks / BNB_NESTED_BLOCKSIZE) + 256 * 4 + 4 + 16 * 4


def model_tensors(model, quantize: Optional[str]) -> List[Param]:
    """Every parameter once (tied ones once), with the part of the model holding it: a block, untied embeddings or head, or the rest."""
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
