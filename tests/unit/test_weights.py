"""Models built on the meta device and materialized part by part must equal what transformers loads."""

import pytest
import torch

from litft.errors import LitftError
from litft.model.loading import load_causal_lm, load_config
from litft.model.weights import CheckpointWeights, Materializer, skeleton, transformer_blocks


def materialized(tiny_dir, weights=True, seed=0, order="whole", lora=False):
    model = skeleton(load_config(str(tiny_dir)), torch.float32)
    if lora:
        from litft.config import LoraArgs
        from litft.model.lora import apply_lora

        model = apply_lora(model, LoraArgs(4, 8, 0.0, "all-linear"))
    hf = model.get_base_model() if lora else model
    fill = Materializer(model, hf, CheckpointWeights(tiny_dir) if weights else None, seed)
    if order == "blocks":
        # As FSDP does it: each block on its own, the rest afterwards.
        for block in reversed(transformer_blocks(hf)):
            fill(block)
    fill(model)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    return model


def test_checkpoint_load_equals_transformers(tiny_dir):
    reference = load_causal_lm(str(tiny_dir), random_init=False, dtype=torch.float32)
    model = materialized(tiny_dir, order="blocks")
    ref_state, state = reference.state_dict(), model.state_dict()
    assert ref_state.keys() == state.keys()
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=0, atol=0, msg=name)
    # Non-persistent buffers (rotary frequencies) are recomputed, not left as uninitialized memory.
    for (name, buf), (_, ref_buf) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(buf, ref_buf, msg=name)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tying survives materialization
    ids = torch.tensor([[1, 5, 9, 200, 3]])
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_random_init_depends_on_seed_and_name_only(tiny_dir):
    whole = materialized(tiny_dir, weights=False, seed=3)
    by_block = materialized(tiny_dir, weights=False, seed=3, order="blocks")
    other_seed = materialized(tiny_dir, weights=False, seed=4)
    for (name, a), b, c in zip(whole.named_parameters(), by_block.parameters(), other_seed.parameters()):
        assert torch.equal(a, b), name
        if "norm" not in name:
            assert not torch.equal(a, c), name
    std = whole.config.initializer_range
    assert abs(whole.model.layers[0].mlp.up_proj.weight.std().item() - std) < 0.1 * std
    assert torch.isfinite(whole(torch.tensor([[1, 2, 3]])).logits).all()


def test_lora_adapters_start_as_peft_does(tiny_dir):
    model = materialized(tiny_dir, lora=True, order="blocks")
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert adapters and all(p.requires_grad for p in adapters.values())
    assert all(torch.count_nonzero(p) == 0 for n, p in adapters.items() if "lora_B" in n)
    assert all(p.abs().sum() > 0 for n, p in adapters.items() if "lora_A" in n)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    again = materialized(tiny_dir, lora=True)
    for (name, a), b in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(a, b), name


def test_checkpoint_of_another_model_is_refused(tiny_dir, tmp_path):
    config = load_config(str(tiny_dir))
    config.num_hidden_layers += 1
    model = skeleton(config, torch.float32)
    with pytest.raises(LitftError, match="has no tensor for model.layers.4"):
        Materializer(model, model, CheckpointWeights(tiny_dir), 0)(model)
    with pytest.raises(LitftError, match="no model.safetensors"):
        CheckpointWeights(tmp_path)


@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-neox"])
def test_a_hub_layout_checkpoint_is_converted_while_read_one_group_at_a_time(name, tmp_path, monkeypatch):
    """Per-expert tensors stacked per layer (Qwen3-MoE) and a renamed head (GPT-NeoX): every tensor equals what
    transformers' from_pretrained makes of the checkpoint, at most one converted group is held, and nothing is written."""
    from transformers import AutoModelForCausalLM

    from litft.model.hub_layout import HubLayoutWeights, model_layout_weights
    from tests.architectures import ARCHITECTURES, save_tiny

    monkeypatch.setenv("LITFT_HOME", str(tmp_path / "home"))
    folder = save_tiny(next(a for a in ARCHITECTURES if a.name == name), tmp_path / "model")
    weights = model_layout_weights(folder, load_config(str(folder)))
    assert isinstance(weights, HubLayoutWeights)
    expected = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    held = 0
    for key, tensor in expected.items():
        found = weights.find([key])
        if found is None:  # tied to a tensor read under its other name, or a buffer the model computes
            continue
        torch.testing.assert_close(weights.get(found), tensor, rtol=0, atol=0, msg=key)
        held = max(held, len(weights.converted))
    assert held <= 3  # one group: a layer's gate_up_proj and down_proj, or one renamed tensor
    assert not (tmp_path / "home" / "converted").exists()


def test_a_zero3_partition_of_stacked_experts_reads_only_its_experts(tmp_path, monkeypatch):
    """A flat range of a layer's stacked experts (a ZeRO-3 partition) is converted from the experts it covers alone, and equals
    the same range of the whole converted tensor."""
    from litft.model.hub_layout import model_layout_weights
    from tests.architectures import ARCHITECTURES, save_tiny

    monkeypatch.setenv("LITFT_HOME", str(tmp_path / "home"))
    folder = save_tiny(next(a for a in ARCHITECTURES if a.name == "qwen3-moe"), tmp_path / "model")
    config = load_config(str(folder))
    model = skeleton(config, torch.float32)
    weights = model_layout_weights(folder, config)
    fill = Materializer(model, model, weights, 0)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    shape = tuple(model.get_parameter(name).shape)  # (4 experts, 2 x 32, 32)
    whole = weights.get(name).reshape(-1)
    reads = []
    monkeypatch.setattr(weights.stored, "get", lambda key, get=weights.stored.get: reads.append(key) or get(key))
    row = shape[1] * shape[2]
    part = fill.stored_range(name, shape, row + 5, row)  # the end of expert 1 and the start of expert 2
    assert torch.equal(part, whole[row + 5 : 2 * row + 5])
    assert sorted(reads) == sorted(f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in (1, 2) for p in ("gate", "up"))


def test_an_fsdp_rank_fills_reads_and_converts_only_the_rows_it_keeps(tmp_path, monkeypatch):
    """The second of two FSDP ranks fills a Qwen3-MoE block in the hub's layout: each parameter's kept rows (torch.chunk's, as
    FSDP2 shards) equal the whole load's, and only experts 2 and 3 of the layer's per-expert tensors are read."""
    from litft.model.hub_layout import model_layout_weights
    from litft.parallel.strategies.fsdp import chunk_rows, kept_rows
    from tests.architectures import ARCHITECTURES, save_tiny

    class Ranks:  # the shard dimension of a mesh, as kept_rows reads it
        def size(self, dim=-1):
            return 2

        def get_local_rank(self, dim=-1):
            return 1

    assert [chunk_rows(5, 2, r) for r in (0, 1)] == [(0, 3), (3, 5)] and chunk_rows(1, 2, 1) == (1, 1)  # torch.chunk's split
    monkeypatch.setenv("LITFT_HOME", str(tmp_path / "home"))
    folder = save_tiny(next(a for a in ARCHITECTURES if a.name == "qwen3-moe"), tmp_path / "model")
    config = load_config(str(folder))
    whole = skeleton(config, torch.float32)
    Materializer(whole, whole, model_layout_weights(folder, config), 0)(whole)
    model = skeleton(config, torch.float32)
    weights = model_layout_weights(folder, config)
    reads = []
    monkeypatch.setattr(weights.stored, "get", lambda key, get=weights.stored.get: reads.append(key) or get(key))
    block = transformer_blocks(model)[1]
    rows = kept_rows(block, Ranks())
    Materializer(model, model, weights, 0)(block, rows)
    for name, param in block.named_parameters():
        first, last = rows[(id(block.get_submodule(name.rpartition(".")[0])), name.rpartition(".")[2])]
        assert (first, last) == chunk_rows(param.shape[0], 2, 1)
        torch.testing.assert_close(param[first:last], whole.get_parameter(f"model.layers.1.{name}")[first:last], rtol=0, atol=0, msg=name)
    experts = sorted(key for key in reads if ".experts." in key)
    assert experts == sorted(f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in (2, 3) for p in ("gate", "up", "down"))


@pytest.mark.parametrize("name", ["llama", "phi3", "gpt-neox"])
def test_a_tensor_parallel_rank_fills_only_its_slice_of_each_split(name, tmp_path, monkeypatch):
    """Rank (tensor 1 of 2, shard 1 of 2) fills a block: a column split's rows and a row split's columns, each chunked again
    over dim 0 as FSDP2 shards the slice, equal the whole load's there (the model's own plan: Phi-3's fused projections,
    GPT-NeoX's interleaved qkv); the rest is never written."""
    from litft.model.hub_layout import model_layout_weights
    from litft.parallel.strategies.fsdp import chunk_rows, kept_slices
    from litft.parallel.tensor import split_parts
    from tests.architectures import ARCHITECTURES, save_tiny

    class Second:  # rank 1 of 2 of a mesh dimension, as kept_slices reads it
        def size(self, dim=-1):
            return 2

        def get_local_rank(self, dim=-1):
            return 1

    monkeypatch.setenv("LITFT_HOME", str(tmp_path / "home"))
    folder = save_tiny(next(a for a in ARCHITECTURES if a.name == name), tmp_path / "model")
    config = load_config(str(folder))
    whole = skeleton(config, torch.float32)
    Materializer(whole, whole, model_layout_weights(folder, config), 0)(whole)
    model = skeleton(config, torch.float32)
    block = transformer_blocks(model)[1]
    parts = split_parts(block, config)
    regions = kept_slices(block, Second(), Second(), config)
    Materializer(model, model, model_layout_weights(folder, config), 0)(block, regions)
    kinds = set()
    for param_name, param in block.named_parameters():
        owner, _, attr = param_name.rpartition(".")
        place = (id(block.get_submodule(owner)), attr)
        expected = whole.get_parameter(next(n for n, p in whole.named_parameters() if n.endswith(f"layers.1.{param_name}")))
        if place in parts and parts[place][0] == "column":  # the group's rows, then FSDP's chunk of them
            mine = expected.chunk(2, dim=0)[1].chunk(2, dim=0)[1]
            first, last = regions[place]
            got = param[first:last]
        elif place in parts:  # the group's columns of FSDP's rows
            mine = expected.chunk(2, dim=1)[1].chunk(2, dim=0)[1]
            first, last, left, right = regions[place]
            got = param[first:last, left:right]
        else:
            mine = expected.chunk(2, dim=0)[1]
            first, last = regions[place]
            assert (first, last) == chunk_rows(param.shape[0], 2, 1)
            got = param[first:last]
        kinds.add(parts.get(place, ("whole", None))[0])
        torch.testing.assert_close(got, mine, rtol=0, atol=0, msg=param_name)
    assert kinds == {"column", "row", "whole"}


def test_ranks_fill_only_their_tensor_parallel_slice_where_torch_splits_local_copies(monkeypatch):
    """Where torch's parallelize_module takes src_data_rank, each rank's own slice is used; before (torch 2.5), rank 0's
    whole tensor is scattered, so every rank fills whole blocks (litft.parallel.tensor.splits_local_data)."""
    import torch.distributed.tensor.parallel as tp

    from litft.parallel.tensor import splits_local_data

    assert splits_local_data() is True  # this torch
    monkeypatch.setattr(tp, "parallelize_module", lambda module, device_mesh=None, parallelize_plan=None: module)  # torch 2.5's
    assert splits_local_data() is False
