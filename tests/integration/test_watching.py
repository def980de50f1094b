"""Runs on Hugging Face data that people can watch: W&B (offline) and MLflow (file store) hold the metrics and the config, loss.png,
the profiler's trace and table, a quiet first screen, --data Mix weights seen in the sample ids, and a streamed run that resumes exactly."""

import json
import re
import struct
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from litft.config import EvalArgs, TrainArgs
from litft.data import HF
from litft.cli.jobs import finetune_full
from tests.conftest import read_metrics, run_cli

ALPACA = [{"instruction": "Add the numbers.", "input": f"{i} + {j}", "output": str(i + j)} for i in range(8) for j in range(5)]
COMPLETION = [{"prompt": f"Count the letters. {'x ' * n}", "completion": str(n)} for n in range(1, 33)]
SMALL_TRAIN = ["--train.global_batch_size", "8", "--train.micro_batch_size", "8", "--train.learning_rate", "3e-3", "--train.warmup_steps", "1"]


def parquet(path, records):
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


@pytest.fixture(scope="module")
def watched(tmp_path_factory, tiny_dir):
    """One run into W&B (offline) and MLflow (a file store), profiled, with checkpoints at steps 3 and 6."""
    root = tmp_path_factory.mktemp("watched")
    out = root / "run"
    proc = run_cli(
        "finetune_full", "--data", "HF", "--data.path", parquet(root / "add.parquet", ALPACA), "--data.val_split_fraction", "0.2",
        "--out_dir", out, *SMALL_TRAIN, "--train.max_steps", "6", "--train.save_interval", "3", "--eval.interval", "3",
        "--eval.score_samples", "0", "--logger_name", "[wandb, mlflow]", "--profile", "true",
        env={"WANDB_MODE": "offline", "WANDB_PROJECT": "litft-test", "MLFLOW_EXPERIMENT_NAME": "litft-test"},
    )
    return out, proc


def test_mlflow_file_store_holds_the_metrics_and_config(watched, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores only on request
    out, _ = watched
    client = MlflowClient(tracking_uri=(out / "logs" / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("litft-test").experiment_id])
    assert run.info.run_id == (out / "logs" / "mlflow-run-id").read_text() and run.info.status == "FINISHED"
    logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert logged == pytest.approx({int(r["step"]): r["loss"] for r in read_metrics(out) if "loss" in r}) and sorted(logged) == list(range(1, 7))
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_loss")) == [0, 3, 6]
    assert run.data.params["train.max_steps"] == "6" and run.data.params["data.init_args.path"].endswith("add.parquet")


def wandb_records(path):
    """The protobuf records of an offline run's .wandb file: a log of 32 KiB blocks, each chunk headed by crc32, length and type."""
    from wandb.proto import wandb_internal_pb2

    data, records, pending, pos = path.read_bytes(), [], b"", 7  # after the file header, ":W&B", magic and version
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def name(item):
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_run_holds_the_metrics_and_config(watched):
    out, proc = watched
    (folder,) = (out / "logs" / "wandb").glob("offline-run-*")
    run_id = (out / "logs" / "wandb-run-id").read_text()
    assert folder.name.endswith(run_id) and f"wandb: run {run_id} at" in proc.stderr
    records = wandb_records(folder / f"run-{run_id}.wandb")
    rows = [{name(item): json.loads(item.value_json) for item in r.history.item} for r in records if r.WhichOneof("record_type") == "history"]
    assert {row["step"]: row["loss"] for row in rows if "loss" in row} == pytest.approx({int(r["step"]): r["loss"] for r in read_metrics(out) if "loss" in r})
    assert [row["step"] for row in rows if "val_loss" in row] == [0, 3, 6]
    config = {name(item): json.loads(item.value_json) for r in records if r.WhichOneof("record_type") == "config" for item in r.config.update}
    assert config["train.max_steps"] == 6 and config["logger_name"] == ["wandb", "mlflow"] and config["data.init_args.path"].endswith("add.parquet")


def test_loss_plot_is_written(watched):
    from matplotlib.image import imread

    out, _ = watched
    image = imread(out / "logs" / "loss.png")
    assert image.shape == (450, 800, 4) and image[..., :3].std() > 0.05  # drawn, not blank


def test_profile_writes_a_trace_and_the_top_operators(watched):
    out, proc = watched
    trace = json.loads((out / "logs" / "profile" / "rank-00000.json").read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert {"aten::mm", "Optimizer.step#AdamW.step"} & names and any(n.startswith("aten::") for n in names)
    table = (out / "logs" / "profile" / "rank-00000.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    assert "profile of steps 3-5, top operators by self time on rank 0" in proc.stderr


def source(path, **init_args):
    return {"class_path": "litft.data.HF", "init_args": {"path": str(path), "val_split_fraction": 0.0, **init_args}}


def test_mix_weights_show_in_the_sample_ids_and_the_screen_is_quiet(tmp_path, tiny_dir):
    """Two sources of 20 and 12 samples weighted 1:3: an epoch of 32 takes 8 and 24 of them. Also a normal run's stderr holds litft's lines only."""
    config = tmp_path / "mix.yaml"
    sources = [source(parquet(tmp_path / "add.parquet", ALPACA[:20])), source(parquet(tmp_path / "count.parquet", COMPLETION[:12]))]
    config.write_text(yaml.safe_dump({"data": {"class_path": "litft.data.Mix", "init_args": {"sources": sources, "weights": [1, 3]}}}))
    out = tmp_path / "run"
    proc = run_cli(
        "finetune_full", "--config", config, "--out_dir", out, *SMALL_TRAIN, "--train.max_steps", "4", "--train.record_sample_ids", "true",
        "--eval.initial_validation", "false", "--eval.final_validation", "false", "--logger_name", "csv",
    )
    rows = [json.loads(line) for line in (out / "logs" / "samples" / "rank-00000.jsonl").read_text().splitlines()]
    ids = [i for row in rows for i in row["ids"]]
    assert len(ids) == 32 and len(set(ids)) < 32  # the smaller source repeats
    assert Counter("add" if i < 20 else "count" for i in ids) == {"add": 8, "count": 24}
    assert len({i for i in ids if i < 20}) == 8  # subsampled without repeats
    lines = proc.stderr.splitlines()
    litft_lines = r"(tokenizing \d+ \+ 0 records of .* once$|step \d+/4 \| loss |step 4: checkpoint )"
    assert lines and all(re.match(litft_lines, line) for line in lines), proc.stderr
    assert not (out / "logs" / "tensorboard").exists() and (out / "logs" / "loss.png").is_file()


def test_streamed_run_resumes_exactly(tmp_path, tiny_dir):
    """40 records, 4 held out: 36 streamed, 4 global batches of 8 an epoch; step 3's checkpoint resumes across the epoch's end."""
    path = tmp_path / "add.parquet"
    parquet(path, ALPACA)
    train = TrainArgs(global_batch_size=8, micro_batch_size=4, max_steps=6, learning_rate=3e-3, warmup_steps=1, save_interval=3, record_sample_ids=True)
    evaluation = EvalArgs(interval=0, max_batches=1, initial_validation=False, final_validation=False, score_samples=0)

    def run(out, **kw):
        finetune_full(data=HF(path=str(path), streaming=True, val_samples=4, shuffle_buffer=8), out_dir=out, train=train, eval=evaluation, **kw)
        losses = {int(r["step"]): r["loss"] for r in read_metrics(out) if "loss" in r}
        samples = [json.loads(line) for line in (out / "logs" / "samples" / "rank-00000.jsonl").read_text().splitlines()]
        return losses, {row["step"]: (row["epoch"], row["ids"]) for row in samples}

    whole_losses, whole_ids = run(tmp_path / "whole")
    losses, ids = run(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoints" / "step-00000003"))
    assert [whole_ids[s][0] for s in range(1, 7)] == [0, 0, 0, 0, 1, 1]
    assert sorted(ids) == [4, 5, 6] and all(ids[s] == whole_ids[s] for s in ids)
    assert [losses[s] for s in (4, 5, 6)] == [whole_losses[s] for s in (4, 5, 6)]  # bitwise
