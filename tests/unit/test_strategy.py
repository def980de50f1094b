"""Layout checks and DeepSpeed configs, decided before any process starts."""

import json
from pathlib import Path

import pytest

from litft.config import DeepSpeedArgs, FSDPArgs, Layout, TrainArgs
from litft.errors import LitftError
from litft.parallel.mesh import Mesh
from litft.parallel.strategies import FSDP
from litft.parallel.strategies import checked_strategy_class
from litft.parallel.strategies.deepspeed_config import deepspeed_config

ROOT = Path(__file__).resolve().parents[2]
TRAIN = TrainArgs(global_batch_size=32, micro_batch_size=2, max_norm=0.5)


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "config_hub" / "deepspeed").glob("*.json")))
def test_shipped_deepspeed_configs_take_litft_values(name):
    config = deepspeed_config(DeepSpeedArgs(config=ROOT / "config_hub" / "deepspeed" / name), TRAIN, Layout("deepspeed", 8), "bf16-mixed")
    assert config["train_batch_size"] == 32 and config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 2
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    stage = config["zero_optimization"]["stage"]
    # Stage 0 clips in litft (DeepSpeed's own stage-0 clipping had no effect in our runs).
    assert config["gradient_clipping"] == (0.0 if stage == 0 else 0.5)
    assert "auto" not in json.dumps(config)


def test_flags_make_the_zero_section():
    config = deepspeed_config(DeepSpeedArgs(stage=3, offload_optimizer="nvme", offload_parameters="cpu"), TRAIN, Layout("deepspeed", 4), "32-true")
    assert config["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"},
        "offload_param": {"device": "cpu"},
    }


@pytest.mark.parametrize(
    "content, message",
    [
        ({"train_micro_batch_size_per_gpu": 4}, "sets train_micro_batch_size_per_gpu to 4 but litft's flags give 2"),
        ({"bf16": {"enabled": True}}, "sets bf16.enabled to true but --precision is 32-true"),
        ("{not json", "is not valid JSON (line 1"),
    ],
)
def test_user_config_that_disagrees_is_refused(tmp_path, content, message):
    path = tmp_path / "ds.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(LitftError, match=message.replace("(", r"\(")):
        deepspeed_config(DeepSpeedArgs(config=path), TRAIN, Layout("deepspeed", 8), "32-true")


@pytest.mark.parametrize(
    "kind, devices, nodes, shard_size, shape",
    [
        ("FULL_SHARD", 4, 2, None, (1, 8)),
        ("SHARD_GRAD_OP", 2, 1, None, (1, 2)),
        ("NO_SHARD", 4, 1, None, (4, 1)),
        ("HYBRID_SHARD", 4, 2, None, (2, 4)),  # one shard group per node
        ("HYBRID_SHARD", 8, 2, 4, (4, 4)),
    ],
)
def test_fsdp_mesh_is_replicate_by_shard(kind, devices, nodes, shard_size, shape):
    layout = Layout("fsdp", devices, nodes, FSDPArgs(sharding_strategy=kind, shard_size=shard_size), DeepSpeedArgs())
    checked_strategy_class(layout, "cpu", "32-true")
    mesh = Mesh.of(layout, FSDP)
    assert (mesh.replicas, mesh.shard) == shape and mesh.world == devices * nodes


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_generated_zero_config_overlaps_communication_in_buckets_sized_to_the_model(stage):
    zero = deepspeed_config(DeepSpeedArgs(stage=stage), TRAIN, Layout("deepspeed", 8), "bf16-mixed", hidden_size=4096)["zero_optimization"]
    assert zero["overlap_comm"] is True and zero["contiguous_gradients"] is True
    assert zero["reduce_bucket_size"] == 4096**2  # 32 MiB in bf16, where DeepSpeed's default is 1 GB
    if stage == 3:
        assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 4096**2) and zero["stage3_param_persistence_threshold"] == 40960
    else:
        assert zero["allgather_bucket_size"] == 4096**2


def test_user_zero_config_keeps_its_values_and_fills_auto(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": False, "reduce_bucket_size": "auto"}}))
    zero = deepspeed_config(DeepSpeedArgs(config=path), TRAIN, Layout("deepspeed", 8), "bf16-mixed", hidden_size=1024)["zero_optimization"]
    assert zero["overlap_comm"] is False and zero["reduce_bucket_size"] == 1024**2 and zero["allgather_bucket_size"] == 1024**2


def test_gpu_process_groups_carry_gloo_for_cpu_tensors():
    """Offloaded FSDP gradients are clipped and checked on the CPU: an NCCL-only group has no backend for them."""
    from litft.parallel.strategies import DeepSpeed, FSDP

    offload = Layout("fsdp", 8, 1, FSDPArgs(cpu_offload=True), DeepSpeedArgs())
    fsdp = FSDP(offload, "cuda", "bf16-mixed", TRAIN)
    assert fsdp.backend == "cuda:nccl,cpu:gloo" and fsdp.host_device == "cpu"
    assert FSDP(offload, "cpu", "32-true", TRAIN).backend == "gloo"
    zero = DeepSpeed(Layout("deepspeed", 8, 1, FSDPArgs(), DeepSpeedArgs(stage=3)), "cuda", "bf16-mixed", TRAIN)
    assert zero.backend == "nccl" and zero.host_device == "cuda"  # DeepSpeed's communication layer takes one backend
