"""Two real processes on gloo must train exactly what one process trains on the same global batch."""

import pytest

from tests.conftest import run_cli, step_losses

COMMON = [
    "--data", "TinyTasks", "--data.num_train", "128", "--data.num_val", "16",
    "--train.global_batch_size", "8", "--train.max_steps", "5", "--train.learning_rate", "3e-3",
    "--train.warmup_steps", "2", "--eval.interval", "0", "--eval.max_batches", "2", "--precision", "32-true",
    "--accelerator", "cpu",
]


@pytest.mark.parametrize(
    "job, extra",
    [
        ("finetune_full", []),
        ("finetune_lora", ["--lora_dropout", "0", "--lora_r", "4"]),
        ("pretrain", []),
    ],
)
def test_ddp_matches_single_process(tmp_path, job, extra):
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    # One process accumulates 2 micro-batches of 4; two processes take 2 micro-batches of 2 each.
    run_cli(job, *COMMON, *extra, "--train.micro_batch_size", "4", "--out_dir", single)
    run_cli(job, *COMMON, *extra, "--train.micro_batch_size", "2", "--devices", "2", "--strategy", "ddp", "--out_dir", ddp)
    reference, distributed = step_losses(single), step_losses(ddp)
    assert len(reference) == len(distributed) == 5
    assert reference[-1] < reference[0]
    for a, b in zip(reference, distributed):
        assert abs(a - b) <= 1e-5 * abs(a), (reference, distributed)
    assert (ddp / "final" / "model.safetensors").is_file()
