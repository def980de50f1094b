"""Surviving the cluster, in real processes: a stop signal mid-run, a rank killed under torchrun, a real srun, a missing node, a launcher that disagrees with the flags."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.conftest import ROOT, read_metrics, run_cli, slurm_available  # noqa: F401 (read by the skipif condition)
from tests.distributed.test_sharding import free_port

ARGS = [
    "--data", "TinyTasks", "--data.num_train", "256", "--data.num_val", "8", "--train.global_batch_size", "8",
    "--train.learning_rate", "3e-3", "--train.warmup_steps", "1", "--eval.interval", "0", "--eval.max_batches", "1",
    "--eval.initial_validation", "false", "--precision", "32-true", "--accelerator", "cpu",
]


def final_loss(out_dir):
    return [r["loss"] for r in read_metrics(out_dir) if "loss" in r][-1]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One process, never stopped: the final loss of 20 steps."""
    out = tmp_path_factory.mktemp("uninterrupted")
    run_cli("finetune_full", *ARGS, "--train.max_steps", "20", "--train.micro_batch_size", "4", "--out_dir", out)
    return final_loss(out)


def assert_same_final_loss(out_dir, expected):
    assert abs(final_loss(out_dir) - expected) <= 1e-5 * expected


def stop_when_step_two_shows(proc, stop):
    """Read the run's output; at its second step call ``stop``; return everything it printed and its exit status."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 2/20"):
            stop()
            break
    lines += proc.stdout.readlines()
    return lines, proc.wait(timeout=120)


def stopped_step(lines, signal_name):
    stopped = [line for line in lines if f"stopped by {signal_name}" in line]
    assert stopped and "continue with --resume auto" in stopped[0], "".join(lines)[-3000:]
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert 2 <= step < 20
    return step


def test_ctrl_c_finishes_the_step_checkpoints_and_resumes(tmp_path, uninterrupted):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) stops every rank after the same step, with one line
    and a checkpoint, no traceback; --resume auto completes the run. SIGTERM takes the same path (tests/unit/test_loop_parts.py)."""
    args = ["finetune_full", *ARGS, "--train.max_steps", "20", "--train.save_interval", "1000", "--devices", "2", "--train.micro_batch_size", "2"]
    out = tmp_path / "interrupted"
    proc = subprocess.Popen(
        [sys.executable, "-m", "litft", *args, "--out_dir", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True,
    )
    lines, status = stop_when_step_two_shows(proc, lambda: os.killpg(proc.pid, signal.SIGINT))
    assert status == 0 and not any("Traceback" in line or "KeyboardInterrupt" in line for line in lines), "".join(lines)[-3000:]
    assert any(line.startswith("litft: Ctrl-C: finishing this step") for line in lines)
    step = stopped_step(lines, "SIGINT")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-{step:08d}"]
    assert not (out / "final").exists()
    run_cli(*args, "--out_dir", out, "--resume", "auto")
    assert_same_final_loss(out, uninterrupted)


def test_frozen_rank_is_named_within_seconds(tmp_path):
    """Rank 1 is frozen (SIGSTOP) mid-run: rank 0 names it and exits instead of waiting 30 minutes in a collective."""
    args = ["finetune_full", *ARGS, "--train.max_steps", "20", "--devices", "2", "--train.micro_batch_size", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "litft", *args, "--out_dir", str(tmp_path / "frozen")], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1", LITFT_COLLECTIVE_TIMEOUT="3"),
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 2/20"):
            break
    rank_1 = int(open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()[0])  # the process litft started
    os.kill(rank_1, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        status = proc.wait(timeout=120)
        waited = time.monotonic() - frozen_at
    finally:
        os.kill(rank_1, signal.SIGKILL)  # it holds the output pipe open
    lines += proc.stdout.readlines()
    named = [line for line in lines if line.startswith("litft: error: step ")]
    assert status == 1 and named, "".join(lines)[-3000:]
    assert "for rank 1 (node 0): no sign of life" in named[0] and "the launcher restarts the run" in named[0], named
    assert waited < 30, waited  # LITFT_COLLECTIVE_TIMEOUT plus a few beats
    print(f"named {waited:.1f} s after the freeze: {named[0].strip()}")


DIE_ONCE_AFTER_STEP_4 = """
import os, signal, sys
import litft.checkpoint as checkpoint
save = checkpoint.Checkpointer.save
def save_then_die(self, position):
    path = save(self, position)
    if position["step"] == 4 and os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    return path
checkpoint.Checkpointer.save = save_then_die
from litft.__main__ import main
main(sys.argv[1:])
"""


def test_rank_killed_under_torchrun_restarts_and_resumes(tmp_path, uninterrupted):
    """Rank 1 is SIGKILLed after its step-4 checkpoint; torchrun restarts both ranks, which resume by themselves."""
    script = tmp_path / "die_once.py"
    script.write_text(DIE_ONCE_AFTER_STEP_4)
    out = tmp_path / "elastic"
    job = ["finetune_full", *ARGS, "--train.max_steps", "20", "--train.save_interval", "2", "--devices", "2", "--train.micro_batch_size", "2"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max_restarts", "1",
                "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--rdzv_id", f"litft-{uuid.uuid4().hex[:8]}"]
    # The script imports litft from this checkout, as `python -m litft` does from the working directory.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([*torchrun, str(script), *job, "--out_dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    printed = proc.stdout + proc.stderr
    assert proc.returncode == 0, printed[-4000:]
    assert "exitcode: -9" in printed and "resumed from" in printed and "step-00000004" in printed, printed[-4000:]
    assert_same_final_loss(out, uninterrupted)
    assert (out / "final" / "model.safetensors").is_file()


def test_world_size_mismatch_fails_fast_with_one_line(tmp_path):
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "litft", "finetune_full",
         *ARGS, "--devices", "4", "--out_dir", str(tmp_path / "x")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode != 0 and elapsed < 90, (elapsed, proc.stderr[-2000:])
    expected = "litft: error: torchrun started 2 processes on this node but --devices is 4; pass --devices 2 (or torchrun --nproc_per_node 4)"
    assert expected in proc.stderr.splitlines()
    assert not (tmp_path / "x").exists()


slurm = pytest.mark.skipif("not slurm_available()", reason="no SLURM here (.ci/slurm.sh starts one)")


@slurm
def test_srun_trains_like_one_process_and_stops_on_usr1(tmp_path, uninterrupted):
    """A real SLURM: srun starts 2 tasks that litft joins; then scancel --signal=USR1 (what --signal sends before the time limit) stops a run."""
    job = ["finetune_full", *ARGS, "--devices", "2", "--train.micro_batch_size", "2"]
    srun = ["srun", "--nodes", "1", "--ntasks-per-node", "2", sys.executable, "-m", "litft", *job]
    done = subprocess.run([*srun, "--train.max_steps", "20", "--out_dir", str(tmp_path / "full")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_final_loss(tmp_path / "full", uninterrupted)

    name = f"litft-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "signalled"
    proc = subprocess.Popen(
        [*srun[:1], "--job-name", name, *srun[1:], "--train.max_steps", "20", "--train.save_interval", "1000", "--out_dir", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    lines, status = stop_when_step_two_shows(proc, lambda: subprocess.run(["scancel", "--signal=USR1", "--name", name], check=True))
    assert status == 0, "".join(lines)[-3000:]
    step = stopped_step(lines, "SIGUSR1")
    assert '"world_size": 2' in (out / "checkpoints" / f"step-{step:08d}" / "meta.json").read_text()


@slurm
def test_srun_task_count_mismatch_fails_fast(tmp_path):
    started = time.monotonic()
    proc = subprocess.run(
        ["srun", "--nodes", "1", "--ntasks-per-node", "2", sys.executable, "-m", "litft", "finetune_full", *ARGS, "--devices", "4",
         "--out_dir", str(tmp_path / "x")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode != 0 and elapsed < 90, (elapsed, proc.stderr[-2000:])
    expected = "litft: error: SLURM runs 2 tasks per node but --devices is 4; set #SBATCH --ntasks-per-node=4 (one task per GPU) or pass --devices 2"
    assert expected in proc.stderr.splitlines(), proc.stderr[-2000:]


def test_missing_node_is_named_instead_of_a_hang(tmp_path):
    """Nodes 0 and 1 of a 3-node launch on 127.0.0.1: both stop at the rendezvous timeout, naming node 2 and its ranks."""
    port = str(free_port())
    args = [sys.executable, "-m", "litft", "finetune_full", *ARGS, "--devices", "2", "--num_nodes", "3", "--out_dir", str(tmp_path / "x")]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LITFT_RENDEZVOUS_TIMEOUT="15")  # long enough for node 1 to arrive on a loaded machine
    started = time.monotonic()
    nodes = [
        subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env, NODE_RANK=str(rank)))
        for rank in (0, 1)
    ]
    errors = [node.communicate(timeout=120)[1] for node in nodes]
    assert time.monotonic() - started < 110  # imports plus the 15 s wait; the process group's own timeout is 30 minutes
    expected = "litft: error: node 2 (ranks 4-5) did not join within 15 s of node 0 (2 of 3 nodes arrived); start the missing nodes"
    for node, err in zip(nodes, errors):
        assert node.returncode == 2 and err.strip().splitlines()[-1].startswith(expected), err[-2000:]
