"""litft's grouped expert dispatch in one process: transformers' per-expert loop's loss and gradients, LoRA on experts
without a weight delta, and what a run says about it. The dispatch over ranks is tests/distributed/test_expert_parallel.py's."""

import copy

import pytest
import torch

from litft.config import DeepSpeedArgs, FSDPArgs, Layout, LoraArgs
from litft.model.experts import describe, experts_modules
from litft.model.lora import apply_lora
from litft.parallel.expert import compute_expert_lora, local_share, take_over_forward
from litft.parallel.mesh import Mesh
from litft.parallel.strategies import FSDP
from tests.architectures import ARCHITECTURES

# Each kind of experts transformers has: Mixtral's and Qwen3-MoE's fused gate_up, Qwen2-MoE's beside a shared expert,
# PhiMoE's sparse mixer, gpt-oss's transposed, interleaved and biased ones with its clamped gate.
KINDS = ["mixtral", "qwen3-moe", "qwen2-moe", "phimoe", "gpt-oss"]


def reference_model(name):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(next(a for a in ARCHITECTURES if a.name == name).build(), experts_implementation="eager").train()


def loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", KINDS)
def test_the_grouped_dispatch_gives_the_per_expert_loop(name):
    loop = reference_model(name)
    grouped = copy.deepcopy(loop)
    for module in experts_modules(grouped):
        take_over_forward(module)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    (loss, grads), (ours, our_grads) = loss_and_grads(loop, ids), loss_and_grads(grouped, ids)
    torch.testing.assert_close(ours, loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == our_grads.keys() and any(".experts." in key for key in grads)
    for key in grads:
        torch.testing.assert_close(our_grads[key], grads[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("name, rank", [("mixtral", 4), ("qwen3-moe", 3)])
def test_lora_on_experts_gives_peft_without_a_weight_delta(name, rank, monkeypatch):
    """peft's ParamWrapper folds B @ A into a copy of the expert stack per forward; litft's two grouped low-rank matmuls give its
    loss and gradients and never ask peft for the delta or its factors (a rank of 3 is padded to the kernel's 16-byte strides)."""
    lora = LoraArgs(r=rank, alpha=8, dropout=0.0)
    theirs = apply_lora(reference_model(name), lora)
    ours = copy.deepcopy(theirs)
    with torch.no_grad():  # adapters away from their zero init, so that B @ A matters
        for p in theirs.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
        for mine, other in zip(ours.parameters(), theirs.parameters()):
            mine.copy_(other)
    assert compute_expert_lora(ours) == 2  # both layers' experts, each with gate_up and down adapted
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    loss, grads = loss_and_grads(theirs, ids)
    from peft.tuners.lora.layer import ParamWrapper

    def refusing(method):
        def refuse(self, *args, **kwargs):
            assert self.num_experts == 1, "a per-expert weight delta was built"  # the router's 2-D weight takes peft's own path
            return method(self, *args, **kwargs)

        return refuse

    monkeypatch.setattr(ParamWrapper, "get_delta_weight", refusing(ParamWrapper.get_delta_weight))
    monkeypatch.setattr(ParamWrapper, "get_delta_factors", refusing(ParamWrapper.get_delta_factors))
    mine, my_grads = loss_and_grads(ours, ids)
    torch.testing.assert_close(mine, loss, rtol=1e-6, atol=1e-6)
    assert sum(".experts." in key and "lora_" in key for key in grads) == 8 and grads.keys() == my_grads.keys()
    for key in grads:
        torch.testing.assert_close(my_grads[key], grads[key], rtol=1e-4, atol=1e-5, msg=key)
    with torch.no_grad(), ours.disable_adapter():  # the reference of a preference objective: the base alone
        base = ours(input_ids=ids, labels=ids).loss
    with torch.no_grad(), theirs.disable_adapter():
        assert torch.allclose(base, theirs(input_ids=ids, labels=ids).loss, rtol=1e-6, atol=1e-6) and not torch.allclose(base, loss)
    assert "LoRA as grouped low-rank matmuls" in describe(ours, "cpu", torch.float32)


def test_lora_on_experts_of_any_rank_in_bf16():
    """bf16 takes 8 elements per 16 bytes: ranks 4 and 12 are padded to 8 and 16, and give peft's loss as closely as bf16 does."""
    for rank in (4, 12):
        theirs = apply_lora(reference_model("mixtral"), LoraArgs(r=rank, alpha=8, dropout=0.0)).to(torch.bfloat16)
        ours = copy.deepcopy(theirs)
        compute_expert_lora(ours)
        ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
        (loss, _), (mine, grads) = loss_and_grads(theirs, ids), loss_and_grads(ours, ids)
        torch.testing.assert_close(mine, loss, rtol=2e-2, atol=2e-2)
        assert all(grad.dtype == torch.bfloat16 and torch.isfinite(grad).all() for grad in grads.values())


def test_the_experts_mesh_and_the_share_a_rank_holds():
    one_node = Mesh.of(Layout("fsdp", 8, 1, FSDPArgs(), DeepSpeedArgs(), expert_parallel=2), FSDP)
    assert one_node.expert_dims() == ((4, 2), ("expert_shard", "expert")) and one_node.dense_dims() == ((1, 8), ("replicate", "shard"))
    two_node_layout = Layout("fsdp", 4, 2, FSDPArgs(), DeepSpeedArgs(), context_parallel=2, expert_parallel=4)
    two_nodes = Mesh.of(two_node_layout, FSDP)
    assert two_nodes.expert_dims() == ((2, 1, 4), ("replicate", "expert_shard", "expert"))
    assert two_nodes.describe() == "mesh: replicate 2 x shard 4 (context groups of 2, expert groups of 4)" and two_nodes.data_world == 4
    assert local_share("model.layers.3.mlp.experts.gate_up_proj", 4) == 0.25
    assert local_share("model.layers.3.mlp.experts.down_proj_bias", 2) == 0.5
    assert local_share("base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.default.weight", 4) == 1.0  # adapters stay whole
    assert local_share("model.layers.3.mlp.shared_expert.down_proj.weight", 4) == 1.0
    assert local_share("model.layers.3.mlp.experts.gate_up_proj", 1) == 1.0
