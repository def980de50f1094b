"""Nothing already written is lost to bad input (litft.run.outdir): against a finished run, a missing reward file, a corrupt
data record, a reward that raises at step-0 validation and a mismatched resume each fail in one line with the earlier run's
every file as it was, with and without --overwrite; the corrected command then starts, and an overwrite leaves nothing of
the earlier run behind (its rollouts included)."""

import hashlib
import json

import pytest

from litft.__main__ import main


def raises_at_once(prompts, completions, completion_ids, **columns):
    raise ValueError("this reward is not ready")


def snapshot(folder):
    """Every file under ``folder`` and a hash of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def grpo(out, prompts, *extra):
    return ["finetune_lora", "--objective", "grpo", "--objective.group_size", "2", "--objective.max_new_tokens", "4",
            "--objective.rewards", "format", "--data", "Prompts", "--data.path", str(prompts), "--data.val_split_fraction", "0.25",
            "--train.global_batch_size", "2", "--train.micro_batch_size", "4", "--train.max_steps", "2", "--eval.interval", "0",
            "--accelerator", "cpu", "--logger_name", "csv", "--out_dir", str(out), *extra]


def fails(argv, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code not in (0, None)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_bad_input_leaves_a_finished_run_as_it_was_and_the_corrected_rerun_starts(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w}", "answer": w}) + "\n" for w in "abcdefgh"))
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text(prompts.read_text() + '{"prompt": "unterminated\n')
    out = tmp_path / "run"
    main(grpo(out, prompts, "--train.save_interval", "1"))  # two cycles: rollouts/step-1 and step-2
    before = snapshot(out)
    assert {"run_config.yaml", "rollouts/step-1.jsonl", "rollouts/step-2.jsonl", "final-adapter/adapter_config.json"} <= set(before)
    bad = {
        "missing reward file": (grpo(out, prompts, "--objective.rewards", str(tmp_path / "nosuch.py") + ":fn"), "nosuch.py"),
        "corrupt record": (grpo(out, corrupt), "corrupt.jsonl"),
        "reward raising at step-0 validation": (grpo(out, prompts, "--objective.rewards", "tests.integration.test_out_dir:raises_at_once",
                                                     "--eval.initial_validation", "true"), "this reward is not ready"),
    }
    for name, (argv, says) in bad.items():
        for overwrite in ([], ["--overwrite", "true"]):  # without it the folder may be refused first, before the data is read
            err = fails(argv + overwrite, capsys)
            assert says in err or not overwrite and "already holds a run" in err, (name, overwrite, err[-2000:])
            assert snapshot(out) == before, (name, overwrite)
    # A resume whose checkpoint does not fit (another global batch) is refused before anything is written.
    err = fails(grpo(out, prompts, "--resume", "auto", "--train.global_batch_size", "4", "--train.max_steps", "3"), capsys)
    assert "resume with the same global batch" in err and snapshot(out) == before
    err = fails(grpo(out, prompts, "--resume", "auto", "--overwrite", "true"), capsys)
    assert "--overwrite true deletes the checkpoints that --resume continues from" in err and snapshot(out) == before

    # Without --overwrite a finished run is refused; with it, the corrected run replaces every file of the earlier one.
    err = fails(grpo(out, prompts, "--train.max_steps", "1"), capsys)
    assert "already holds a run" in err and snapshot(out) == before
    main(grpo(out, prompts, "--train.max_steps", "1", "--overwrite", "true"))
    after = snapshot(out)
    assert "rollouts/step-1.jsonl" in after and "rollouts/step-2.jsonl" not in after and ".replaced" not in " ".join(after)
    assert after["run_config.yaml"] != before["run_config.yaml"]


def test_a_fresh_start_that_fails_leaves_no_trace_and_its_rerun_is_not_refused(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w}", "answer": w}) + "\n" for w in "abcdefgh"))
    out = tmp_path / "fresh"
    err = fails(grpo(out, prompts, "--objective.rewards", "tests.integration.test_out_dir:raises_at_once", "--eval.initial_validation",
                     "true"), capsys)
    assert "this reward is not ready" in err and "saved no checkpoint, so what it wrote is removed" in err
    assert not out.exists()
    main(grpo(out, prompts, "--train.max_steps", "1"))
    assert (out / "final-adapter" / "adapter_config.json").is_file()
