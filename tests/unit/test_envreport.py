"""litft env: the report a bug report needs, and which strategies --check runs here."""

from litft.__main__ import main
from litft.cli.envreport import check_cases


def test_report_names_versions_backends_and_attention_per_precision(capsys):
    main(["env"])
    out = capsys.readouterr().out
    for word in ("torch ", "lightning", "transformers", "peft", "bitsandbytes", "deepspeed", "liger-kernel", "datasets", "distributed   gloo"):
        assert word in out, word
    attention = [line for line in out.splitlines() if line.startswith("attention")]
    assert len(attention) == 3 and all("litft_segments with SDPA" in line for line in attention)  # no CUDA here
    assert "varlen kernel" in out


def test_check_runs_every_strategy_of_a_cpu_machine_on_two_processes():
    cases, accelerator, world = check_cases()
    assert (accelerator, world) == ("cpu", 2)
    assert [c.strategy for c in cases] == ["single", "ddp", "fsdp", "zero2", "zero3"]
    assert {c.precision for c in cases} == {"32-true"}


def test_check_says_what_it_skips_and_why(monkeypatch):
    """A machine without DeepSpeed, or with one GPU, is told which strategies --check leaves out, not left to wonder."""
    from litft.cli import envreport

    monkeypatch.setattr(envreport, "installed", lambda package: None if package == "deepspeed" else "1")
    lines = envreport.skipped_strategies(world=1)
    assert any(line.startswith("ZeRO-2 and ZeRO-3: DeepSpeed is not installed") for line in lines)
    assert any(line.startswith("DDP: one GPU here") for line in lines)
    monkeypatch.setattr(envreport, "installed", lambda package: "1")
    assert envreport.skipped_strategies(world=2) == []
