"""FLOPs per token against torch's own count, peak FLOP/s lookup, and the shipped model shapes."""

from pathlib import Path

import pytest
import torch

from litft.run.build import enable_checkpointing
from litft.errors import LitftError
from litft.model.flops import flops_per_token
from litft.model.peaks import PEAK_TFLOPS, device_key, mfu, peak_flops, precision_key

MODELS = Path(__file__).resolve().parents[2] / "config_hub" / "models"
SEQ, BATCH = 64, 2


@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: two threads on a shared 2-core machine only fight (10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_config(kind="llama"):
    """A few-layer model with GQA; eager attention, because FlopCounterMode does not count the CPU SDPA kernel."""
    from transformers import GPTNeoXConfig, LlamaConfig, Qwen2Config

    common = dict(vocab_size=384, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  max_position_embeddings=256, attn_implementation="eager")
    if kind == "llama":  # litft-tiny's shape: tied embeddings, 2 kv heads
        return LlamaConfig(num_key_value_heads=2, tie_word_embeddings=True, **common)
    if kind == "qwen2":  # untied head, biases on q/k/v
        return Qwen2Config(num_key_value_heads=2, tie_word_embeddings=False, **common)
    return GPTNeoXConfig(**common)  # plain (ungated) MLP, fused qkv


def counted_flops_per_token(model) -> float:
    """What torch.utils.flop_counter sees in one forward + backward of a batch."""
    from torch.utils.flop_counter import FlopCounterMode

    model.train()
    ids = torch.randint(0, 384, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return counter.get_total_flops() / (BATCH * SEQ)


def build(config, checkpointing=False):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if checkpointing:
        enable_checkpointing(model)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt_neox"])
def test_full_training_matches_flop_counter(kind):
    config = small_config(kind)
    assert flops_per_token(config, SEQ) == pytest.approx(counted_flops_per_token(build(config)), rel=0.01)


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"], ["gate_proj", "up_proj", "down_proj"]])
def test_lora_matches_flop_counter(targets):
    from litft.config import LoraArgs
    from litft.model.lora import apply_lora

    config = small_config()
    model = apply_lora(build(config), LoraArgs(8, 16, 0.0, targets))
    expected = flops_per_token(config, SEQ, trained="lora", lora_r=8, lora_targets=targets)
    assert expected == pytest.approx(counted_flops_per_token(model), rel=0.01)
    # The frozen base needs input gradients only: well under full training's 3x forward.
    assert expected < 0.8 * flops_per_token(config, SEQ)


def test_recompute_counts_the_hardware_work_of_activation_checkpointing():
    from litft.config import LoraArgs
    from litft.model.lora import apply_lora

    config = small_config()
    full = flops_per_token(config, SEQ, recompute=True)
    assert full == pytest.approx(counted_flops_per_token(build(config, checkpointing=True)), rel=0.01)
    assert full > flops_per_token(config, SEQ)  # MFU's count leaves the recomputation out
    targets = ["q_proj", "v_proj"]
    model = apply_lora(build(config, checkpointing=True), LoraArgs(8, 16, 0.0, targets))
    lora = flops_per_token(config, SEQ, trained="lora", lora_r=8, lora_targets=targets, recompute=True)
    assert lora == pytest.approx(counted_flops_per_token(model), rel=0.01)


def test_causal_counts_half_the_attention_square():
    config = small_config()
    square = flops_per_token(config, SEQ) - flops_per_token(config, SEQ, causal=True)
    # Q K^T and P V over half of SEQ keys, forward and 2x backward, every layer.
    assert square == 3 * 4 * (2 * 2 * 4 * 32 * SEQ / 2)


def test_bad_arguments_are_one_line_errors():
    config = small_config()
    with pytest.raises(LitftError, match="lora_r"):
        flops_per_token(config, SEQ, trained="lora")
    with pytest.raises(LitftError, match="embed_tokens"):
        flops_per_token(config, SEQ, trained="lora", lora_r=8, lora_targets=["embed_tokens"])
    moe = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10, "num_local_experts": 8}
    with pytest.raises(LitftError, match="MoE config names no num_experts_per_tok"):
        flops_per_token(moe, SEQ)
    # A token runs through its top-2 experts: the FLOPs of a dense model with an MLP twice as wide, plus the router.
    dense = dict(moe, intermediate_size=256, num_local_experts=0)
    router = 3 * 2 * 2 * 64 * 8  # forward and 2x backward, 2 layers, hidden x 8 experts
    assert flops_per_token(dict(moe, intermediate_size=128, num_experts_per_tok=2), SEQ) == flops_per_token(dense, SEQ) + router


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100-SXM4-40GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA GeForce RTX 3090", "RTX 3090"),
        ("Tesla V100-SXM2-32GB", "V100 SXM2"),
        ("Tesla V100-PCIE-16GB", "V100 PCIe"),
        ("AMD Instinct MI300X", "MI300X"),
        # Other parts whose names contain a listed one: not guessed.
        ("NVIDIA GB200", None),
        ("NVIDIA L40", None),
        ("NVIDIA GeForce RTX 3090 Ti", None),
        ("NVIDIA GeForce RTX 4090 D", None),
        ("NVIDIA A100X", None),
        ("cpu", None),
        ("", None),
    ],
)
def test_device_names(name, key):
    assert device_key(name) == key


def test_peak_flops_and_mfu():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989.5e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16-true") == 756.5e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "16-mixed") == 312e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "32-true") == 19.5e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16-mixed") is None  # Volta has no bf16
    assert peak_flops("cpu", "32-true") is None
    assert peak_flops("Some Future GPU", "bf16-mixed") is None
    assert peak_flops("cpu", "32-true", override_tflops=2.5) == 2.5e12
    with pytest.raises(LitftError):
        peak_flops("cpu", "32-true", override_tflops=0)
    assert mfu(1000.0, 6e9, 989.5e12) == pytest.approx(6e12 / 989.5e12)
    assert mfu(1000.0, 6e9, None) is None
    assert [precision_key(p) for p in ("bf16-mixed", "bf16-true", "16-mixed", "32-true", "tf32", "transformer-engine")] == [
        "bf16", "bf16", "fp16", "fp32", "tf32", None
    ]
    # Every entry has the four columns; sparse figures (2x) never crept in: bf16 equals fp16 wherever both exist.
    for key, peaks in PEAK_TFLOPS.items():
        assert set(peaks) == {"bf16", "fp16", "tf32", "fp32"}, key
        assert peaks["bf16"] in (None, peaks["fp16"]), key


@pytest.mark.parametrize(
    "name, params",
    [
        ("llama-3.2-1b", 1_235_814_400),
        ("llama-3.1-8b", 8_030_261_248),
        ("llama-3.1-70b", 70_553_706_496),
        ("qwen2.5-7b", 7_615_616_512),
        ("mistral-7b", 7_248_023_552),
        ("qwen3-30b-a3b", 30_532_122_624),  # 3.3B active: 8 of 128 experts per token
    ],
)
def test_shipped_configs_have_the_published_sizes(name, params):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(MODELS / name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == params
    # The usual rule of thumb: about 6 FLOPs per parameter and token at short sequences (per active parameter for a MoE).
    active = params if name != "qwen3-30b-a3b" else 3.35e9
    assert flops_per_token(config, 128) == pytest.approx(6 * active, rel=0.25)


def test_step_flops_are_flops_per_token_at_the_row_length():
    """The loop's two coefficients reproduce flops_per_token at any sample length, for full training and LoRA."""
    from litft.model.flops import StepFlops

    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 160, "vocab_size": 300}
    for kind in ({}, {"trained": "lora", "lora_r": 4, "lora_targets": ["q_proj", "v_proj"]}):
        step = StepFlops(config, peak=None, **kind)
        for length in (1, 37, 512):
            assert step.of_row(length) == pytest.approx(length * flops_per_token(config, length, **kind), rel=1e-12)
