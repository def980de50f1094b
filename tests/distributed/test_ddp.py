"""Two real processes on gloo must train exactly what one process trains on the same global batch."""

import pytest

from tests.conftest import read_metrics, run_cli, step_losses

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
        # pretrain shares this path; it is compared to one process under FSDP in test_sharding.
    ],
)
def test_ddp_matches_single_process(tmp_path, job, extra):
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    # One process accumulates 2 micro-batches of 4; two processes take 2 micro-batches of 2 each.
    run_cli(job, *COMMON, *extra, "--train.micro_batch_size", "4", "--train.peak_tflops", "0.5", "--out_dir", single)
    run_cli(job, *COMMON, *extra, "--train.micro_batch_size", "2", "--devices", "2", "--strategy", "ddp", "--train.peak_tflops", "0.5", "--out_dir", ddp)
    reference, distributed = step_losses(single), step_losses(ddp)
    assert len(reference) == len(distributed) == 5
    assert reference[-1] < reference[0]
    for a, b in zip(reference, distributed):
        assert abs(a - b) <= 1e-5 * abs(a), (reference, distributed)
    assert (ddp / ("final-adapter/adapter_model.safetensors" if job == "finetune_lora" else "final/model.safetensors")).is_file()
    # The same global batches are the same model FLOPs, however many ranks share them.
    assert flops_per_token_logged(single) == pytest.approx(flops_per_token_logged(ddp), rel=1e-9)
    rows = [r for r in read_metrics(ddp) if "mfu" in r]
    assert all(r["mfu"] == pytest.approx(r["tflops_per_s_per_device"] / 0.5) for r in rows)
    assert all(r["peak_memory_gb"] == max(r["peak_memory_gb/rank_0"], r["peak_memory_gb/rank_1"]) > 0 for r in rows)


def flops_per_token_logged(out_dir):
    """Model FLOPs per token of each step, from the logged rates: TFLOP/s of all devices over tokens/s."""
    rows = [r for r in read_metrics(out_dir) if "tflops_per_s_per_device" in r]
    world = round(rows[0]["tokens_per_s"] / rows[0]["tokens_per_s_per_device"])
    return [r["tflops_per_s_per_device"] * 1e12 * world / r["tokens_per_s"] for r in rows]


def test_uneven_validation_shards_match_single_process(tmp_path):
    """One validation sample on two ranks: rank 1 has none, yet no rank waits and the loss is exact."""
    args = ["finetune_full", *COMMON, "--data.num_val", "1", "--train.max_steps", "1", "--train.micro_batch_size", "4"]
    run_cli(*args, "--out_dir", tmp_path / "single")
    run_cli(*args, "--devices", "2", "--out_dir", tmp_path / "ddp", timeout=180)
    from tests.conftest import read_metrics

    single = [r["val_loss"] for r in read_metrics(tmp_path / "single") if "val_loss" in r]
    ddp = [r["val_loss"] for r in read_metrics(tmp_path / "ddp") if "val_loss" in r]
    assert len(single) == len(ddp) == 2
    for a, b in zip(single, ddp):
        assert abs(a - b) <= 1e-5 * a


def test_bad_data_stops_every_rank_with_one_line(tmp_path):
    proc = run_cli(
        "finetune_full", "--data", "JSON", "--data.json_path", tmp_path / "missing.json", "--devices", "2",
        "--accelerator", "cpu", "--out_dir", tmp_path / "o", check=False, timeout=120,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("litft: error:")]
    assert len(errors) == 2 and all("missing.json does not exist" in line for line in errors), proc.stderr[-3000:]
    # Every rank stops on the message itself, not on a collective broken by a rank that left.
    assert "Traceback" not in proc.stderr and "Connection closed" not in proc.stderr
    assert not (tmp_path / "o").exists()
