"""Packed rows for the models whose state kernels take per-sample boundaries (litft.model.recurrent.BOUNDARY_KERNELS).

The kernels are CUDA-only, so one child process runs with CPU stand-ins of mamba-ssm,
causal-conv1d and fla on its path (tests/state_kernel_standins): transformers then
takes its kernel path, litft packs the samples into one row and passes ``seq_idx``
and ``cu_seq_lens``. The loss and every gradient must equal transformers' own
PyTorch forward of each sample alone, computed here without the stand-ins, and
each kernel must have been told where the samples start. The same child runs a
job with ``--data.packing``, which without such kernels is refused.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from litft.model.recurrent import BOUNDARY_KERNELS, DELTA_RULE, boundary_kernels, describe
from tests.architectures import ARCHITECTURES, reference, save_tiny

ROOT = Path(__file__).resolve().parents[2]
STANDINS = ROOT / "tests" / "state_kernel_standins"
PACKED = [a for a in ARCHITECTURES if a.refused is None and a.build().get_text_config().model_type in BOUNDARY_KERNELS]
KERNEL_CALLS = {"mamba_ssm": "mamba_split_conv1d_scan_combined", "fla": "chunk_gated_delta_rule"}  # training's calls of each


def packed_in_child(folders: dict, out: Path, job_folder: Path) -> None:
    """In a process with the stand-ins on its path: each model's packed loss and gradients, the kernels' calls, and a job."""
    import causal_conv1d
    import fla
    import mamba_ssm

    from litft.data import TinyTasks
    from litft.data.collate import collate
    from litft.data.samples import pack
    from litft.config import EvalArgs, TrainArgs
    from litft.cli.jobs import JOBS
    from tests.architectures import as_litft_builds_it, samples

    results = {}
    for name, folder in folders.items():
        for package in (causal_conv1d, fla, mamba_ssm):
            package.calls.clear()
        lm = as_litft_builds_it(Path(folder))
        lm.keep_samples_apart_in_kernels(True)
        batch = collate(pack(samples(), max_length=64), pad_id=0, padding_free=True)
        loss = lm.loss_sum(batch)
        loss.backward()
        grads = {n: p.grad for n, p in lm.hf_model.named_parameters() if p.grad is not None}
        calls = {**causal_conv1d.calls, **fla.calls, **mamba_ssm.calls}
        with torch.no_grad():  # evaluation: Mamba2 mixers take their unfused path (the convolution, then the scan)
            evaluated = lm.eval().loss_sum(batch).item()
        eval_calls = {**causal_conv1d.calls, **fla.calls, **mamba_ssm.calls}
        results[name] = {"loss": loss.item(), "grads": grads, "calls": calls, "whole_rows": lm.whole_rows, "eval_loss": evaluated,
                         "eval_calls": {k: v - calls.get(k, 0) for k, v in eval_calls.items()}}
    torch.save(results, out)
    from litft.model.attention import PACKED_SAFE
    from litft.model.recurrent import boundary_kernels

    config = as_litft_builds_it(Path(folders["qwen3-next"])).hf_model.config
    (out.parent / "choices.json").write_text(json.dumps({attention: list(boundary_kernels(config, "cpu", attention in PACKED_SAFE))
                                                          for attention in ("litft_segments", "sdpa", "eager")}))
    run = JOBS["finetune_lora"](str(job_folder), out_dir=out.parent / "job", data=TinyTasks(num_train=16, num_val=4, packing=True),
                                train=TrainArgs(global_batch_size=4, micro_batch_size=2, max_steps=2, save_interval=None),
                                eval=EvalArgs(interval=10**6, initial_validation=False), accelerator="cpu", logger_name="csv")
    (out.parent / "job.json").write_text(json.dumps({"losses": [h["loss"] for h in run.history if "loss" in h]}))


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("state_kernels")
    folders = {a.name: str(save_tiny(a, root / a.name.replace(" ", "-"))) for a in PACKED}
    out = root / "packed.pt"
    code = (f"from tests.unit.test_state_kernels import packed_in_child; from pathlib import Path; "
            f"packed_in_child({folders!r}, Path({str(out)!r}), Path({folders['granite-4 hybrid']!r}))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(STANDINS)]))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return folders, torch.load(out), json.loads((root / "job.json").read_text()), done.stdout


@pytest.mark.parametrize("architecture", PACKED, ids=[a.name for a in PACKED])
def test_packed_rows_equal_transformers_a_sample_at_a_time(architecture, packed):
    """Loss to 1e-5 and every gradient to 1e-4 (relative L2), with every state layer's kernel told where samples start."""
    folders, results, _, _ = packed
    got = results[architecture.name]
    expected, expected_grads = reference(folders[architecture.name])
    assert not got["whole_rows"]
    assert abs(got["loss"] - expected.item()) <= 1e-5 * abs(expected.item()), (got["loss"], expected.item())
    assert got["grads"].keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        error = (got["grads"][name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert error <= 1e-4, f"gradient of {name} off by {error:.2e}"
    packages = BOUNDARY_KERNELS[architecture.build().get_text_config().model_type]
    for package in packages:
        if package in KERNEL_CALLS:
            assert got["calls"].get(KERNEL_CALLS[package], 0) > 0, got["calls"]
    if packages == DELTA_RULE:  # the gated delta rule's convolution is its own call (Mamba2's is fused into the scan)
        assert got["calls"].get("causal_conv1d_fn", 0) > 0, got["calls"]
    # Evaluation's forward (unfused for Mamba2 mixers) keeps the samples apart too.
    assert abs(got["eval_loss"] - expected.item()) <= 1e-5 * abs(expected.item()), (got["eval_loss"], expected.item())
    assert got["eval_calls"].get("causal_conv1d_fn", 0) > 0, got["eval_calls"]


def test_attention_that_cannot_keep_packed_samples_apart_keeps_rows_a_sample_each(packed):
    """With the kernels there, --attn_implementation sdpa or eager still pads: their attention would cross samples."""
    choices = json.loads((Path(packed[0]["qwen3-next"]).parent / "choices.json").read_text())
    assert choices == {"litft_segments": ["fla", "causal_conv1d"], "sdpa": [], "eager": []}


def test_a_packed_job_trains_and_says_how_rows_are_laid_out(packed):
    _, _, job, stdout = packed
    assert len(job["losses"]) == 2 and all(torch.isfinite(torch.tensor(job["losses"])))
    assert "rows: packed; granitemoehybrid's layers that carry state" in stdout and "mamba-ssm, causal-conv1d" in stdout


def test_packed_rows_under_fsdp_match_one_process(packed, tmp_path):
    """Two FSDP ranks on packed rows (their kernels told where samples start) against one process on the same global batch."""
    from tests.conftest import step_losses

    folders = packed[0]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(STANDINS)]))
    common = [sys.executable, "-m", "litft", "finetune_full", folders["qwen3-next"], "--data", "TinyTasks", "--data.num_train", "32",
              "--data.num_val", "8", "--train.global_batch_size", "8", "--train.micro_batch_size", "4", "--train.max_steps", "3",
              "--train.learning_rate", "3e-3", "--train.warmup_steps", "1", "--eval.interval", "0", "--eval.initial_validation", "false",
              "--eval.final_validation", "false", "--precision", "32-true", "--accelerator", "cpu", "--logger_name", "csv"]
    for name, more in (("single", []), ("fsdp", ["--strategy", "fsdp", "--devices", "2"])):
        done = subprocess.run([*common, *more, "--out_dir", str(tmp_path / name)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "rows: packed; qwen3_next's layers" in done.stdout
    expected, got = step_losses(tmp_path / "single"), step_losses(tmp_path / "fsdp")
    assert len(got) == len(expected) == 3 and all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(expected, got)), (expected, got)


def test_without_the_kernels_rows_stay_a_sample_each():
    """Here no kernel package is installed: no boundaries, and the first screen says what packing would need."""
    import importlib.util

    config = next(a for a in PACKED if a.name == "qwen3-next").build()
    assert boundary_kernels(config, "cpu") == ()
    if not any(importlib.util.find_spec(package) for package in ("fla", "causal_conv1d")):
        assert boundary_kernels(config, "cuda") == ()
    line = describe(config)
    assert "one sample per right-padded row" in line and "packed rows need flash-linear-attention, causal-conv1d on a GPU" in line
