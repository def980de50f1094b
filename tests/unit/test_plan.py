"""The run plan (litft.run.plan): each refusal of a combination, from the facts that trigger it, is its own one line, the
default facts pass every refusal, and what the plan decides (attention, rows, compile, kernels, engine) follows the machine."""

import dataclasses

import pytest

from litft.errors import LitftError
from litft.run.plan import PACKED, PACKED_WITH_BOUNDARIES, PADDED, REFUSALS, Facts, RunPlan, refuse


def test_the_default_facts_pass_and_every_refusal_has_a_name_of_its_own():
    refuse(Facts())
    names = [r.name for r in REFUSALS]
    assert len(names) == len(set(names)) and len(names) >= 30


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: r.name)
def test_each_refusal_is_one_line_from_the_facts_that_trigger_it(refusal, monkeypatch):
    monkeypatch.delenv("LITFT_FP8_EMULATE", raising=False)
    facts = dataclasses.replace(Facts(), **refusal.example)
    assert refusal.applies(facts) and not refusal.applies(Facts())
    message = refusal.says(facts)
    assert "\n" not in message and message.strip() == message and len(message) > 30
    with pytest.raises(LitftError) as err:  # the table's first refusal that applies is the one reported
        refuse(facts)
    first = next(r for r in REFUSALS if r.applies(facts))
    assert str(err.value) == first.says(facts)


def test_what_the_plan_decides_follows_the_machine_and_the_model():
    cpu = RunPlan.decide(Facts())
    assert (cpu.attention, cpu.rows, cpu.compile.enabled, cpu.liger, cpu.engine) == ("litft_segments", PACKED, False, False, None)
    assert RunPlan.decide(Facts(attention="sdpa")).rows == PADDED  # SDPA with a padding mask: a sample per row
    assert RunPlan.decide(Facts(carries_state=True, model_type="mamba2")).rows == PADDED
    packed = RunPlan.decide(Facts(carries_state=True, model_type="falcon_h1", boundary_kernels=("mamba_ssm", "causal_conv1d")))
    assert packed.rows == PACKED_WITH_BOUNDARIES and packed.boundary_kernels == ("mamba_ssm", "causal_conv1d")
    gpu = dict(accelerator="cuda", precision="bf16-mixed", installed=frozenset({"flash_attn", "liger_kernel", "vllm", "torchao"}),
               capability=(9, 0))
    on_gpu = RunPlan.decide(Facts(**gpu))
    assert on_gpu.attention == "flash_attention_2" and on_gpu.liger and not on_gpu.compile.enabled
    assert "docs/speed.md" in on_gpu.compile.line()
    assert RunPlan.decide(Facts(**{**gpu, "precision": "32-true"})).attention == "litft_segments"  # FlashAttention-2 takes no fp32
    assert RunPlan.decide(Facts(**gpu, fp8="rowwise")).compile.line().startswith("compile: on (auto with --fp8 rowwise")
    zero = RunPlan.decide(Facts(**gpu, strategy="DeepSpeed", strategy_compiles=False))  # auto falls back where --compile true is refused
    assert not zero.compile.enabled and "auto: not with DeepSpeed" in zero.compile.line()
    assert RunPlan.decide(Facts(compile="true")).compile.enabled and not RunPlan.decide(Facts(compile="false")).compile.enabled
    rl = dict(objective="grpo", data_kind="prompts", data="TinyPrompts")
    assert RunPlan.decide(Facts(**rl)).engine == "transformers"
    assert RunPlan.decide(Facts(**rl, **gpu)).engine == "vllm"  # auto: vLLM on a GPU where it is installed
    assert RunPlan.decide(Facts(**rl, **gpu, engine="transformers")).engine == "transformers"
    assert RunPlan.decide(Facts(**rl, **gpu, experts=True)).engine == "transformers"  # auto takes what vLLM can be handed
    assert RunPlan.decide(Facts(**rl, **gpu, quantize="bnb.nf4", lora=True)).engine == "transformers"
    assert "compile: off (auto: not with --objective grpo" in RunPlan.decide(Facts(**rl, **gpu)).compile.line()
    with pytest.raises(LitftError, match="--attn_implementation flash_attention_3 is unknown"):
        RunPlan.decide(Facts(attention="flash_attention_3"))
    lines = RunPlan.decide(Facts(**rl)).lines()
    assert any(line.startswith("attention: litft_segments") for line in lines) and "rollout engine: transformers" in " ".join(lines)
    assert not any(line.startswith("LoRA dropout") for line in lines)  # no adapters, no line
    lora = dict(lora=True, job="finetune_lora")
    assert any(line.startswith("LoRA dropout: off (peft's default") for line in RunPlan.decide(Facts(**lora)).lines())
    assert any(line.startswith("LoRA dropout: 0.05 (") for line in RunPlan.decide(Facts(**lora, lora_dropout=0.05)).lines())
    offload = RunPlan.decide(Facts(activation_offload=True, checkpointing=True, accelerator="cuda")).lines()
    assert any(line.startswith("activation offload: on, each block's input") and "pinned" in line for line in offload)
    assert any("saves nothing" in line for line in RunPlan.decide(Facts(activation_offload=True)).lines())
    assert any("stay whole" in line for line in RunPlan.decide(Facts(tiled_mlp=True, experts=True)).lines())
    assert not any(line.startswith(("activation offload", "tiled MLP")) for line in RunPlan.decide(Facts()).lines())
