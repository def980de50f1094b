"""MoE experts run as litft.experts chooses: transformers' grouped matmul wherever the model offers it, named, and exact.

The exactness itself is the conformance test's (tests/unit/test_architectures.py: litft's grouped experts against
transformers' per-expert loop, loss 1e-5 and every gradient 1e-4, for Mixtral, Qwen2/3-MoE, PhiMoE and gpt-oss).
"""

import torch

from litft.experts import CHOSEN, choose, describe, grouped_kernel, use_grouped_experts
from tests.architectures import ARCHITECTURES

MOE = [a for a in ARCHITECTURES if a.refused is None and ("MoE" in a.features or a.name == "gpt-oss")]


def skeleton_of(name):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(next(a for a in ARCHITECTURES if a.name == name).build(), experts_implementation="eager")


def test_moe_models_train_with_grouped_experts_and_dense_ones_are_left_alone():
    assert len(MOE) >= 5
    for architecture in MOE:
        model = skeleton_of(architecture.name)
        assert model.config._experts_implementation == "eager"
        assert use_grouped_experts(model) == CHOSEN and model.config._experts_implementation == CHOSEN, architecture.name
        assert describe(model, "cpu", torch.float32).startswith(f"experts: {CHOSEN} with "), architecture.name
    dense = skeleton_of("llama")
    assert choose(dense) is None and use_grouped_experts(dense) is None and describe(dense, "cpu", torch.float32) is None


def test_the_kernel_grouped_mm_runs_is_named_from_what_this_torch_and_device_take(monkeypatch):
    import transformers.integrations.moe as moe

    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda *args: True)
    assert grouped_kernel("cpu", torch.float32) in ("torch.nn.functional.grouped_mm", "torch._grouped_mm")
    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda *args: False)
    assert grouped_kernel("cpu", torch.float32) == "transformers' per-expert fallback"

    def refuses(*args):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(moe, "_can_use_grouped_mm", refuses)
    assert grouped_kernel("cpu", torch.float32) == "transformers' per-expert fallback"
