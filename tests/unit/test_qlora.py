"""QLoRA's 4-bit base stays the one that was loaded, whatever the loop runs between steps."""

import torch

from litft.run.build import build_model
from litft.config import LoraArgs
from litft.model.loading import load_config


def qlora_step(tiny_dir, validate_first: bool):
    """Loss and adapter gradients of one training step; optionally after an eval-mode forward without grad, as validation runs."""
    torch.manual_seed(0)  # peft draws lora_A from the global generator
    lora = LoraArgs(r=4, alpha=8, dropout=0.0, target_modules="all-linear", quantize="bnb.nf4-dq")
    model = build_model(load_config(str(tiny_dir)), "32-true", lora, False, source=str(tiny_dir), device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # nonzero, so that gradients reach lora_A through the frozen layers after it
            p.data.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    tokens = torch.randint(0, 300, (2, 16), generator=generator)
    if validate_first:
        model.eval()
        with torch.no_grad():
            model(input_ids=tokens)
    model.train()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    nested = [p.quant_state.as_dict(packed=False) for p in model.parameters() if type(p).__name__ == "Params4bit"]
    return loss.item(), grads, nested


def test_validation_leaves_the_4bit_base_as_trained(tiny_dir):
    """bitsandbytes repacks 4-bit weights for CPU inference at their first no-grad eval forward (on AVX512-BF16
    CPUs); the losses and every adapter gradient of a step after validation must equal those without it."""
    loss, grads, _ = qlora_step(tiny_dir, validate_first=False)
    loss_after, grads_after, nested = qlora_step(tiny_dir, validate_first=True)
    assert loss_after == loss
    assert grads.keys() == grads_after.keys() and len(grads) == 2 * 7 * 4  # A and B of 7 linears in 4 blocks
    for name in grads:
        torch.testing.assert_close(grads_after[name], grads[name], rtol=0, atol=0, msg=name)
    assert nested and all("nested_absmax" in state for state in nested)  # -dq's nested statistics are still there


def test_qlora_checkpoints_blocks_without_reentrant_autograd(tiny_dir):
    """peft turns checkpointing on again for 4-bit bases; it must stay the non-reentrant variant litft asks for."""
    lora = LoraArgs(r=4, alpha=8, dropout=0.0, target_modules="all-linear", quantize="bnb.nf4")
    model = build_model(load_config(str(tiny_dir)), "32-true", lora, True, source=str(tiny_dir), device=torch.device("cpu"))
    checkpointed = [m._gradient_checkpointing_func for m in model.modules() if getattr(m, "_gradient_checkpointing_func", None) is not None]
    assert len(checkpointed) >= 4 and all(f.keywords.get("use_reentrant") is False for f in checkpointed)
