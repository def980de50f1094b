"""Under bf16-mixed a LoRA base is frozen in bf16 and the adapters keep fp32 masters, as peft and HF Trainer run it."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from litft.build import build_module
from litft.config import Layout, LoraArgs, TrainArgs
from litft.lora import peft_config
from litft.parallel.strategies import SingleDevice
from litft.parallel.strategies import fsdp


def test_bf16_mixed_lora_base_is_bf16_and_steps_like_peft(tiny_dir):
    """litft's module against peft on a bf16 base with the same adapters: the same loss and adapter gradients under autocast."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    lora = LoraArgs(r=4, alpha=8, dropout=0.0, target_modules="all-linear")
    strategy = SingleDevice(Layout(), "cpu", "bf16-mixed", TrainArgs())
    lm, fill, _ = build_module(str(tiny_dir), "bf16-mixed", lora, TrainArgs(), 1, random_init=False, seed=0, device=torch.device("cpu"), strategy=strategy)
    fill(lm)
    trained = {n: p for n, p in lm.model.named_parameters() if p.requires_grad}
    frozen = [p for p in lm.model.parameters() if not p.requires_grad]
    assert trained and {p.dtype for p in trained.values()} == {torch.float32}
    assert frozen and {p.dtype for p in frozen} == {torch.bfloat16}
    with torch.no_grad():  # lora_B is zero at init: give it values so that the adapters change the output
        for name, p in trained.items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)

    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    reference = get_peft_model(base, peft_config(lora, base))
    reference.load_state_dict({n: p.detach() for n, p in trained.items()}, strict=False)
    assert {p.dtype for p in reference.parameters() if p.requires_grad} == {torch.float32}  # peft's own fp32 adapters

    tokens = torch.randint(5, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": tokens, "labels": tokens, "position_ids": torch.arange(24).expand(2, -1)}
    with torch.autocast("cpu", torch.bfloat16):
        loss = lm.loss_sum(batch)
        logits = reference(input_ids=tokens).logits
        expected = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="sum")
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=2e-3, atol=0)
    grads = dict(reference.named_parameters())
    for name, p in trained.items():
        assert torch.linalg.vector_norm(p.grad - grads[name].grad) <= 2e-2 * torch.linalg.vector_norm(grads[name].grad) + 1e-6, name


def test_fsdp_keeps_one_dtype_where_torch_asks_it_of_every_parameter(monkeypatch):
    """FSDP2 before the check was relaxed (torch 2.7) wants one dtype per unit: there the base stays fp32."""

    def relaxed(self):  # the check as torch 2.13 makes it, of the trained parameters
        trainable_params = [p for p in self.fsdp_params if p.sharded_param.requires_grad]
        return {p.orig_dtype for p in trainable_params}

    def strict(self):  # as torch 2.7 made it, of all
        return {p.orig_dtype for p in self.fsdp_params}

    assert fsdp.frozen_dtype_may_differ(relaxed) and not fsdp.frozen_dtype_may_differ(strict)
    assert fsdp.frozen_dtype_may_differ() == ("requires_grad" in inspect.getsource(fsdp._init_mp_dtypes_of_this_torch()))
    assert fsdp.FSDP.frozen_base_dtype("32-true") is None and SingleDevice.frozen_base_dtype("bf16-true") is None
    monkeypatch.setattr(fsdp, "frozen_dtype_may_differ", lambda: False)
    assert fsdp.FSDP.frozen_base_dtype("bf16-mixed") is None
    monkeypatch.setattr(fsdp, "frozen_dtype_may_differ", lambda: True)
    assert fsdp.FSDP.frozen_base_dtype("bf16-mixed") == torch.bfloat16


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_adapter_dropout_keeps_a_mask_not_a_copy_and_trains_as_peft(tiny_dir, autocast):
    """Each adapter's dropout inside its A matrix: the same loss and gradients as peft's own modules, bit for bit, from the
    same generator state; what the backward keeps per adapter is a boolean mask beside the shared input."""
    import copy

    from peft import get_peft_model

    from litft.config import LoraArgs
    from litft.lora import DroppedInputLinear, keep_one_input_per_layer, peft_config
    from litft.model import load_causal_lm

    base = load_causal_lm(str(tiny_dir), random_init=False, dtype=torch.float32)
    base.requires_grad_(False)
    peft_model = get_peft_model(base, peft_config(LoraArgs(r=4, dropout=0.1), base))
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    ours = keep_one_input_per_layer(copy.deepcopy(peft_model))
    assert sum(isinstance(m, DroppedInputLinear) for m in ours.modules()) == 28  # 7 projections x 4 blocks
    ids = torch.randint(5, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for model in (peft_model, ours):
        model.train()
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (our_loss, our_grads) = results
    assert torch.equal(loss, our_loss) and grads.keys() == our_grads.keys() and len(grads) == 56
    for name, grad in grads.items():
        assert torch.equal(grad, our_grads[name]), name
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.dtype) or t, lambda t: t):
        layer = next(m for m in ours.modules() if isinstance(m, DroppedInputLinear))
        layer(torch.randn(3, layer.in_features, requires_grad=True)).sum().backward()
    assert torch.bool in kept and kept.count(torch.float32) == 2  # the input and the weight, no dropped copy
