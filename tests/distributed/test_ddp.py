"""The edges of DDP: uneven validation shards, and bad data on every rank (its exact training is in test_sharding.py)."""

from tests.conftest import read_metrics, run_cli

COMMON = [
    "--data", "TinyTasks", "--data.num_train", "128", "--data.num_val", "16",
    "--train.global_batch_size", "8", "--train.max_steps", "5", "--train.learning_rate", "3e-3",
    "--train.warmup_steps", "2", "--eval.interval", "0", "--eval.max_batches", "2", "--precision", "32-true",
    "--accelerator", "cpu",
]


def test_uneven_validation_shards_match_single_process(tmp_path):
    """One validation sample on two ranks: rank 1 has none, yet no rank waits and the loss is exact."""
    args = ["finetune_full", *COMMON, "--data.num_val", "1", "--train.max_steps", "1", "--train.micro_batch_size", "4"]
    run_cli(*args, "--out_dir", tmp_path / "single")
    run_cli(*args, "--devices", "2", "--out_dir", tmp_path / "ddp", timeout=180)
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
