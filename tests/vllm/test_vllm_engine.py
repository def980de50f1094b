"""GRPO with vLLM as the rollout engine, for real (vLLM's CPU build, in each rank's own process), on a tiny Llama whose
heads are 64 wide (vLLM's CPU attention takes no narrower ones), with litft-tiny's tokenizer.

What is checked: the rollouts come from vLLM (every token's log-prob beside it); after every optimizer step the trained
weights reach the engine, so the engine's log-prob of each token it sampled equals the trainer's at its first forward
within 1e-5 in fp32 (the two sum in other orders; a run whose weights are not pushed after the first step is 1e-3 or more
off at a learning rate of 0.1); full fine-tuning and LoRA (merged into the served weights); FSDP on 2 ranks against one
process (the same rollouts: each completion is a request with a seed of its own); a run stopped after its first step and
resumed against the uninterrupted one.

These tests need vLLM and run in the environment that has it (``.ci/run``'s second venv); elsewhere they skip, unless
LITFT_REQUIRE_VLLM=1 says they must run.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import read_metrics, run_cli, step_losses

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("LITFT_REQUIRE_VLLM") == "1":
        raise RuntimeError("LITFT_REQUIRE_VLLM=1 but vLLM is not installed here")
    pytest.skip("vLLM is not installed here (.ci/run tests it in a venv of its own)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--objective", "grpo", "--objective.engine", "vllm", "--objective.group_size", "4", "--objective.max_new_tokens", "8",
          "--objective.rewards", "format", "--objective.format_pattern", ".*[aeiou].*", "--objective.temperature", "0.7",
          "--data", "TinyPrompts", "--data.num_train", "16", "--data.num_val", "4", "--train.global_batch_size", "4",
          "--train.max_steps", "3", "--train.learning_rate", "0.1", "--train.warmup_steps", "1", "--eval.interval", "0",
          "--eval.initial_validation", "false", "--precision", "32-true", "--accelerator", "cpu", "--logger_name", "csv"]
FULL = ("finetune_full", [])
LORA = ("finetune_lora", ["--lora_r", "4", "--lora_dropout", "0"])
STALE = """
import sys
from litft.rl.vllm_engine import VLLMEngine
sync = VLLMEngine.sync
def first_only(self, weights, version):  # what a run whose weights never reach the engine after its first push samples with
    if self.version is None:
        return sync(self, weights, version)
    for _ in weights:  # every rank still walks the weights (their gathers are collectives)
        pass
VLLMEngine.sync = first_only
from litft.__main__ import main
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A two-layer Llama with two 64-wide heads and litft-tiny's tokenizer, saved as a Hugging Face folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from litft.model.tiny import ensure_tiny_model

    folder = tmp_path_factory.mktemp("vllm-model")
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def rollouts(out_dir):
    return {path.name: [json.loads(line) for line in path.read_text().splitlines()] for path in sorted((out_dir / "rollouts").glob("*.jsonl"))}


def gaps(out_dir):
    return [r["sampler_logprob_gap"] for r in read_metrics(out_dir) if "sampler_logprob_gap" in r]


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-runs")
    done = {}
    for name, job, extra in (("full", FULL, ["--train.micro_batch_size", "8"]), ("lora", LORA, ["--train.micro_batch_size", "8"]),
                             ("fsdp", FULL, ["--strategy", "fsdp", "--devices", "2", "--train.micro_batch_size", "4"])):
        run_cli(job[0], model, *job[1], *COMMON, *extra, "--out_dir", root / name, timeout=900)
        done[name] = root / name
    return done


@pytest.mark.parametrize("name", ["full", "lora"])
def test_the_engine_samples_with_the_weights_of_every_step(runs, name):
    out = runs[name]
    sampled = rollouts(out)
    assert sorted(sampled) == ["step-1.jsonl", "step-2.jsonl", "step-3.jsonl"]
    for rows in sampled.values():
        assert len(rows) == 16 and all(len(r["logprobs"]) == len(r["completion_ids"]) > 0 for r in rows)
    found = gaps(out)
    assert len(found) == 3 and all(gap < 1e-5 for gap in found), found
    ratios = [r["is_ratio_max"] for r in read_metrics(out) if "is_ratio_max" in r]
    assert len(ratios) == 3 and all(abs(ratio - 1) < 1e-4 for ratio in ratios), ratios  # no token's weight moved


def test_weights_not_pushed_after_the_first_step_show_in_the_gap(model, tmp_path):
    """The same full run with the engine kept on the first step's weights: the gap is what the sync test would catch."""
    script = tmp_path / "stale.py"
    script.write_text(STALE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(script), FULL[0], model, *COMMON, "--train.micro_batch_size", "8", "--out_dir",
                           tmp_path / "out"], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = gaps(tmp_path / "out")
    assert found[0] < 1e-5 and all(gap > 1e-3 for gap in found[1:]), found


def test_two_fsdp_ranks_sample_and_train_as_one_process(runs):
    one, two = rollouts(runs["full"]), rollouts(runs["fsdp"])
    assert sorted(one) == sorted(two)
    for name in one:
        for a, b in zip(one[name], two[name]):
            assert a["completion_ids"] == b["completion_ids"] and a["reward"] == b["reward"]
            assert b["logprobs"] == pytest.approx(a["logprobs"], rel=1e-4, abs=1e-5)
    a, b = step_losses(runs["full"]), step_losses(runs["fsdp"])
    assert len(a) == len(b) == 3 and all(abs(x - y) <= 1e-5 * abs(x) + 1e-6 for x, y in zip(a, b)), (a, b)
    assert all(gap < 1e-5 for gap in gaps(runs["fsdp"]))


def test_a_run_stopped_after_its_first_step_resumes_as_if_never_stopped(runs, model, tmp_path):
    out = tmp_path / "resumed"
    run_cli(FULL[0], model, *COMMON, "--train.micro_batch_size", "8", "--train.stop_after_steps", "1", "--out_dir", out, timeout=900)
    run_cli(FULL[0], model, *COMMON, "--train.micro_batch_size", "8", "--resume", "auto", "--out_dir", out, timeout=900)
    assert rollouts(out) == rollouts(runs["full"])
    a, b = step_losses(runs["full"]), step_losses(out)
    assert len(a) == len(b) == 3 and all(abs(x - y) <= 1e-6 * abs(x) + 1e-7 for x, y in zip(a, b)), (a, b)
