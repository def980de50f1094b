"""Launchers that start the processes themselves: litft joins their world, and trains exactly as one process does.

Two processes started by hand with RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT,
the deepspeed launcher (on the CPU), and ``--launcher ray`` on a local Ray with two
workers, stopped by SIGTERM to the driver and resumed. Each is compared step by step
with one process on the same global batch.
"""

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_cli, step_losses
from tests.distributed.test_sharding import free_port

# Enough steps that a SIGTERM sent when the Ray driver shows step 2 still lands mid-run: the driver sees the workers'
# lines and passes signals on with a delay of seconds on a loaded machine (in CI, 9 steps of 0.25 s went by).
STEPS = 30
ARGS = [
    "finetune_full", "--data", "TinyTasks", "--data.num_train", "256", "--data.num_val", "8", "--train.global_batch_size", "8",
    "--train.learning_rate", "3e-3", "--train.warmup_steps", "1", "--eval.interval", "0", "--eval.max_batches", "1",
    "--eval.initial_validation", "false", "--precision", "32-true", "--accelerator", "cpu", "--train.max_steps", str(STEPS),
]
TWO = ["--devices", "2", "--train.micro_batch_size", "2"]
# Variables of a launcher around the test run itself would describe another world.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "LITFT_LAUNCHER", "RAY_ADDRESS")


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    return dict(env, PYTHONUNBUFFERED="1", **extra)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Per-step losses of one process on the same global batch."""
    out = tmp_path_factory.mktemp("one_process")
    run_cli(*ARGS, "--train.micro_batch_size", "8", "--out_dir", out)
    losses = step_losses(out)
    assert len(losses) == STEPS
    return losses


def assert_same_losses(out_dir, expected):
    losses = step_losses(out_dir)
    assert len(losses) == len(expected)
    worst = max(abs(a - b) / b for a, b in zip(losses, expected))
    assert worst <= 1e-5, (worst, losses, expected)
    print(f"{out_dir.name}: {len(losses)} steps, largest relative difference from one process {worst:.1e}; losses {losses}, one process {expected}")


def test_two_processes_started_by_hand_train_like_one(tmp_path, one_process):
    """The plain environment of an external launcher: litft joins it, and Lightning gets NODE_RANK from it."""
    out = tmp_path / "by_hand"
    env = clean_env(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ranks = [
        subprocess.Popen([sys.executable, "-m", "litft", *ARGS, *TWO, "--out_dir", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
        for r in (1, 0)
    ]
    printed = [rank.communicate(timeout=240)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], printed[0][-2000:] + printed[1][-2000:]
    assert "world size 2" in printed[1]
    metas = sorted((out / "checkpoints").glob("step-*/meta.json"))
    assert metas and '"world_size": 2' in metas[-1].read_text()  # both ranks joined the one world and wrote its checkpoint
    assert_same_losses(out, one_process)


def test_deepspeed_launcher_on_the_cpu(tmp_path, one_process):
    """`deepspeed --num_gpus 2 --module litft ...` starts both ranks (appending --local_rank=N); litft joins them."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "deepspeed_launcher"
    launch = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()), "--module", "litft"]
    proc = subprocess.run([*launch, *ARGS, *TWO, "--out_dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=clean_env(DS_ACCELERATOR="cpu"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "'--local_rank=1'" in proc.stdout + proc.stderr  # what the launcher appended, and litft accepted
    assert_same_losses(out, one_process)


def test_ray_workers_train_like_one_process_stop_on_sigterm_and_resume(tmp_path, one_process):
    """A local Ray with two CPU workers: SIGTERM to the driver stops both after the same step with a checkpoint; --resume auto finishes the run."""
    pytest.importorskip("ray")
    out = tmp_path / "ray"
    command = [sys.executable, "-m", "litft", *ARGS, *TWO, "--launcher", "ray", "--train.save_interval", "1000", "--out_dir", str(out)]
    driver = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env())
    lines = []
    for line in driver.stdout:
        lines.append(line)
        if f"step 2/{STEPS}" in line:
            driver.send_signal(signal.SIGTERM)
            break
    lines += driver.stdout.readlines()
    printed = "".join(lines)
    assert driver.wait(timeout=120) == 0, printed[-4000:]
    assert "Ray: 2 workers, 2 CPUs on each of 1 node(s)" in printed and "SIGTERM passed on to the 2 Ray workers" in printed, printed[-4000:]
    stopped = [line for line in lines if "stopped by SIGTERM after step" in line]
    assert len(stopped) == 1, printed[-4000:]  # rank 0 says it, for both
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert 2 <= step < STEPS
    checkpoint = out / "checkpoints" / f"step-{step:08d}"
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == [checkpoint.name] and not (out / "final").exists()
    assert '"world_size": 2' in (checkpoint / "meta.json").read_text()

    resumed = run_cli(*command[3:], "--resume", "auto", timeout=300)
    assert f"resumed from {checkpoint}" in resumed.stdout, resumed.stdout[-3000:]
    assert_same_losses(out, one_process)
    assert (out / "final" / "model.safetensors").is_file()
