"""Preference tuning under every strategy against one process on the same global batch, and a precomputed reference resumed.

Per-step loss (1e-5), the logged preference figures and every exported weight match one process; the exactness of the
objectives themselves against an independent implementation is tests/unit/test_preference.py's. DPO stands for every
objective here: they differ only in the formula applied to the same per-pair sums, which the unit tests check each of.
"""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.batch import Batch
from litft.launch.launchers import free_port
from tests.conftest import ROOT, read_metrics, step_losses

COMMON = [
    "--data.num_train", "32", "--data.num_val", "8", "--train.global_batch_size", "8", "--train.max_steps", "3",
    "--train.learning_rate", "3e-3", "--train.warmup_steps", "1", "--eval.interval", "0", "--eval.initial_validation", "false",
    "--precision", "32-true", "--accelerator", "cpu", "--logger_name", "csv",
]
JOBS = {
    "lora-dpo": ("finetune_lora", ["--objective", "dpo", "--lora_r", "4", "--lora_dropout", "0", "--export", "merged"]),
    "full-dpo": ("finetune_full", ["--objective", "dpo"]),  # the reference scored before training
    "moe-dpo": ("finetune_full", ["--objective", "dpo"]),
}
MODELS = {"moe-dpo": ["litft-tiny-moe"]}  # the model, given before the flags; litft-tiny otherwise
TWO = ["--devices", "2", "--train.micro_batch_size", "2"]
CASES = {
    "zero3-lora-dpo": ("lora-dpo", ["--strategy", "deepspeed", "--deepspeed.stage", "3", *TWO]),
    "zero2-full-dpo": ("full-dpo", ["--strategy", "deepspeed", "--deepspeed.stage", "2", *TWO]),
    # Experts under context parallel: both ranks of the group route their slice of every pair (the router's balance loss
    # is off in litft-tiny-moe, as in most MoE configs; under CP it is each slice's share, not exact: docs/parallelism.md).
    "cp2-moe-dpo": ("moe-dpo", ["--strategy", "fsdp", "--context_parallel", "2", *TWO]),
}
FIGURES = ("preference_accuracy", "reward_margin", "logp_chosen")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each job trained once by one process (micro-batches of 4), then the sharded cases and the DDP run stopped and
    resumed: two batches of long-lived processes (tests/batch.py)."""
    batch = Batch(tmp_path_factory.mktemp("preference"))
    for name, (job, flags) in JOBS.items():
        batch.add(f"single-{name}", 1, job, *MODELS.get(name, []), *COMMON, *flags, "--train.micro_batch_size", "4")
    for case, (name, flags) in CASES.items():
        batch.add(case, 2, JOBS[name][0], *MODELS.get(name, []), *COMMON, *JOBS[name][1], *flags)
    job, flags = JOBS["full-dpo"]
    flags = [*COMMON, *flags, "--strategy", "ddp", *TWO]
    stopped = batch.add("ddp-stopped", 2, job, *flags, "--train.stop_after_steps", "1")
    batch.add("ddp-resumed", 2, job, *flags, "--resume", "auto", out=stopped)
    return batch


@pytest.fixture(scope="module")
def single(runs):
    return lambda name: runs.out(f"single-{name}")


def figures(run):
    """The logged figures, but the first step's accuracy: there the policy is its own reference, every margin is 0 up to
    rounding, and which side of 0 a sum in another order lands on is noise."""
    return [r[key] for key in FIGURES for r in read_metrics(run) if "loss" in r and (key != "preference_accuracy" or r["step"] > 1)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_preference_runs_match_one_process(case, runs, single):
    name, _ = CASES[case]
    reference, tmp_path = single(name), runs.out(case)
    expected, got = step_losses(reference), step_losses(tmp_path)
    assert len(got) == len(expected) == 3 and all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(expected, got)), (expected, got)
    assert figures(tmp_path) == pytest.approx(figures(reference), rel=1e-4, abs=1e-6) and len(figures(reference)) == 8
    val = lambda run: [r["val_preference_accuracy"] for r in read_metrics(run) if "val_preference_accuracy" in r]  # noqa: E731
    assert val(tmp_path) == val(reference) and len(val(reference)) == 1
    ours, theirs = load_file(tmp_path / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-4, msg=key)


def test_hybrid_shard_over_two_launches_with_context_parallel_matches_one_process(single, tmp_path):
    """Two launches on 127.0.0.1 (node ranks 0 and 1) x 2 processes: FSDP's HYBRID_SHARD shards inside a node and
    replicates across, and each node's two ranks are a context group that scores and trains a slice of every pair."""
    job, flags = JOBS["full-dpo"]
    args = [sys.executable, "-m", "litft", job, *COMMON, *flags, "--strategy", "fsdp", "--devices", "2", "--num_nodes", "2",
            "--context_parallel", "2", "--train.micro_batch_size", "2", "--out_dir", str(tmp_path)]
    port = str(free_port())
    nodes = [subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(rank))) for rank in (1, 0)]
    logs = [node.communicate(timeout=400)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), logs[1][-3000:] + logs[0][-3000:]
    reference = single("full-dpo")
    expected, got = step_losses(reference), step_losses(tmp_path)
    assert len(got) == 3 and all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(expected, got)), (expected, got)
    assert figures(tmp_path) == pytest.approx(figures(reference), rel=1e-4, abs=1e-6)
    ours, theirs = load_file(tmp_path / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-4, msg=key)


def test_a_precomputed_reference_resumes_without_scoring_again(runs, single):
    """Under DDP, stopped after a step and resumed: the losses of one uninterrupted process, the reference read from the checkpoint."""
    tmp_path = runs.out("ddp-resumed")
    assert "pairs scored by the initial model" in runs.output("ddp-stopped")
    assert (tmp_path / "checkpoints" / "step-00000001" / "reference_logps.pt").is_file()
    said = runs.output("ddp-resumed")
    assert "reference log-probs of 40 pairs read from" in said and "scored by the initial model" not in said
    expected = step_losses(single("full-dpo"))
    got = step_losses(tmp_path)
    assert len(got) == 3 and all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(expected, got)), (expected, got)
