"""What tensor parallel splits, by name and by placement (its exact training is in tests/distributed/test_sharding.py)."""

import pytest
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from litft.parallel.tensor import split_over_tensor_parallel, splitting


@pytest.mark.parametrize(
    "name, split",
    [
        ("model.layers.0.self_attn.q_proj.weight", True),
        ("model.layers.0.self_attn.o_proj.weight", True),
        ("model.layers.0.self_attn.o_proj.bias", False),  # added whole after the row split's all-reduce
        ("model.layers.0.self_attn.q_proj.bias", True),
        ("base_model.model.model.layers.1.mlp.up_proj.base_layer.weight", True),
        ("base_model.model.model.layers.1.mlp.up_proj.lora_A.default.weight", False),
        ("base_model.model.model.layers.1.mlp.up_proj.lora_B.default.weight", True),
        ("base_model.model.model.layers.1.mlp.down_proj.lora_A.default.weight", True),
        ("base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight", False),
        ("model.layers.0.input_layernorm.weight", False),
        ("model.embed_tokens.weight", False),
        ("lm_head.weight", False),
    ],
)
def test_which_tensors_are_split(name, split):
    assert split_over_tensor_parallel(name) is split


class OlderStridedShard(Shard):
    """torch before 2.13: FSDP's shard of a shard was a Shard subclass."""


def test_every_kind_of_shard_splits_and_copies_do_not():
    from torch.distributed.tensor.placement_types import _StridedShard

    assert splitting(Shard(0)) and splitting(_StridedShard(0, split_factor=2)) and splitting(OlderStridedShard(0))
    assert not splitting(Replicate()) and not splitting(Partial())
