import re
from pathlib import Path

import pytest
from jsonargparse import capture_parser

from litft.__main__ import configure_jsonargparse, default_data_named, main, model_by_position, parser_jobs

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
    job = "pretrain" if path.parent.name == "pretrain" else {"lora": "finetune_lora", "qlora": "finetune_lora", "dpo": "finetune_lora", "grpo": "finetune_lora",
                                                                "full": "finetune_full"}[path.stem]
    config = cli_parser().parse_args([job, "--config", str(path)])
    assert config.subcommand == job
    section = config[job]
    assert section.model and section.train.global_batch_size % section.train.micro_batch_size == 0 or path.stem == "grpo"
    if path.stem == "dpo":
        assert section.objective.name == "dpo" and section.data.class_path == "litft.data.Preferences"
    if path.stem == "grpo":  # the global batch counts prompts, a micro-batch completions
        assert section.objective.name == "grpo" and section.data.class_path == "litft.data.Prompts"
        assert section.train.global_batch_size * section.objective.group_size % section.train.micro_batch_size == 0


def parse(args):
    """What main parses for these words: the model taken by position, default data named for its options."""
    return cli_parser().parse_args(default_data_named(model_by_position(args, parser_jobs())))


def test_model_is_positional_and_yaml_readable(tmp_path):
    cfg = parse(["finetune_lora", "some-org/some-model", "--lora_r", "4", "--data", "JSON", "--data.json_path", "x.json"])
    assert cfg.finetune_lora.model == "some-org/some-model"
    assert cfg.finetune_lora.lora_r == 4
    assert cfg.finetune_lora.data.class_path == "litft.data.JSON"


def test_model_by_position_wins_over_the_config_file(tmp_path):
    """The quickstart passes a local folder by position with a config that names the hub id."""
    config = tmp_path / "lora.yaml"
    config.write_text("model: some-org/hub-model\nlora_r: 4\n")
    cfg = parse(["finetune_lora", "/local/folder", "--config", str(config), "--lora_alpha", "8"])
    assert cfg.finetune_lora.model == "/local/folder" and cfg.finetune_lora.lora_r == 4
    assert cfg.finetune_lora.lora_alpha == 8


def test_default_data_options_need_no_data_flag():
    """--data.num_train alone sets the job's default data: TinyTasks, packed plain text for pretrain."""
    full = parse(["finetune_full", "--data.num_train", "64"]).finetune_full.data
    assert full.class_path == "litft.data.TinyTasks" and full.init_args.num_train == 64 and full.init_args.mask_prompt
    text = parse(["pretrain", "--data.num_val=8"]).pretrain.data.init_args
    assert text.num_val == 8 and text.packing and not text.mask_prompt


@pytest.mark.parametrize("args, message", [
    (["finetune_lora", "litft-tiny", "--devcies", "2"], "unknown flag --devcies; did you mean --devices?"),
    (["finetune_full", "litft-tiny", "--foo"], "unknown flag --foo (see litft finetune_full --help)"),
    (["finetune_full", "--train.max_stpes", "3"], "unknown flag --train.max_stpes; did you mean --train.max_steps?"),
    (["finetune_full", "litft-tiny", "out/run"], "unexpected value 'out/run': only the model is given by position"),
    (["finetune_full", "--foo", "litft-tiny"], "unknown flag --foo"),
])
def test_unknown_flags_are_named_before_anything_runs(tmp_path, capsys, monkeypatch, args, message):
    """A flag litft does not know, or a second value by position, is one line; nothing trains and no folder appears."""
    monkeypatch.chdir(tmp_path)
    code, err = run_main(args, capsys)
    assert code == 2 and err.startswith("litft: error: ") and message in err and "\n" not in err
    assert not any(tmp_path.iterdir())


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
        (["--devices", "3", "--context_parallel", "2", "--train.global_batch_size", "6"], "--context_parallel 2 must divide --devices 3"),
        (["--devices", "8", "--context_parallel", "8", "--train.global_batch_size", "8"], "--context_parallel 8 must divide the model's 4 attention heads"),
        (["--devices", "2", "--context_parallel", "2", "--attn_implementation", "sdpa"], "use --attn_implementation auto or litft_segments, not sdpa"),
        (["--devices", "2", "--context_parallel", "2", "--compile", "true"], "--compile true is not supported with --context_parallel"),
        (["--devices", "4", "--context_parallel", "2", "--train.global_batch_size", "6"], "not divisible by micro_batch_size x world size"),
        (["--devices", "3", "--strategy", "fsdp", "--tensor_parallel", "2", "--train.global_batch_size", "6"], "--tensor_parallel 2 must divide --devices 3"),
        (["--devices", "4", "--strategy", "fsdp", "--tensor_parallel", "4"], "--tensor_parallel 4 must divide the model's 2 key/value heads"),
        (["--devices", "2", "--strategy", "deepspeed", "--tensor_parallel", "2"], "DeepSpeed cannot hold them, use --strategy fsdp"),
        (["--devices", "2", "--tensor_parallel", "2"], "DDP cannot hold them, use --strategy fsdp"),
        (["--devices", "4", "--strategy", "fsdp", "--tensor_parallel", "2", "--context_parallel", "2"], "together are not supported yet"),
        (["--devices", "2", "--strategy", "fsdp", "--tensor_parallel", "2", "--compile", "true"], "--compile true is not supported with --tensor_parallel"),
        (["--devices", "4", "--strategy", "fsdp", "--tensor_parallel", "2", "--train.global_batch_size", "6"], "not divisible by micro_batch_size x world size"),
        (["--devices", "3", "--strategy", "fsdp", "--expert_parallel", "2", "--train.global_batch_size", "6"], "--expert_parallel 2 must divide --devices 3"),
        (["--devices", "2", "--strategy", "deepspeed", "--expert_parallel", "2"], "--expert_parallel deals experts out as DTensors that FSDP2 shards further; DeepSpeed cannot"),
        (["--devices", "2", "--expert_parallel", "2"], "--expert_parallel deals experts out as DTensors that FSDP2 shards further; DDP cannot"),
        (["--devices", "2", "--strategy", "fsdp", "--expert_parallel", "2"], "--expert_parallel deals out MoE experts, and llama has none"),
        (["--model", "litft-tiny-moe", "--devices", "3", "--strategy", "fsdp", "--expert_parallel", "3", "--train.global_batch_size", "24"],
         "--expert_parallel 3 must divide the model's 8 experts per layer"),
        (["--devices", "2", "--strategy", "fsdp", "--fsdp.sharding_strategy", "NO_SHARD", "--expert_parallel", "2"],
         "--expert_parallel 2 must divide FSDP's shard group (1 ranks under NO_SHARD)"),
        (["--devices", "4", "--strategy", "fsdp", "--expert_parallel", "2", "--tensor_parallel", "2"], "--expert_parallel and --tensor_parallel together"),
        (["--model", "litft-tiny-moe", "--devices", "2", "--strategy", "fsdp", "--expert_parallel", "2", "--compile", "true"],
         "--compile true is not supported with --expert_parallel"),
        (["--strategy", "deepspeed", "--compile", "true"], "--compile true is not supported with DeepSpeed"),
        (["--compile", "maybe"], "--compile"),
        (["--fp8", "tensorwise", "--precision", "bf16-true", "--accelerator", "cpu"], "--fp8 needs a GPU with FP8 matmuls"),
        (["--fp8", "tensorwise", "--precision", "32-true"], "--fp8 casts bf16 matmuls to FP8; use --precision bf16-true or bf16-mixed"),
        (["--fp8", "columnwise"], "--fp8"),
        (["--train.max_step", "3"], "unknown flag --train.max_step; did you mean --train.max_steps?"),
        (["--data.json_path", "x.json"], "--data.json_path is an option of --data JSON, not of TinyTasks (this run's data); add --data JSON before it"),
        (["--data", "JSON", "--data.json_pth", "x.json"], "--data JSON has no option json_pth; did you mean --data.json_path?"),
        (["--fp8", "rowwise", "--precision", "bf16-true", "--strategy", "deepspeed"], "--fp8 is not supported under DeepSpeed"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, args, message):
    code, err = run_main(["finetune_full", *SMALL, "--out_dir", tmp_path / "o", *args], capsys)
    assert code == 2
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_tensor_parallel_refuses_a_4bit_base(tmp_path, capsys):
    args = ["finetune_lora", *SMALL, "--quantize", "bnb.nf4", "--strategy", "fsdp", "--devices", "2", "--tensor_parallel", "2"]
    code, err = run_main([*args, "--out_dir", tmp_path / "o"], capsys)
    assert code == 2 and "--quantize with --tensor_parallel is not supported" in err and len(err.splitlines()) == 1, err


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
    main(["finetune_full", *SMALL, "--out_dir", str(out), "--overwrite"])  # a yes/no flag alone means yes
    assert (out / "final" / "model.safetensors").stat().st_mtime_ns != first
    assert (out / "notes.txt").read_text() == "mine"
    # --overwrite deletes what --resume would continue from only where the checkpoint lies inside out_dir.
    code, err = run_main(["finetune_full", *SMALL, "--out_dir", out, "--resume", "auto", "--overwrite"], capsys)
    assert code == 2 and "deletes the checkpoints that --resume continues from" in err
    other = tmp_path / "other"
    main(["finetune_full", *SMALL, "--out_dir", str(other), "--eval.interval", "0"])
    main(["finetune_full", *SMALL, "--out_dir", str(other), "--resume", str(out), "--overwrite"])
    assert list((out / "checkpoints").glob("step-*")) and (other / "final" / "model.safetensors").is_file()
    # The recorded config is a valid --config file that reproduces the run's settings.
    again = cli_parser().parse_args(["finetune_full", "--config", str(out / "run_config.yaml")]).finetune_full
    assert again.train.max_steps == 1 and again.data.init_args.num_train == 64 and again.model == "litft-tiny"


def test_yes_no_flags_take_the_bare_form():
    from litft.__main__ import bare_booleans

    commands = parser_jobs()
    assert bare_booleans(["env", "--check"], commands) == ["env", "--check", "true"]
    assert bare_booleans(["finetune_lora", "--compile", "--train.gradient_checkpointing", "--overwrite", "false"], commands) == [
        "finetune_lora", "--compile", "true", "--train.gradient_checkpointing", "true", "--overwrite", "false"]
    assert bare_booleans(["finetune_full", "--devices", "2"], commands) == ["finetune_full", "--devices", "2"]


def test_unreachable_hub_id_is_one_line(tmp_path, capsys):
    code, err = run_main(["finetune_full", "litft-test/not-a-real-model", *SMALL, "--out_dir", tmp_path / "o"], capsys)
    assert code == 2 and "could not load 'litft-test/not-a-real-model'" in err and len(err.splitlines()) == 1


def test_batch_defaults_follow_the_world_size():
    """--devices 8 alone: the default global batch 32 is rounded up to 8 x 8, and one line says so; a given one is kept."""
    import inspect

    from litft.config import TrainArgs
    from litft.cli.jobs import RunSpec, finetune_full

    flags = inspect.signature(finetune_full).bind(devices=8)
    flags.apply_defaults()
    spec = RunSpec.from_flags("finetune_full", dict(flags.arguments))
    note = spec.check()
    assert spec.train.global_batch_size == 64 and spec.train.micro_batch_size == 8
    assert note == "global batch 64 samples (--train.global_batch_size not given; the default 32 rounded up to a multiple of micro batch 8 x 8 ranks)"
    assert TrainArgs(micro_batch_size=8).resolved(4) == (TrainArgs(micro_batch_size=8, global_batch_size=32), None)
    assert TrainArgs(global_batch_size=24, micro_batch_size=4).resolved(8)[0].global_batch_size == 24  # given: kept, then checked


HF_PARQUET = ["--data", "HF", "--data.path", "d.parquet"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--train.learning_rate", "0"], "--train.learning_rate must be positive (the peak of the schedule), got 0.0"),
        (["--train.learning_rate", "nan"], "--train.learning_rate: expected float, got nan"),
        (["--train.learning_rate", "fast"], "--train.learning_rate: expected float, got fast"),
        (["--train.min_lr=-1e-5"], "--train.min_lr must be at least 0"),
        (["--train.min_lr", "0.1"], "--train.min_lr 0.1 is above --train.learning_rate"),
        (["--train.beta1", "1.0"], "--train.beta1 is AdamW's decay rate of the gradient mean, in [0, 1), got 1.0"),
        (["--train.beta2", "-0.5"], "--train.beta2 is AdamW's decay rate of the squared gradients, in [0, 1)"),
        (["--train.weight_decay", "-0.1"], "--train.weight_decay must be at least 0"),
        (["--train.warmup_steps", "-1"], "--train.warmup_steps must be at least 0"),
        (["--train.max_norm", "0"], "--train.max_norm must be positive (the largest gradient norm) or null for no clipping"),
        (["--train.peak_tflops", "-3"], "--train.peak_tflops must be positive"),
        (["--train.peak_tflops", "inf"], "--train.peak_tflops: Does not validate"),
        (["--train.micro_batch_size", "0"], "--train.global_batch_size and --train.micro_batch_size must be at least 1"),
        (["--train.epochs", "0"], "--train.epochs must be at least 1 (or null for no limit)"),
        (["--train.max_tokens", "-5"], "--train.max_tokens must be at least 1"),
        (["--train.log_interval", "0"], "--train.log_interval must be at least 1"),
        (["--train.save_interval", "0"], "--train.save_interval must be at least 1 (or null to save only at the end)"),
        (["--train.keep_checkpoints", "0"], "--train.keep_checkpoints must be at least 1"),
        (["--eval.interval", "-1"], "--eval.interval must be at least 0"),
        (["--eval.max_batches", "0"], "--eval.max_batches must be at least 1"),
        (["--eval.score_samples", "-2"], "--eval.score_samples must be at least 0"),
        (["--eval.max_new_tokens", "0"], "--eval.max_new_tokens must be at least 1"),
        (["--lora_r", "0"], "--lora_r must be at least 1"),
        (["--lora_alpha", "-16"], "--lora_alpha must be positive"),
        (["--lora_dropout", "1.5"], "--lora_dropout is a probability in [0, 1), got 1.5"),
        (["--devices", "0"], "--devices must be at least 1"),
        (["--num_nodes", "0"], "--num_nodes must be at least 1"),
        (["--context_parallel", "0"], "--context_parallel must be at least 1"),
        (["--tensor_parallel", "0"], "--tensor_parallel must be at least 1"),
        (["--data.max_seq_length", "0"], "--data.max_seq_length must be at least 1"),
        (["--data.num_train", "0"], "--data.num_train must be at least 1"),
        ([*HF_PARQUET, "--data.val_split_fraction", "1"], "--data.val_split_fraction is the share held out for validation, in [0, 1)"),
        ([*HF_PARQUET, "--data.shuffle_buffer", "0"], "--data.shuffle_buffer must be at least 1"),
        ([*HF_PARQUET, "--data.val_samples", "-1"], "--data.val_samples must be at least 0"),
        ([*HF_PARQUET, "--data.num_proc", "0"], "--data.num_proc must be at least 1 (or null to choose by the data's size)"),
    ],
)
def test_bad_numbers_are_one_line(tmp_path, capsys, args, message):
    """Every numeric flag: a value out of its range (or not a number) is one line, and nothing is written."""
    code, err = run_main(["finetune_lora", *SMALL, "--out_dir", tmp_path / "o", *args], capsys)
    assert code == 2
    assert err.startswith("litft: error:") and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_mix_weights_are_checked(tmp_path, capsys):
    sources = '[{"class_path": "TinyTasks"}, {"class_path": "TinyTasks"}]'
    for weights, message in (("[1]", "--data.weights has 1 values for 2 sources"), ("[1, -2]", "--data.weights must be positive")):
        code, err = run_main(["finetune_full", "--data", "Mix", "--data.sources", sources, "--data.weights", weights, "--out_dir", tmp_path / "o"], capsys)
        assert code == 2 and message in err and len(err.splitlines()) == 1, err


def test_job_help_puts_a_first_runs_flags_first_and_names_the_data_options(capsys):
    """--help: the flags a first run sets, each --data choice with its options, and where every other flag is (--help all)."""
    with pytest.raises(SystemExit) as stop:
        main(["finetune_lora", "--help"])
    short = capsys.readouterr().out
    assert stop.value.code == 0 and len(short.splitlines()) < 60
    for flag in ("MODEL, --model", "--data ", "--lora_r", "--train.micro_batch_size", "--resume"):
        assert flag in short, flag
    assert re.search(r"^  JSON\s+json_path, val_path", short, flags=re.M) and "litft finetune_lora --help all" in short
    with pytest.raises(SystemExit):
        main(["finetune_lora", "--help", "all"])
    assert "--deepspeed.nvme_path" in capsys.readouterr().out


def test_download_without_the_hub_is_one_line(capsys, monkeypatch):
    """litft download names the model and what to check when the hub cannot be reached (offline here), and writes nothing."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, err = run_main(["download", "some-org/no-such-model"], capsys)
    assert code == 2 and err.startswith("litft: error: could not download some-org/no-such-model") and len(err.splitlines()) == 1, err
