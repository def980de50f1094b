"""The two speed paths that change what runs, not what is computed: compiled blocks and FP8 matmuls (torchao's emulation here)."""

import pytest
import torch

from litft.config import EvalArgs, TrainArgs
from litft.data import TinyTasks
from litft.model.fp8 import EMULATE_VARIABLE, converts
from litft.cli.jobs import finetune_full, finetune_lora
from tests.conftest import read_metrics, step_losses

QUIET = EvalArgs(interval=0, initial_validation=False, final_validation=False)


def test_compiled_blocks_match_eager_over_varying_lengths(tmp_path):
    """--compile true: every step's loss as eager blocks give it (1e-5), lengths changing each step; the four blocks share one
    compiled code (at most one recompile, when the length first changes), and the compile time is logged apart from the rates."""
    runs = {}
    for compiled in (False, True):
        out = tmp_path / f"compile-{compiled}"
        finetune_full(
            data=TinyTasks(num_train=48, num_val=8), out_dir=out, compile=compiled, precision="32-true",
            train=TrainArgs(global_batch_size=8, micro_batch_size=4, max_steps=5, learning_rate=3e-3, warmup_steps=1, log_interval=1), eval=QUIET,
        )
        runs[compiled] = read_metrics(out)
    eager, compiled = ([r["loss"] for r in runs[c] if "loss" in r] for c in (False, True))
    assert len(eager) == 5
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)
    last, last_eager = ([r for r in runs[c] if "loss" in r][-1] for c in (True, False))  # the steps' rows, not the save's
    assert last["compile_s"] > 0 and "compile_s" not in last_eager
    assert last["compiled_frames"] <= 2 and last["recompiles"] <= 1, last  # 4 blocks: one code, plus symbolic lengths once


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory, tiny_dir):
    """A random Llama whose MLP projections are wide enough for torchao's tensorwise rule (out 1280 > 1024) and whose other layers are not."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("fp8-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=1280, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(folder)
    return folder


def test_fp8_converts_torchaos_layers_and_never_the_head():
    """Both dimensions multiples of 16 and past torchao's size thresholds for the recipe; never the head or an adapter."""
    linear = lambda i, o: torch.nn.Linear(i, o, device="meta")  # noqa: E731
    head = linear(4096, 32000)
    assert converts(linear(256, 1280), "mlp.up_proj", "tensorwise", head)
    assert not converts(linear(1280, 256), "mlp.down_proj", "tensorwise", head)  # both small: the casts cost more than they save
    assert not converts(linear(256, 1288), "mlp.up_proj", "tensorwise", head)  # 1288 is not a multiple of 16
    assert not converts(head, "lm_head", "tensorwise", head)
    assert not converts(linear(8192, 4096), "q_proj.lora_A.default", "tensorwise", head)
    assert converts(linear(4096, 14336), "mlp.up_proj", "rowwise", head)
    assert not converts(linear(2048, 4096), "self_attn.q_proj", "rowwise", head)  # rowwise's thresholds are higher


def _fp8_run(model, out, fp8, steps=8, resume=None, lora=False, save_interval=None):
    job = finetune_lora if lora else finetune_full
    extra = dict(lora_dropout=0.0) if lora else {}
    return job(
        model=str(model), data=TinyTasks(num_train=96, num_val=8), out_dir=out, precision="bf16-true", fp8=fp8, resume=resume,
        train=TrainArgs(global_batch_size=8, micro_batch_size=4, max_steps=steps, learning_rate=2e-3, warmup_steps=1, log_interval=1,
                        save_interval=save_interval),
        eval=QUIET, **extra,
    )


def test_fp8_tracks_bf16_and_resumes_either_way(tmp_path, fp8_model, monkeypatch):
    """--fp8 tensorwise (torchao's emulation): the layers torchao's rule picks convert, the loss tracks bf16's, the checkpoint
    holds bf16 weights, and a run resumes from it with FP8 (exactly as if never stopped) or without it.

    The bound: e4m3 keeps 3 mantissa bits, so each operand rounds by up to 2^-4 relative; over a K-term dot product random
    rounding errors grow as sqrt(K) against the sum's K, about 0.4% at K = 256, and they compound over the layers, the
    backward's two matmuls and the steps. 8 steps stay within 2% of bf16's loss, which is itself 0.4% from fp32's here.
    """
    monkeypatch.setenv(EMULATE_VARIABLE, "1")
    fp8 = _fp8_run(fp8_model, tmp_path / "fp8", "tensorwise", save_interval=4)
    from torchao.float8.float8_linear import Float8Linear

    converted = sorted(n for n, m in fp8.model.named_modules() if isinstance(m, Float8Linear))
    assert converted == sorted(fp8.model.fp8_layers) == [f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj")]
    _fp8_run(fp8_model, tmp_path / "bf16", None)
    torch.testing.assert_close(step_losses(tmp_path / "fp8"), step_losses(tmp_path / "bf16"), rtol=0.02, atol=0)
    assert step_losses(tmp_path / "fp8") != step_losses(tmp_path / "bf16")  # FP8 did run
    assert {p.dtype for p in fp8.model.parameters()} == {torch.bfloat16}

    checkpoint = tmp_path / "fp8" / "checkpoints" / "step-00000004"
    _fp8_run(fp8_model, tmp_path / "fp8-resumed", "tensorwise", resume=str(checkpoint))
    assert step_losses(tmp_path / "fp8-resumed") == step_losses(tmp_path / "fp8")[4:]
    _fp8_run(fp8_model, tmp_path / "bf16-resumed", None, resume=str(checkpoint))
    torch.testing.assert_close(step_losses(tmp_path / "bf16-resumed"), step_losses(tmp_path / "fp8")[4:], rtol=0.02, atol=0)


def test_fp8_under_lora_converts_the_frozen_base_only(tmp_path, fp8_model, monkeypatch):
    """Under LoRA the base's wide projections run in FP8 and the adapters stay bf16 Linear layers that train."""
    monkeypatch.setenv(EMULATE_VARIABLE, "1")
    from torchao.float8.float8_linear import Float8Linear

    result = _fp8_run(fp8_model, tmp_path / "lora", "tensorwise", steps=3, lora=True)
    converted = {n for n, m in result.model.named_modules() if isinstance(m, Float8Linear)}
    assert converted and all(n.endswith("base_layer") and ".mlp." in n for n in converted), converted
    adapters = [m for n, m in result.model.named_modules() if n.endswith("lora_A.default")]
    assert adapters and all(type(m) is torch.nn.Linear and not m.weight.grad_fn for m in adapters)
    losses = step_losses(tmp_path / "lora")
    assert len(losses) == 3 and losses[-1] < losses[0]
