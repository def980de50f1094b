from pathlib import Path

import pytest
from jsonargparse import capture_parser

from litft.__main__ import configure_jsonargparse, main, parser_jobs

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--data", "TinyTasks", "--data.num_train", "64", "--data.num_val", "8", "--train.max_steps", "1"]


def cli_parser():
    from jsonargparse import CLI

    configure_jsonargparse()
    import litft.data  # noqa: F401

    return capture_parser(lambda: CLI(parser_jobs(), args=[]))


def run_main(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    return exit_info.value.code, capsys.readouterr().err.strip()


def test_help_shows_field_docs(capsys):
    with pytest.raises(SystemExit):
        main(["finetune_lora", "--help"])
    text = capsys.readouterr().out
    assert "Samples per optimizer step, summed over every rank" in text
    assert "--lora_r" in text and "--train.micro_batch_size" in text and "--quantize" in text


@pytest.mark.parametrize("path", sorted((ROOT / "config_hub").rglob("*.yaml")), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_hub_yaml_parses(path):
    job = "pretrain" if path.parent.name == "pretrain" else {"lora": "finetune_lora", "qlora": "finetune_lora", "full": "finetune_full"}[path.stem]
    config = cli_parser().parse_args([job, "--config", str(path)])
    assert config.subcommand == job
    section = config[job]
    assert section.model and section.train.global_batch_size % section.train.micro_batch_size == 0


def test_model_is_positional_and_yaml_readable(tmp_path):
    cfg = cli_parser().parse_args(["finetune_lora", "some-org/some-model", "--lora_r", "4", "--data", "JSON", "--data.json_path", "x.json"])
    assert cfg.finetune_lora.model == "some-org/some-model"
    assert cfg.finetune_lora.lora_r == 4
    assert cfg.finetune_lora.data.class_path == "litft.data.JSON"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--train.global_batch_size", "6", "--train.micro_batch_size", "4"], "not divisible by micro_batch_size x world size"),
        (["--model", "./no/such/model"], "model path ./no/such/model does not exist"),
        (["--precision", "16-mixed", "--accelerator", "cpu"], "16-mixed needs a GPU"),
        (["--data", "JSON", "--data.json_path", "missing.json"], "data file missing.json does not exist"),
        (["--train.max_steps", "0"], "--train.max_steps must be at least 1"),
        (
            ["--strategy", "fsdp", "--devices", "3", "--fsdp.shard_size", "2", "--train.global_batch_size", "24"],
            "HYBRID_SHARD needs the world size (3 devices x 1 nodes = 3) to be a multiple of the shard group size (2)",
        ),
        (["--strategy", "fsdp", "--fsdp.sharding_strategy", "FULL_SHARD", "--fsdp.shard_size", "2"], "only applies to HYBRID_SHARD"),
        (["--strategy", "fsdp", "--fsdp.cpu_offload", "true", "--accelerator", "cpu"], "nothing to offload"),
        (["--strategy", "deepspeed", "--deepspeed.stage", "4"], "--deepspeed.stage: expected one of 0, 1, 2, 3, got 4"),
        (["--strategy", "ddp", "--deepspeed.offload_optimizer", "cpu"], "--deepspeed.* options only apply to --strategy deepspeed"),
        (["--strategy", "deepspeed", "--deepspeed.offload_parameters", "cpu"], "offload_parameters needs --deepspeed.stage 3"),
        (["--strategy", "deepspeed", "--deepspeed.stage", "0", "--deepspeed.offload_optimizer", "cpu"], "needs --deepspeed.stage 1, 2 or 3"),
        (["--strategy", "deepspeed", "--deepspeed.config", "nope.json"], "--deepspeed.config nope.json does not exist"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, args, message):
    code, err = run_main(["finetune_full", *SMALL, "--out_dir", tmp_path / "o", *args], capsys)
    assert code == 2
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_empty_dataset_is_reported(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, err = run_main(["finetune_full", "--data", "JSON", "--data.json_path", empty, "--out_dir", tmp_path / "o"], capsys)
    assert code == 2 and "holds no records" in err


def test_out_dir_with_files_is_left_alone(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    keep = out / "notes.txt"
    keep.write_text("precious")
    for extra in ([], ["--overwrite", "true"]):
        code, err = run_main(["finetune_full", *SMALL, "--out_dir", out, *extra], capsys)
        assert code == 2 and "holds files that litft did not write" in err
    assert keep.read_text() == "precious" and sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_earlier_run_is_replaced_only_when_asked(tmp_path, capsys):
    out = tmp_path / "run"
    main(["finetune_full", *SMALL, "--out_dir", str(out), "--eval.interval", "0"])
    first = (out / "final" / "model.safetensors").stat().st_mtime_ns
    (out / "notes.txt").write_text("mine")
    code, err = run_main(["finetune_full", *SMALL, "--out_dir", out], capsys)
    assert code == 2 and "already holds a run" in err and "--overwrite true" in err
    assert (out / "final" / "model.safetensors").stat().st_mtime_ns == first
    main(["finetune_full", *SMALL, "--out_dir", str(out), "--overwrite", "true"])
    assert (out / "final" / "model.safetensors").stat().st_mtime_ns != first
    assert (out / "notes.txt").read_text() == "mine"
    # The recorded config is a valid --config file that reproduces the run's settings.
    again = cli_parser().parse_args(["finetune_full", "--config", str(out / "run_config.yaml")]).finetune_full
    assert again.train.max_steps == 1 and again.data.init_args.num_train == 64 and again.model == "litft-tiny"


def test_unreachable_hub_id_is_one_line(tmp_path, capsys):
    code, err = run_main(["finetune_full", "litft-test/not-a-real-model", *SMALL, "--out_dir", tmp_path / "o"], capsys)
    assert code == 2 and "could not load 'litft-test/not-a-real-model'" in err and len(err.splitlines()) == 1


def test_batch_defaults_follow_the_world_size():
    """--devices 8 alone: the default global batch 32 is rounded up to 8 x 8, and one line says so; a given one is kept."""
    import inspect

    from litft.config import TrainArgs
    from litft.jobs import RunSpec, finetune_full

    flags = inspect.signature(finetune_full).bind(devices=8)
    flags.apply_defaults()
    spec = RunSpec.from_flags("finetune_full", dict(flags.arguments))
    note = spec.check()
    assert spec.train.global_batch_size == 64 and spec.train.micro_batch_size == 8
    assert note == "global batch 64 samples (--train.global_batch_size not given; the default 32 rounded up to a multiple of micro batch 8 x 8 ranks)"
    assert TrainArgs(micro_batch_size=8).resolved(4) == (TrainArgs(micro_batch_size=8, global_batch_size=32), None)
    assert TrainArgs(global_batch_size=24, micro_batch_size=4).resolved(8)[0].global_batch_size == 24  # given: kept, then checked
