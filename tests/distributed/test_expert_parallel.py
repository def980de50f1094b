"""Expert parallel against one process on the same global batch, and a checkpoint written under it resumed without it.

Mixtral's tiny model (4 experts, 2 per token, hub layout): expert groups of 2 under HYBRID_SHARD over two launches with a
context group on the same ranks, and of 4 (every rank holds one expert) for LoRA, whose adapters stay whole while the
frozen experts are dealt out. Per-step loss (1e-5), gradient norm and the router's balance summed over the ranks (which
counts each token where it was routed, before the dispatch; context parallel's padding is routed as well, so not there),
and every exported weight (1e-4) equal one process's.
The bf16 precisions of expert parallel run in tests/distributed/test_precision_matrix.py.
"""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from litft.cli.selfcheck import free_port
from tests.architectures import ARCHITECTURES, save_tiny
from tests.conftest import ROOT, read_metrics, run_cli, step_losses

COMMON = [
    "--data", "TinyTasks", "--data.num_train", "32", "--data.num_val", "8", "--train.global_batch_size", "8",
    "--train.max_steps", "3", "--train.learning_rate", "3e-3", "--train.warmup_steps", "1", "--eval.interval", "0",
    "--eval.initial_validation", "false", "--eval.final_validation", "false", "--precision", "32-true", "--accelerator", "cpu",
    "--logger_name", "csv", "--train.save_interval", "2",
]
JOBS = {
    "full": ("finetune_full", [], "final/model.safetensors"),
    "lora": ("finetune_lora", ["--lora_r", "4", "--lora_dropout", "0", "--export", "adapter"], "final-adapter/adapter_model.safetensors"),
}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The model saved once, and each job trained once by one process (micro-batches of 2), shared by the tests."""
    root = tmp_path_factory.mktemp("experts")
    model = save_tiny(next(a for a in ARCHITECTURES if a.name == "mixtral"), root / "model")
    done = {}

    def get(name):
        if name not in done:
            job, flags, _ = JOBS[name]
            run_cli(job, model, *COMMON, *flags, "--train.micro_batch_size", "2", "--out_dir", root / name)
            done[name] = root / name
        return model, done[name]

    return get


def assert_matches(name, reference, run, balance=True):
    expected, got = step_losses(reference), step_losses(run)
    assert len(got) == len(expected) == 3 and all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(expected, got)), (expected, got)
    logged = lambda run, key: [r[key] for r in read_metrics(run) if "loss" in r]  # noqa: E731
    assert logged(run, "grad_norm") == pytest.approx(logged(reference, "grad_norm"), rel=1e-4)
    for key in ("expert_imbalance_max", "experts_idle", "expert_imbalance/layer_1") if balance else ():
        assert logged(run, key) == pytest.approx(logged(reference, key), rel=1e-9) and len(logged(reference, key)) == 3, key
    exported = JOBS[name][2]
    ours, theirs = load_file(run / exported), load_file(reference / exported)
    assert ours.keys() == theirs.keys() and any("experts" in key for key in ours)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-4, msg=key)


def test_expert_groups_of_two_over_two_launches_with_context_parallel_match_one_process_and_resume_in_one(single, tmp_path):
    """Two launches on 127.0.0.1 (node ranks 0 and 1) x 2 processes: each node's ranks are an expert group and a context group,
    and HYBRID_SHARD replicates the experts across nodes; its step-2 checkpoint then resumes in one process (no expert parallel)."""
    model, reference = single("full")
    args = [sys.executable, "-m", "litft", "finetune_full", model, *COMMON, "--strategy", "fsdp", "--devices", "2", "--num_nodes", "2",
            "--expert_parallel", "2", "--context_parallel", "2", "--train.micro_batch_size", "2", "--out_dir", tmp_path / "ep2"]
    port = str(free_port())  # below the ephemeral range, which the gloo connections of earlier runs take ports from
    nodes = [subprocess.Popen(list(map(str, args)), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(rank))) for rank in (1, 0)]
    logs = [node.communicate(timeout=400)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), logs[1][-3000:] + logs[0][-3000:]
    assert "dealt out over 2 ranks (2 of 4 per rank" in logs[1]
    assert_matches("full", reference, tmp_path / "ep2", balance=False)  # context parallel's row padding is routed too

    checkpoint = tmp_path / "ep2" / "checkpoints" / "step-00000002"
    run_cli("finetune_full", model, *COMMON, "--train.micro_batch_size", "2", "--resume", checkpoint, "--out_dir", tmp_path / "resumed")
    expected, got = step_losses(reference), step_losses(tmp_path / "resumed")
    assert len(got) == 1 and abs(got[0] - expected[2]) <= 1e-5 * abs(expected[2]), (expected, got)


def test_lora_with_every_rank_holding_one_expert_matches_one_process(single, tmp_path):
    model, reference = single("lora")
    job, flags, _ = JOBS["lora"]
    run_cli(job, model, *COMMON, *flags, "--strategy", "fsdp", "--devices", "4", "--expert_parallel", "4", "--train.micro_batch_size", "2",
            "--out_dir", tmp_path, timeout=600)
    assert_matches("lora", reference, tmp_path)
    busiest = [r["expert_rank_imbalance_max"] for r in read_metrics(tmp_path) if "loss" in r]  # one expert per rank: its load
    assert busiest == pytest.approx([r["expert_imbalance_max"] for r in read_metrics(tmp_path) if "loss" in r]) and len(busiest) == 3
