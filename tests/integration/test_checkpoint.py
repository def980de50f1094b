"""One process: k steps + resume + N-k steps equal N steps bitwise, for every job; convert round trips; bad checkpoints fail in one line."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from litft.config import EvalArgs, TrainArgs
from litft.data import TextFiles, TinyTasks
from litft.errors import LitftError
from litft.cli.jobs import finetune_full, finetune_lora, pretrain
from tests.conftest import ROOT, read_metrics, run_cli

DATA = dict(num_train=64, num_val=8)
EVAL = EvalArgs(interval=0, max_batches=1, initial_validation=False)


def train_args(**overrides):
    values = dict(global_batch_size=8, micro_batch_size=4, max_steps=6, learning_rate=3e-3, warmup_steps=1, save_interval=3)
    values.update(overrides)
    return TrainArgs(**values)


def losses_by_step(out_dir):
    return {int(r["step"]): r["loss"] for r in read_metrics(out_dir) if "loss" in r}


def text_data(tmp_path):
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(" ".join(f"w{i % 37} x{i % 11}" for i in range(3000)))
    return TextFiles(train_data_path=corpus, max_seq_length=32, val_split_fraction=0.0)


JOBS = {
    "finetune_full": lambda tmp, **kw: finetune_full(data=TinyTasks(**DATA), eval=EVAL, **kw),
    # Dropout on: the resumed run must also continue the random stream.
    "finetune_lora": lambda tmp, **kw: finetune_lora(data=TinyTasks(**DATA), eval=EVAL, lora_r=4, lora_dropout=0.1, **kw),
    "qlora": lambda tmp, **kw: finetune_lora(data=TinyTasks(**DATA), eval=EVAL, lora_r=4, lora_dropout=0.1, quantize="bnb.nf4", **kw),
}


@pytest.mark.parametrize("job", [*JOBS, "pretrain"])
def test_resume_equals_uninterrupted_bitwise(tmp_path, tiny_dir, job):
    if job == "pretrain":
        run = lambda tmp, **kw: pretrain(  # noqa: E731
            model=str(tiny_dir / "config.json"), tokenizer=str(tiny_dir), data=text_data(tmp_path), eval=EVAL, **kw
        )
    else:
        run = JOBS[job]
    run(tmp_path, out_dir=tmp_path / "whole", train=train_args())
    checkpoints = sorted(p.name for p in (tmp_path / "whole" / "checkpoints").iterdir())
    assert checkpoints == ["step-00000003", "step-00000006"]
    result = run(tmp_path, out_dir=tmp_path / "resumed", train=train_args(), resume=str(tmp_path / "whole" / "checkpoints" / "step-00000003"))
    whole, resumed = losses_by_step(tmp_path / "whole"), losses_by_step(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6]
    assert [resumed[s] for s in (4, 5, 6)] == [whole[s] for s in (4, 5, 6)]  # bitwise
    meta = json.loads((tmp_path / "resumed" / "checkpoints" / "step-00000006" / "meta.json").read_text())
    assert meta["step"] == 6 and meta["world_size"] == 1 and meta["epoch_step"] == 6
    if job in ("finetune_lora", "qlora"):
        # Only adapters are stored: the frozen base comes from the model the run started from.
        assert all(".lora_" in name for name in meta["trained_shapes"])
        assert result.history  # the resumed run trained


def test_keep_last_and_resume_auto(tmp_path):
    out = tmp_path / "run"
    finetune_full(data=TinyTasks(**DATA), out_dir=out, eval=EVAL, train=train_args(max_steps=5, save_interval=1, keep_checkpoints=2))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000004", "step-00000005"]
    # auto in the same out_dir continues from the newest (here: nothing left to train).
    result = finetune_full(data=TinyTasks(**DATA), out_dir=out, eval=EVAL, train=train_args(max_steps=5, save_interval=1), resume="auto")
    assert len([h for h in result.history if "loss" in h]) == 0
    # auto with no checkpoint yet starts afresh.
    finetune_full(data=TinyTasks(**DATA), out_dir=tmp_path / "fresh", eval=EVAL, train=train_args(max_steps=2), resume="auto")
    assert sorted(losses_by_step(tmp_path / "fresh")) == [1, 2]


def logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_convert_lora_merged_and_adapter_match_training_model(tmp_path, tiny_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from litft.checkpoint.convert import convert

    result = finetune_lora(
        data=TinyTasks(**DATA), out_dir=tmp_path / "run", eval=EVAL, lora_r=4, lora_dropout=0.0, train=train_args(max_steps=3), export="both"
    )
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = logits(result.model, ids)
    merged = convert(tmp_path / "run", out_dir=tmp_path / "merged")
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in merged.iterdir()}
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(merged), ids), expected, rtol=1e-5, atol=1e-5)
    # The training run's own export is the same conversion of its final checkpoint.
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final"), ids), expected, rtol=1e-5, atol=1e-5)
    # Files of at most ~0.2 MB: several shards and an index, as a large model gets.
    sharded = convert(tmp_path / "run", out_dir=tmp_path / "sharded", max_shard_gb=2e-4)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(sharded), ids), expected, rtol=1e-5, atol=1e-5)
    adapter = convert(tmp_path / "run" / "checkpoints" / "step-00000003", out_dir=tmp_path / "adapter", merge_lora=False)
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), adapter)
    torch.testing.assert_close(logits(with_adapter, ids), expected, rtol=1e-5, atol=1e-5)
    half = convert(tmp_path / "run", out_dir=tmp_path / "bf16", dtype="bfloat16")
    assert AutoModelForCausalLM.from_pretrained(half).dtype == torch.bfloat16
    with pytest.raises(LitftError, match="already holds files"):
        convert(tmp_path / "run", out_dir=tmp_path / "merged")


def test_bad_checkpoints_fail_in_one_line(tmp_path, tiny_dir):
    out = tmp_path / "full"
    finetune_full(data=TinyTasks(**DATA), out_dir=out, eval=EVAL, train=train_args(max_steps=2, save_interval=1))
    step1 = out / "checkpoints" / "step-00000001"
    partial = out / "checkpoints" / ".step-00000009.partial"
    shutil.copytree(step1, partial)
    (partial / "meta.json").unlink()
    cases = {
        "no such checkpoint": dict(resume=str(tmp_path / "nowhere")),
        "not a finished litft checkpoint .*newest finished one is .*step-00000002": dict(resume=str(partial)),
        "resume with the same global batch": dict(resume=str(step1), train=train_args(global_batch_size=16)),
        "deletes the checkpoints": dict(resume="auto", overwrite=True),
    }
    for expected, flags in cases.items():
        flags.setdefault("train", train_args())
        with pytest.raises(LitftError, match=expected):
            finetune_full(data=TinyTasks(**DATA), out_dir=tmp_path / "x", eval=EVAL, **flags)
    # Another job, from the command line: one line, no traceback.
    proc = run_cli("finetune_lora", "--resume", step1, "--data", "TinyTasks", "--data.num_train", "64", "--accelerator", "cpu",
                   "--out_dir", tmp_path / "lora", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"litft: error: checkpoint {step1} was written by finetune_full, not finetune_lora; resume it with litft finetune_full"
    )
    # Another model: same job and flags, different shapes.
    config = json.loads((tiny_dir / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps(config))
    with pytest.raises(LitftError, match="belongs to another model .*num_hidden_layers 4 there, 2 here"):
        pretrain(model=str(tmp_path / "other" / "config.json"), tokenizer=str(tiny_dir), data=TinyTasks(**DATA), out_dir=tmp_path / "y",
                 eval=EVAL, train=train_args(), resume=str(_as_pretrain(step1)))


def _as_pretrain(checkpoint):
    """The same checkpoint, labelled as a pretrain run (only the model check then differs)."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["job"] = "pretrain"
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    return checkpoint


def test_metadata_with_foreign_pickle_is_refused(tmp_path):
    import pickle

    from litft.checkpoint import safe_reader

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(LitftError, match="refusing to read its metadata .*posix.system"):
        safe_reader(tmp_path).read_metadata()


KILL_DURING_SAVE = """
import sys, time
import litft.checkpoint.manager as checkpoint
real_write, real_save = checkpoint.write_synced, checkpoint.dcp.save
def slow_write(path, text):
    if '"step": 4' in text:  # every rank's shards for step 4 are on disk, meta.json is not yet
        print("SAVING-STEP-4", flush=True)
        time.sleep(600)
    real_write(path, text)
def slow_save(state, checkpoint_id, **kwargs):
    if "step-00000004" in str(checkpoint_id) and "--train.async_save" in sys.argv:  # the background write, under way
        print("SAVING-STEP-4", flush=True)
        time.sleep(600)
    return real_save(state, checkpoint_id=checkpoint_id, **kwargs)
checkpoint.write_synced, checkpoint.dcp.save = slow_write, slow_save
import litft.run.loop as loop
real_complete = loop.complete_save
def complete_save(trainer):
    pending = trainer.checkpointer.pending
    if pending is not None and not pending.written.done():
        print(f"WAITING-AT-STEP-{trainer.state.step}-FOR-STEP-{pending.step}", flush=True)
    return real_complete(trainer)
loop.complete_save = complete_save
from litft.__main__ import main
main(sys.argv[1:])
"""
KILLED_RUN = [
    "finetune_full", "--data", "TinyTasks", "--data.num_train", "64", "--data.num_val", "8", "--train.global_batch_size", "8",
    "--train.micro_batch_size", "4", "--train.max_steps", "6", "--train.learning_rate", "3e-3", "--train.warmup_steps", "1",
    "--train.save_interval", "2", "--eval.interval", "0", "--eval.max_batches", "1", "--eval.initial_validation", "false",
    "--precision", "32-true", "--accelerator", "cpu",
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    run_cli(*KILLED_RUN, "--out_dir", out)
    return losses_by_step(out)


@pytest.mark.parametrize("writes", ["in-line", "background"])
def test_kill_during_save_leaves_previous_checkpoint_resumable(tmp_path, uninterrupted, writes):
    """Killed at step 4's save: in-line, after the shards and before meta.json; in the background, in the middle of the
    write while training went on. Either way step 2 is the newest checkpoint and the resumed run is the uninterrupted one."""
    args = [*KILLED_RUN, *(["--train.async_save", "true"] if writes == "background" else [])]
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_DURING_SAVE, *args, "--out_dir", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    deadline, said = time.time() + 240, []
    for line in proc.stdout:
        said.append(line)
        if "SAVING-STEP-4" in line or time.time() > deadline:
            break
    if writes == "background":  # the loop is not held by the write: it trains on and waits for it only at its final save
        for line in proc.stdout:
            said.append(line)
            if "WAITING-AT-STEP-" in line or time.time() > deadline:
                break
        assert "WAITING-AT-STEP-6-FOR-STEP-4" in "".join(said), "".join(said)[-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [".step-00000004.partial", "step-00000002"], "".join(said)[-3000:]
    # In-line: the shards were there, the commit was not. In the background: the write itself was stopped.
    assert (root / ".step-00000004.partial" / "model" / ".metadata").is_file() == (writes == "in-line")
    if writes == "background":
        assert "step 4: writing a checkpoint in the background" in "".join(said), "".join(said)[-3000:]

    run_cli(*args, "--out_dir", out, "--resume", "auto")
    resumed = losses_by_step(out)
    assert [resumed[s] for s in range(1, 7)] == [uninterrupted[s] for s in range(1, 7)]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000006"]
    blocked = [r["save_blocked_s"] for r in read_metrics(out) if "save_blocked_s" in r]
    assert len(blocked) >= 2 and all(0 <= b < 60 for b in blocked)


def test_lora_export_checks_the_disk_and_writes_the_adapter_first(tmp_path, tiny_dir, monkeypatch):
    """A disk with room for the adapter but not the merged model: the adapter is written, the merged model refused in
    one line that says how much is needed and where; a disk that fills during a write is one line and leaves the
    earlier export whole. (--export adapter, the default, writes the adapter alone.)"""
    import errno

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from litft.checkpoint import convert

    run = tmp_path / "run"
    needs = {}
    real_export_bytes = convert.export_bytes

    def recorded(trained, meta, adapter_only, dtype):
        needs["adapter" if adapter_only else "merged"] = real_export_bytes(trained, meta, adapter_only, dtype)
        return needs["adapter" if adapter_only else "merged"]

    monkeypatch.setattr(convert, "export_bytes", recorded)
    monkeypatch.setattr(convert, "free_bytes", lambda folder: convert.EXPORT_MARGIN + 2**20)  # 1 MiB: the adapter's 156 kB fit
    with pytest.raises(LitftError) as refused:
        finetune_lora(data=TinyTasks(**DATA), out_dir=run, eval=EVAL, lora_r=4, lora_dropout=0.0, train=train_args(max_steps=2), export="both")
    message = str(refused.value)
    assert "\n" not in message and f"writing the merged model to {run / 'final'} needs" in message
    assert "only 0.06 GiB is free there" in message and "the checkpoint" in message and "litft convert" in message
    assert needs["adapter"] == 38_912 * 4 and needs["merged"] > 3 * 10**6  # r=4 adapters; 0.87M fp32 weights
    assert sorted(p.name for p in run.iterdir() if p.name.startswith((".final", "final"))) == ["final-adapter"]
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), run / "final-adapter")
    assert sum("lora_" in name for name, _ in with_adapter.named_parameters()) == 2 * 7 * 4  # A and B of 7 linears, 4 blocks
    from litft.cli.chat import load_for_chat

    assert load_for_chat(str(run), torch.float32)[2] == f"adapter {run / 'final-adapter'} on its base"  # a run with its adapter alone

    monkeypatch.undo()
    earlier = convert.export(checkpoint, tmp_path / "merged")
    before = (earlier / "model.safetensors").read_bytes()

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(convert.SafetensorsWriter, "__enter__", full_disk)
    with pytest.raises(LitftError, match=r"^the disk filled while writing the merged model to .*merged \(0\.07 GiB needed\); the checkpoint"):
        convert.export(checkpoint, tmp_path / "merged")
    assert (earlier / "model.safetensors").read_bytes() == before and not (tmp_path / ".merged.partial").exists()
