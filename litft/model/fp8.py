"""FP8 matmuls in training through torchao's float8 recipes: ``--fp8 tensorwise|rowwise``.

The weights stay in the model's dtype: torchao casts each converted Linear's input,
weight and output gradient to FP8 around the matmul with dynamic scales, so
checkpoints and exports are what a bf16 run writes, and a run resumes with or
without ``--fp8``. Under LoRA only the frozen base's matmuls run in FP8; the
adapters stay in bf16. Under FSDP with tensorwise scaling the weights are
all-gathered in FP8 (half the bytes), their scales computed once per step for all
of them. On one H200, a Llama-3.2-1B step (bf16, 4 x 2048 tokens, compiled blocks)
ran 69,995 tok/s with tensorwise and 57,857 with rowwise against 63,815 without.

Which Linear layers convert is torchao's own rule: dimensions divisible by 16 and
large enough for FP8 to pay; never the output head, whose logits feed the loss.
"""

import os
from typing import List, Optional

import torch

from litft.errors import LitftError

RECIPES = ("tensorwise", "rowwise")
# Set to 1 by the tests: torchao's emulation (fp32 matmuls on FP8-rounded values) runs the FP8 path on the CPU.
EMULATE_VARIABLE = "LITFT_FP8_EMULATE"


def emulated() -> bool:
    return os.environ.get(EMULATE_VARIABLE) == "1"


def check_recipe(recipe: Optional[str]) -> None:
    """``--fp8``'s own value (what it combines with is refused by the run plan's table)."""
    if recipe is not None and recipe not in RECIPES:
        raise LitftError(f"--fp8 {recipe} is unknown; choose tensorwise or rowwise")


def recipe_config(recipe: str, fsdp_all_gather: bool):
    """torchao's config for the recipe; tensorwise scaling can all-gather FSDP's shards in FP8."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    changes = {}
    if emulated():
        changes["emulate"] = True
    if recipe == "tensorwise" and fsdp_all_gather:
        changes["enable_fsdp_float8_all_gather"] = True
    if changes:
        import dataclasses

        config = dataclasses.replace(config, **changes)
    return config


def converts(module: torch.nn.Module, name: str, recipe: str, head: Optional[torch.nn.Module]) -> bool:
    """Whether this layer's matmul runs in FP8: torchao's size rule for the recipe, never the head or a LoRA adapter."""
    if module is head or "lora_" in name or type(module) is not torch.nn.Linear:
        return False
    out_features, in_features = module.weight.shape
    if in_features % 16 or out_features % 16:
        return False  # FP8 tensor cores need both dimensions in multiples of 16
    # torchao's thresholds below which the casts cost more than FP8 saves (measured by torchao on H100s).
    if recipe == "tensorwise":
        return not (in_features <= 4096 and out_features <= 1024)
    return not (out_features <= 2048 or in_features <= 1024 or (out_features <= 4096 and in_features <= 2048))


def convert(model: torch.nn.Module, recipe: str, fsdp_all_gather: bool = False) -> List[str]:
    """Swap the chosen Linear layers for torchao's Float8Linear in place; their names."""
    from torchao.float8 import convert_to_float8_training

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    chosen = [name for name, module in model.named_modules() if converts(module, name, recipe, head)]
    picked = set(chosen)
    convert_to_float8_training(model, config=recipe_config(recipe, fsdp_all_gather), module_filter_fn=lambda module, name: name in picked)
    return chosen


def describe(recipe: str, converted: List[str], model: torch.nn.Module) -> str:
    """The first screen's line: how many of the model's matmul layers run in FP8, and how."""
    from torchao.float8.float8_linear import Float8Linear

    total = sum(isinstance(m, (torch.nn.Linear, Float8Linear)) and "lora_" not in n for n, m in model.named_modules())
    how = "torchao's emulation on the CPU" if emulated() else "torchao's float8 matmuls"
    return f"fp8: {recipe} scaling in {len(converted)} of {total} Linear layers ({how}); weights and checkpoints stay in the model's dtype"


def precompute_scales(model: torch.nn.Module) -> None:
    """After an optimizer step under FSDP's FP8 all-gather: every weight's scale in one reduction instead of one per layer."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
