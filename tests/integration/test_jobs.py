"""Each job end to end in this process: it trains, and what it exports loads back into transformers."""

import json

import torch

from litft.config import EvalArgs, TrainArgs
from litft.data import TextFiles, TinyTasks
from litft.cli.jobs import finetune_full, finetune_lora, pretrain
from tests.conftest import read_metrics, step_losses

SMALL_DATA = dict(num_train=256, num_val=16)
TRAIN = TrainArgs(global_batch_size=16, micro_batch_size=8, max_steps=12, learning_rate=3e-3, warmup_steps=2)
EVAL = EvalArgs(interval=6, max_batches=2)


def logits_of(model, tokenizer):
    ids = torch.tensor([tokenizer("### Instruction:\nSort the letters.\n\n### Input:\nc a b")["input_ids"]])
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_finetune_full_learns_and_exports(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = finetune_full(data=TinyTasks(**SMALL_DATA), out_dir=tmp_path, train=TRAIN, eval=EVAL)
    losses = step_losses(tmp_path)
    assert len(losses) == 12 and losses[-1] < losses[0] - 1.0
    rows = read_metrics(tmp_path)
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 3 and val[-1] < val[0]
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_gb"] > 0 for r in rows if "tokens_per_s" in r)
    assert list((tmp_path / "logs" / "tensorboard").glob("events.out.tfevents.*"))

    final = tmp_path / "final"
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in final.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(final)
    torch.testing.assert_close(logits_of(loaded, tokenizer), logits_of(result.model, tokenizer), rtol=0, atol=1e-6)
    assert AutoTokenizer.from_pretrained(final)("a b c")["input_ids"] == tokenizer("a b c")["input_ids"]
    saved = (tmp_path / "run_config.yaml").read_text()
    assert "TinyTasks" in saved and "max_steps: 12" in saved


def test_finetune_lora_trains_adapters_only_and_merges(tmp_path, tiny_dir, tokenizer):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    result = finetune_lora(data=TinyTasks(**SMALL_DATA), out_dir=tmp_path, train=TRAIN, eval=EVAL, lora_r=4, lora_dropout=0.0, export="both")
    losses = step_losses(tmp_path)
    assert losses[-1] < losses[0]
    trained = {n for n, p in result.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    # The frozen base is untouched: its weights equal the checkpoint it came from.
    base_file = load_file(tiny_dir / "model.safetensors")
    state = result.model.get_base_model().state_dict()
    q_key = "model.layers.0.self_attn.q_proj.base_layer.weight"
    assert torch.equal(state[q_key], base_file["model.layers.0.self_attn.q_proj.weight"])

    adapter_cfg = json.loads((tmp_path / "final-adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 4
    expected = logits_of(result.model, tokenizer)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    torch.testing.assert_close(logits_of(merged, tokenizer), expected, rtol=1e-5, atol=1e-5)
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), tmp_path / "final-adapter")
    torch.testing.assert_close(logits_of(with_adapter, tokenizer), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits_of(AutoModelForCausalLM.from_pretrained(tiny_dir), tokenizer), expected)


def test_qlora_trains_on_4bit_base_and_exports_full_precision(tmp_path, tokenizer):
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    result = finetune_lora(
        data=TinyTasks(**SMALL_DATA), out_dir=tmp_path, train=TRAIN, eval=EVAL, quantize="bnb.nf4", lora_dropout=0.0, export="merged"
    )
    assert not (tmp_path / "final-adapter").exists() and result.final_dir == tmp_path / "final"
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in result.model.modules())
    losses = step_losses(tmp_path)
    assert losses[-1] < losses[0]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in merged.modules())
    assert "quantization_config" not in json.loads((tmp_path / "final" / "config.json").read_text())
    # Merged full-precision weights answer almost like the 4-bit model they were trained through.
    assert torch.allclose(logits_of(merged, tokenizer), logits_of(result.model, tokenizer), atol=0.5)


def test_pretrain_from_config_on_text(tmp_path, tiny_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    text = tmp_path / "corpus"
    text.mkdir()
    (text / "a.txt").write_text(" ".join("a b c d e f g h" for _ in range(400)))
    (text / "b.jsonl").write_text("\n".join(json.dumps({"text": "p o n m l k " * 20}) for _ in range(10)))
    out = tmp_path / "out"
    result = pretrain(
        model=str(tiny_dir / "config.json"), tokenizer=str(tiny_dir),
        data=TextFiles(train_data_path=text, max_seq_length=32, val_split_fraction=0.2),
        out_dir=out, train=TrainArgs(global_batch_size=8, micro_batch_size=4, max_steps=10, learning_rate=3e-3, warmup_steps=2),
        eval=EvalArgs(interval=0),
    )
    losses = step_losses(out)
    assert len(losses) == 10 and losses[-1] < losses[0] - 1.0
    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    # Random init from the config, not the tiny model's weights.
    assert not torch.equal(result.model.model.embed_tokens.weight, base.model.embed_tokens.weight)
    loaded = AutoModelForCausalLM.from_pretrained(out / "final")
    torch.testing.assert_close(logits_of(loaded, tokenizer), logits_of(result.model, tokenizer), rtol=0, atol=1e-6)


def test_max_tokens_and_epochs_end_the_run(tmp_path):
    finetune_full(
        data=TinyTasks(num_train=64, num_val=8), out_dir=tmp_path / "e",
        train=TrainArgs(global_batch_size=16, micro_batch_size=16, epochs=2, max_steps=None), eval=EvalArgs(interval=0, initial_validation=False),
    )
    assert len(step_losses(tmp_path / "e")) == 8
    # max_steps alone runs past the end of the first epoch into a reshuffled second one.
    finetune_full(
        data=TinyTasks(num_train=64, num_val=8), out_dir=tmp_path / "s",
        train=TrainArgs(global_batch_size=16, micro_batch_size=16, max_steps=6), eval=EvalArgs(interval=0, initial_validation=False),
    )
    assert [r["epoch"] for r in read_metrics(tmp_path / "s") if "loss" in r] == [0, 0, 0, 0, 1, 1]
    finetune_full(
        data=TinyTasks(num_train=64, num_val=8), out_dir=tmp_path / "t",
        train=TrainArgs(global_batch_size=16, micro_batch_size=16, epochs=None, max_tokens=1000), eval=EvalArgs(interval=0, initial_validation=False),
    )
    tokens = [r["tokens"] for r in read_metrics(tmp_path / "t") if "tokens" in r]
    assert tokens[-1] >= 1000 and tokens[-2] < 1000


def test_score_measures_exact_match(tmp_path):
    finetune_full(
        data=TinyTasks(num_train=64, num_val=8), out_dir=tmp_path,
        train=TrainArgs(global_batch_size=16, micro_batch_size=16, max_steps=1), eval=EvalArgs(interval=0, score_samples=8),
    )
    scores = [r["val_score"] for r in read_metrics(tmp_path) if "val_score" in r]
    assert len(scores) == 2 and all(0.0 <= s <= 1.0 for s in scores)
    assert scores[0] == 0.0  # a random model answers nothing right


def test_bf16_true_keeps_rotary_frequencies_fp32(tmp_path, tiny_dir):
    """bf16-true casts the module, buffers too; the rotary frequencies are recomputed in fp32 after the cast."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    result = finetune_lora(
        data=TinyTasks(num_train=32, num_val=8), out_dir=tmp_path, precision="bf16-true", lora_r=4,
        train=TrainArgs(global_batch_size=8, micro_batch_size=8, max_steps=1), eval=EvalArgs(interval=0, initial_validation=False),
    )
    rotary = [m for m in result.model.modules() if isinstance(m, LlamaRotaryEmbedding)]
    expected = LlamaRotaryEmbedding(AutoConfig.from_pretrained(tiny_dir)).inv_freq
    assert rotary and expected.dtype == torch.float32
    for module in rotary:
        assert module.inv_freq.dtype == torch.float32 and torch.equal(module.inv_freq, expected)
    assert {p.dtype for n, p in result.model.named_parameters() if "lora_" not in n} == {torch.bfloat16}
