"""MoE experts run as litft.model.experts chooses: transformers' grouped matmul wherever the model offers it, named, and exact.

The exactness itself is the conformance test's (tests/unit/test_architectures.py: litft's grouped experts against
transformers' per-expert loop, loss 1e-5 and every gradient 1e-4, for Mixtral, Qwen2/3-MoE, PhiMoE and gpt-oss).
"""

import torch

from litft.model.experts import CHOSEN, ExpertLoad, choose, describe, grouped_kernel, load_figures, use_grouped_experts
from tests.architectures import ARCHITECTURES, VOCAB

# Llama 4's experts run outside transformers' experts interface (its own dense loop): nothing to choose for them.
MOE = [a for a in ARCHITECTURES if a.refused is None and ("MoE" in a.features or a.name == "gpt-oss") and not a.name.startswith("llama4")]


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
    llama4 = skeleton_of("llama4 (chunked)")
    assert choose(llama4) is None and use_grouped_experts(llama4) is None
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


def test_expert_load_counts_the_routers_choices_in_training_forwards_only():
    """Counts against the router's own top-k (read from Qwen3-MoE's router output), over two forwards; none in eval."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(next(a for a in ARCHITECTURES if a.name == "qwen3-moe").build()).train()
    use_grouped_experts(model)
    load = ExpertLoad.of(model)
    routers = [layer.mlp.gate for layer in model.model.layers]
    chosen = [[] for _ in routers]
    for i, router in enumerate(routers):
        router.register_forward_hook(lambda module, args, out, i=i: chosen[i].append(out[2].flatten()))
    for seed in (1, 2):
        model(torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(seed)))
    experts = model.config.num_experts
    expected = torch.stack([torch.bincount(torch.cat(c), minlength=experts) for c in chosen]).double()
    counts = load.take()
    assert torch.equal(counts, expected) and counts.sum() == 2 * 2 * 17 * model.config.num_experts_per_tok * len(routers)
    assert load.take() is None
    model.eval()
    model(torch.randint(0, VOCAB, (1, 9)))
    assert load.take() is None  # validation does not count
    load.remove()
    assert ExpertLoad.of(skeleton_of("llama")) is None


def test_load_figures_are_the_busiest_expert_over_the_mean_per_layer():
    counts = torch.tensor([[4.0, 4, 4, 4], [8, 0, 4, 4]])
    assert load_figures(counts) == {"expert_imbalance_max": 2.0, "expert_imbalance_mean": 1.5, "experts_idle": 1,
                                    "expert_imbalance/layer_0": 1.0, "expert_imbalance/layer_1": 2.0}
    assert load_figures(counts * 2) == load_figures(counts)  # a tensor-parallel group counting the same tokens twice
    # Experts 0-1 on one rank of an expert group, 2-3 on the other: layer 1 sends them 12 and 4 pairs, 1.5 times the mean.
    assert load_figures(torch.tensor([[4.0, 4, 4, 4], [8, 4, 2, 2]]), groups=2)["expert_rank_imbalance_max"] == 1.5
    assert "expert_rank_imbalance_max" not in load_figures(counts)


def test_lora_on_a_moe_model_is_added_once_and_bad_targets_are_one_line():
    """Experts take adapters in one pass (no failed first try left inside the model), and targets that match nothing are refused."""
    import warnings

    import pytest

    from litft.config import LoraArgs
    from litft.errors import LitftError
    from litft.model.lora import apply_lora

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # peft warns when a model is modified twice, and about its own unmatched patterns
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)  # build_model's filter
        wrapped = apply_lora(skeleton_of("qwen3-moe"), LoraArgs())
    assert any(type(m).__name__ == "ParamWrapper" for m in wrapped.modules())
    with pytest.raises(LitftError, match="--lora_target_modules nothing_here does not fit this model"):
        apply_lora(skeleton_of("qwen3-moe"), LoraArgs(target_modules="nothing_here"))
