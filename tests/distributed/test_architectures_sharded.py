"""Architectures beyond Llama under FSDP's fill and the mesh, against one process on the same global batch: a windowed model
under context parallel, a MoE with per-head norms and a model with fused projections under tensor parallel."""

import pytest
import torch
from safetensors.torch import load_file

from tests.architectures import ARCHITECTURES, save_tiny
from tests.batch import Batch
from tests.conftest import read_metrics, step_losses

COMMON = [
    "--data", "TinyTasks", "--data.num_train", "32", "--data.num_val", "8", "--train.global_batch_size", "8",
    "--train.max_steps", "3", "--train.learning_rate", "3e-3", "--train.warmup_steps", "1", "--eval.interval", "0",
    "--eval.initial_validation", "false", "--eval.final_validation", "false", "--precision", "32-true", "--accelerator", "cpu",
    "--logger_name", "csv",
]
TP2 = ["--strategy", "fsdp", "--devices", "2", "--tensor_parallel", "2", "--train.micro_batch_size", "4"]
CASES = {
    "cp2-window": ("mistral (window)", ["--strategy", "fsdp", "--devices", "2", "--context_parallel", "2", "--train.micro_batch_size", "4"]),
    # Split as the model's own plan says: Qwen3-MoE's per-head q/k norms have their gradient summed over the group and its
    # experts stay whole (hub layout, converted on load); Phi-3's fused qkv and gate_up projections are gathered after the split.
    "tp2-moe": ("qwen3-moe", TP2),
    "tp2-fused": ("phi3", TP2),
    "zero3-moe": ("qwen3-moe", ["--strategy", "deepspeed", "--deepspeed.stage", "3", "--devices", "2", "--train.micro_batch_size", "4"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each model saved once and trained by one process (micro-batches of 4), then every sharded case: two batches of
    long-lived processes (tests/batch.py)."""
    batch = Batch(tmp_path_factory.mktemp("architectures"))
    for name in sorted({name for name, _ in CASES.values()}):
        folder = save_tiny(next(a for a in ARCHITECTURES if a.name == name), batch.root / f"model-{name.split()[0]}")
        batch.add(f"single-{name.split()[0]}", 1, "finetune_full", folder, *COMMON, "--train.micro_batch_size", "4")
    for case, (name, flags) in CASES.items():
        batch.add(case, 2, "finetune_full", batch.root / f"model-{name.split()[0]}", *COMMON, *flags)
    return batch


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_runs_of_other_architectures_match_one_process(case, runs):
    name, _ = CASES[case]
    reference, sharded = runs.out(f"single-{name.split()[0]}"), runs.out(case)
    expected, got = step_losses(reference), step_losses(sharded)
    assert len(got) == len(expected) == 3 and abs(got[0] - expected[0]) <= 1e-5 * abs(expected[0])
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(expected, got)), (expected, got)
    norms = lambda run: [r["grad_norm"] for r in read_metrics(run) if "loss" in r]  # noqa: E731 (logged under every strategy)
    assert norms(sharded) == pytest.approx(norms(reference), rel=1e-4) and len(norms(reference)) == 3
    if "moe" in case:  # the router's balance summed over the ranks is the one process's (a TP group counts each token twice alike)
        balance = lambda run: [r[key] for key in ("expert_imbalance_max", "experts_idle") for r in read_metrics(run) if "loss" in r]  # noqa: E731
        assert balance(sharded) == pytest.approx(balance(reference), rel=1e-9) and len(balance(reference)) == 6
    ours, theirs = load_file(sharded / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-4, msg=key)
