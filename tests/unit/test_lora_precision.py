"""Under bf16-mixed a LoRA base is frozen in bf16 and the adapters keep fp32 masters, as peft and HF Trainer run it."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from litft.run.build import build_module
from litft.config import Layout, LoraArgs, TrainArgs
from litft.model.lora import peft_config
from litft.parallel.strategies import SingleDevice
from litft.parallel.strategies import fsdp


def test_bf16_mixed_lora_base_is_bf16_and_steps_like_peft(tiny_dir):
    """litft's module against peft on a bf16 base with the same adapters: the same loss under autocast, and adapter gradients
    as close to an fp32 run's as peft's own (litft sums each adapter into its base output inside one matmul, one rounding
    where peft has three, so the two bf16 runs differ from each other by about what each differs from fp32)."""
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

    tokens = torch.randint(5, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": tokens, "labels": tokens, "position_ids": torch.arange(24).expand(2, -1)}
    with torch.autocast("cpu", torch.bfloat16):
        loss = lm.loss_sum(batch)
    loss.backward()
    references = {}
    for base_dtype, autocast in ((torch.bfloat16, True), (torch.float32, False)):  # peft's bf16-mixed run, and fp32 throughout
        base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).to(base_dtype)
        reference = get_peft_model(base, peft_config(lora, base))
        reference.load_state_dict({n: p.detach() for n, p in trained.items()}, strict=False)
        assert {p.dtype for p in reference.parameters() if p.requires_grad} == {torch.float32}  # peft's own fp32 adapters
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            logits = reference(input_ids=tokens).logits
            expected = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="sum")
        expected.backward()
        references[base_dtype] = (expected.detach(), dict(reference.named_parameters()))
    torch.testing.assert_close(loss, references[torch.bfloat16][0], rtol=2e-3, atol=0)

    def off(grads) -> float:  # the worst relative distance of any adapter's gradient from fp32's
        exact = references[torch.float32][1]
        return max(float(torch.linalg.vector_norm(grads[n] - exact[n].grad) / torch.linalg.vector_norm(exact[n].grad)) for n in trained)

    ours, peft = off({n: p.grad for n, p in trained.items()}), off({n: p.grad for n, p in references[torch.bfloat16][1].items()})
    assert ours <= 1.05 * peft and ours < 0.03, (ours, peft)


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


# Adapters per model: litft-tiny's 7 projections x 4 blocks; GPT-NeoX's fused qkv, dense and MLP pair (biased base layers)
# x 2 blocks; Gemma 2's 7 x 2 (its attention and final logits soft-capped).
ADAPTERS = {"llama": 28, "gpt-neox": 8, "gemma2": 14}


@pytest.mark.parametrize("autocast,base_dtype,dropout,arch", [
    (False, torch.float32, 0.1, "llama"), (True, torch.float32, 0.1, "llama"), (True, torch.bfloat16, 0.1, "llama"),
    (True, torch.bfloat16, 0.0, "llama"), (False, torch.float32, 0.1, "gpt-neox"), (True, torch.bfloat16, 0.1, "gemma2"),
], ids=["fp32", "bf16-autocast", "bf16-mixed", "bf16-mixed-no-dropout", "fp32-gpt-neox", "bf16-mixed-gemma2"])
def test_adapter_dropout_keeps_a_mask_not_a_copy_and_trains_as_peft(tiny_dir, tmp_path, autocast, base_dtype, dropout, arch):
    """Each adapter's dropout inside its A matrix: the same loss and gradients as peft's own modules given the same masks
    (peft's dropout modules draw them as litft does, from the same generator state; litft scales the adapter's rank-r
    output instead of its input, one rounding apart); what the backward keeps per adapter is a boolean mask beside the
    shared input. Under bf16-mixed (a bf16 base, fp32 adapters) the adapters read the layer's bf16 input as it comes, where
    peft copied it to fp32 for each adapter: no fp32 copy of an activation kept for the backward."""
    import copy

    from peft import get_peft_model

    from litft.config import LoraArgs
    from litft.model.lora import DroppedInputLinear, dropout_mask, keep_one_input_per_layer, peft_config
    from litft.model.loading import load_causal_lm

    class SameMasks(torch.nn.Module):
        """peft's dropout with litft's masks, drawn in the same order from the same generator."""

        def __init__(self, p):
            super().__init__()
            self.p = p

        def forward(self, x):
            keep, taken = dropout_mask(x.shape, self.p, x.device)
            return torch.where(keep, x, 0) / (1 - taken) if self.training else x

    folder = tiny_dir
    if arch != "llama":
        from tests.architectures import ARCHITECTURES, save_tiny

        folder = save_tiny(next(a for a in ARCHITECTURES if a.name == arch), tmp_path / arch)
    base = load_causal_lm(str(folder), random_init=False, dtype=base_dtype)
    base.requires_grad_(False)
    peft_model = get_peft_model(base, peft_config(LoraArgs(r=4, dropout=dropout), base))
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    assert {p.dtype for p in peft_model.parameters() if p.requires_grad} == {torch.float32}
    ours = keep_one_input_per_layer(copy.deepcopy(peft_model))
    same_masks = copy.deepcopy(peft_model)  # the values' reference; peft_model itself keeps its own dropout (its memory)
    for module in same_masks.modules():
        for name, drop in list(getattr(module, "lora_dropout", {}).items()):
            if isinstance(drop, torch.nn.Dropout):
                module.lora_dropout[name] = SameMasks(drop.p)
    assert sum(isinstance(m, DroppedInputLinear) for m in ours.modules()) == (ADAPTERS[arch] if dropout else 0)
    ids = torch.randint(5, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for model in (same_masks, ours, peft_model):
        model.train()
        torch.manual_seed(3)
        activations = []  # the floating-point tensors the backward keeps that are not parameters
        with torch.autograd.graph.saved_tensors_hooks(lambda t: activations.append(t) or t, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        kept = [t for t in activations if t.is_floating_point() and not isinstance(t, torch.nn.Parameter)]
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, kept))
    (loss, grads, _), (our_loss, our_grads, our_kept), (_, _, peft_kept) = results
    assert grads.keys() == our_grads.keys() and len(grads) == 2 * ADAPTERS[arch]
    if not dropout:  # without dropout the forward is peft's own, bit for bit
        assert torch.equal(loss, our_loss) and all(torch.equal(grad, our_grads[name]) for name, grad in grads.items())
    elif not autocast:
        torch.testing.assert_close(our_loss, loss, rtol=1e-6, atol=0)
        for name, grad in grads.items():  # each tensor's relative distance (single elements near 0 differ in their last bits)
            assert float((our_grads[name] - grad).norm()) <= 1e-5 * float(grad.norm()), name
    else:  # bf16 rounds the scaled input (peft) and the scaled output (litft) differently: both measured against fp32
        reference = copy.deepcopy(same_masks).float().train()
        torch.manual_seed(3)
        reference(input_ids=ids, labels=ids).loss.backward()
        exact = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}

        def worst(got):
            return max(float((got[n].float() - g).norm() / g.norm().clamp(min=1e-12)) for n, g in exact.items())

        assert worst(our_grads) <= 1.5 * worst(grads) + 1e-3, (worst(our_grads), worst(grads))
    if base_dtype == torch.bfloat16:  # peft's copies of the inputs are gone (the norms' own fp32 stays): fewer distinct bytes kept
        def held(kept, dtype):
            return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept if t.dtype == dtype}.values())

        if dropout and arch == "llama":  # the dropped inputs peft kept in fp32 (Gemma 2 keeps fp32 of its own: norms, soft-capping)
            assert held(our_kept, torch.float32) < 0.5 * held(peft_kept, torch.float32)
        assert held(our_kept, torch.float32) + held(our_kept, torch.bfloat16) < held(peft_kept, torch.float32) + held(peft_kept, torch.bfloat16)
    if dropout:
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.dtype) or t, lambda t: t):
            layer = next(m for m in ours.modules() if isinstance(m, DroppedInputLinear))
            layer(torch.randn(3, layer.in_features, requires_grad=True)).sum().backward()
        assert torch.int64 in kept and kept.count(torch.float32) == 2  # the input and the weight, no dropped copy (the CPU: positions)


@pytest.mark.parametrize("draw", ["gaps", "words"])
def test_dropout_masks_keep_each_element_with_one_minus_p_and_scale_to_the_same_mean(draw):
    """litft's masks, both ways: the CPU's (the gaps between dropped elements drawn, p exact) and an accelerator's (four
    draws a 64-bit word, p to 1/65536, run here on the CPU): each element kept with probability 1 - p, independently of its
    neighbours (runs of kept elements are geometric), the kept inputs scaled so that the expected dropped input is the
    input; independent between calls (each adapter its own)."""
    from litft.model.lora import _DroppedInputMatmul, _DroppedPositionsMatmul, _dropped_by_words, dropout_mask

    masks = {"gaps": lambda shape, p: dropout_mask(shape, p, "cpu"), "words": lambda shape, p: _dropped_by_words(shape, p, "cpu")}[draw]
    torch.manual_seed(0)
    shape = (1000, 1000)
    for p in (0.001, 0.05, 0.1, 0.5):
        keep, taken = masks(shape, p)
        assert keep.dtype == torch.bool and keep.shape == shape and abs(taken - p) <= (2**-17 if draw == "words" else 0)
        assert abs(float(keep.float().mean()) - (1 - taken)) < 4 * (p * (1 - p) / keep.numel()) ** 0.5  # 4 binomial std
        flat = keep.flatten()
        both = float((~flat[1:] & ~flat[:-1]).float().mean())  # two neighbours dropped: p^2 if independent
        assert abs(both - taken**2) < 4 * (taken**2 / keep.numel()) ** 0.5 + 1e-7
        again, _ = masks(shape, p)
        both = float((~keep & ~again).float().mean())  # dropped by two draws: p^2 if independent
        assert abs(both - taken**2) < 4 * (taken**2 / keep.numel()) ** 0.5 + 1e-7
    x, weight = torch.ones(4000, 64, dtype=torch.float64), torch.eye(64, dtype=torch.float64)
    matmul, taken = {"gaps": (_DroppedPositionsMatmul, 0.1), "words": (_DroppedInputMatmul, round(0.1 * 65536) / 65536)}[draw]
    out = matmul.apply(x, weight, 0.1)  # each output element: one input kept (scaled) or dropped
    assert abs(float(out.mean()) - 1.0) < 4 * (0.1 / 0.9 / out.numel()) ** 0.5
    assert all(v == 0.0 or abs(v - 1 / (1 - taken)) < 1e-12 for v in torch.unique(out).tolist())


def test_adapters_add_into_the_base_output_inside_their_second_matmul(tiny_dir, monkeypatch):
    """Each LoRA Linear's ``base(x) + B(A(x)) * scaling`` as one addmm per layer: peft's loss and gradients in fp32, and peft's
    own forward wherever the plain case does not hold (adapters disabled or merged). A peft before 0.16 (no variants) or 0.15
    (no ``_cast_input_dtype``) is stood in for by deleting them."""
    import copy

    from peft import get_peft_model
    from torch.utils._python_dispatch import TorchDispatchMode

    from litft.model.lora import add_adapters_in_one_matmul
    from litft.model.loading import load_causal_lm

    class CountAddmm(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountAddmm.calls += func is torch.ops.aten.addmm.default
            return func(*args, **(kwargs or {}))

    base = load_causal_lm(str(tiny_dir), random_init=False, dtype=torch.float32)
    base.requires_grad_(False)
    peft_model = get_peft_model(base, peft_config(LoraArgs(r=4, dropout=0.0), base))
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    ours = add_adapters_in_one_matmul(copy.deepcopy(peft_model))
    ids = torch.randint(5, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for model in (peft_model, ours):
        with CountAddmm():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, CountAddmm.calls))
        CountAddmm.calls = 0
    (loss, grads, peft_calls), (our_loss, our_grads, our_calls) = results
    assert our_calls - peft_calls == 28  # 7 projections x 4 blocks
    torch.testing.assert_close(our_loss, loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-5, atol=1e-8)
    with torch.no_grad():
        with ours.disable_adapter(), peft_model.disable_adapter():
            assert torch.equal(ours(input_ids=ids).logits, peft_model(input_ids=ids).logits)
        ours.merge_adapter(), peft_model.merge_adapter()
        assert torch.equal(ours(input_ids=ids).logits, peft_model(input_ids=ids).logits)
        ours.unmerge_adapter(), peft_model.unmerge_adapter()
        from peft.tuners.lora.layer import Linear as LoraLinear

        expected = ours(input_ids=ids).logits
        for module in ours.modules():
            if isinstance(module, LoraLinear):
                del module.lora_variant
        for owner in LoraLinear.__mro__:
            if "_cast_input_dtype" in vars(owner):
                monkeypatch.delattr(owner, "_cast_input_dtype")
        assert not hasattr(LoraLinear, "_cast_input_dtype")
        torch.testing.assert_close(ours(input_ids=ids).logits, expected, rtol=0, atol=0)


def test_dropout_on_a_tensor_parallel_adapter_takes_torchs_dropout(tmp_path):
    """A row-split A matrix under tensor parallel gets DTensors (its weight, its sharded input): it takes torch's dropout,
    which DTensor runs, where the mask select failed on mixing a plain mask with a DTensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from litft.model.lora import DroppedInputLinear

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        layer = DroppedInputLinear(64, 4, bias=False)
        layer.dropout_p = 0.5
        layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(1)]))
        x = DTensor.from_local(torch.ones(8, 64), mesh, [Shard(1)])
        torch.manual_seed(0)
        out = layer.train()(x)
        out.full_tensor().sum().backward()
        assert isinstance(out, DTensor) and layer.weight.grad is not None
        plain = layer.weight.full_tensor().detach()
        assert not torch.allclose(out.full_tensor(), torch.ones(8, 64) @ plain.t())  # dropped: not the plain product
    finally:
        dist.destroy_process_group()
