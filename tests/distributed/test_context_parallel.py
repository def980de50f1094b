"""Context parallel in real gloo processes trains what one process trains on the same global batch, and resumes on another split.

TinyTasks samples have uneven lengths, so the padding-free rows that a context
group splits are padded to a multiple of the group and cut mid-sample: slices,
the all-to-all around attention and targets across a slice's edge are all exercised.
"""

import pytest

from tests.conftest import run_cli, step_losses

COMMON = [
    "--data", "TinyTasks", "--data.num_train", "64", "--data.num_val", "8",
    "--train.global_batch_size", "8", "--train.max_steps", "4", "--train.learning_rate", "3e-3", "--train.warmup_steps", "1",
    "--eval.interval", "0", "--eval.max_batches", "2", "--eval.initial_validation", "false",
    "--precision", "32-true", "--accelerator", "cpu", "--logger_name", "csv",
]
LORA = ["--lora_dropout", "0", "--lora_r", "4", "--export", "none"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, two micro-batches of 4, per job (computed once)."""
    done = {}

    def get(job):
        if job not in done:
            out = tmp_path_factory.mktemp(f"one-{job}")
            run_cli(job, *COMMON, *(LORA if job == "finetune_lora" else []), "--train.micro_batch_size", "4", "--out_dir", out)
            done[job] = out
        return done[job]

    return get


def assert_same_losses(got, expected, rel=1e-5):
    assert len(got) == len(expected), (got, expected)
    for step, (a, b) in enumerate(zip(got, expected), 1):
        assert abs(a - b) <= rel * abs(b), f"step {step}: {a} vs {b}"


def val_loss(out_dir):
    from tests.conftest import final_value

    return final_value(out_dir, "val_loss")


def test_fsdp_with_context_parallel_matches_one_process_and_resumes_without_it(reference, tmp_path):
    """4 ranks: FSDP over all of them, two context groups of 2 (so two data-parallel ranks, micro-batches of 2 rows each
    cut in two); the step-2 checkpoint then resumes on 2 ranks without context parallel and ends where one process ends."""
    ref = reference("finetune_full")
    out = tmp_path / "cp"
    run_cli(
        "finetune_full", *COMMON, "--strategy", "fsdp", "--devices", "4", "--context_parallel", "2", "--train.micro_batch_size", "2",
        "--train.save_interval", "2", "--out_dir", out, timeout=600,
    )
    assert_same_losses(step_losses(out), step_losses(ref))
    assert abs(val_loss(out) - val_loss(ref)) <= 1e-5 * val_loss(ref)  # validation splits its rows the same way
    resumed = tmp_path / "resumed"
    run_cli(
        "finetune_full", *COMMON, "--strategy", "fsdp", "--devices", "2", "--train.micro_batch_size", "4",
        "--resume", out / "checkpoints" / "step-00000002", "--out_dir", resumed, "--eval.final_validation", "false",
    )
    assert_same_losses(step_losses(resumed), step_losses(ref)[2:])


def test_lora_with_context_parallel_under_zero3_matches_one_process(reference, tmp_path):
    """ZeRO-3 partitions the weights over both ranks of the one context group; the adapters' steps match one process's."""
    out = tmp_path / "zero3"
    run_cli(
        "finetune_lora", *COMMON, *LORA, "--strategy", "deepspeed", "--deepspeed.stage", "3", "--devices", "2", "--context_parallel", "2",
        "--train.micro_batch_size", "4", "--out_dir", out, timeout=600,
    )
    assert_same_losses(step_losses(out), step_losses(reference("finetune_lora")))
