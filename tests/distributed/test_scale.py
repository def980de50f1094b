"""What a real cluster run would hit, guarded on CPU processes: sharded accumulation, scoring with few prompts,
an out_dir that is not shared, rank-0 work longer than the process group's timeout, a stop signal during a hung
collective, QLoRA under HYBRID_SHARD across two nodes."""

import json
import os
import re
import signal
import subprocess
import sys
import time

from tests.conftest import ROOT, read_metrics, run_cli
from tests.distributed.test_sharding import free_port

SMALL = [
    "--data", "TinyTasks", "--data.num_train", "32", "--data.num_val", "4", "--train.max_steps", "1", "--train.learning_rate", "3e-3",
    "--eval.interval", "0", "--eval.max_batches", "1", "--eval.initial_validation", "false", "--precision", "32-true", "--accelerator", "cpu",
]

# After each micro-batch's backward that is not the step's last, print what every parameter's gradient is on this rank.
GRADS_AFTER_MICROBATCH = """
import json, sys
from contextlib import contextmanager
import torch
from torch.distributed.tensor import DTensor
from litft.parallel.strategies import fsdp
inner = fsdp.ReplicaSync.no_backward_sync
@contextmanager
def recording(self, module, enabled):
    with inner(self, module, enabled):
        yield
    if enabled:
        params = list(module.parameters())
        print("GRADS " + json.dumps({
            "sharded": all(isinstance(p.grad, DTensor) for p in params),
            "grad_elements": sum(p.grad.to_local().numel() for p in params if p.grad is not None),
            "param_elements": sum(p.numel() for p in params),
        }), flush=True)
fsdp.ReplicaSync.no_backward_sync = recording
from litft.__main__ import main
main(sys.argv[1:])
"""


def test_fsdp_accumulation_keeps_gradients_sharded(tmp_path):
    """Between micro-batches each rank holds only its shard of the gradients, not the whole model's (FSDP2's no-sync mode)."""
    script = tmp_path / "grads_after_microbatch.py"  # a file: litft starts rank 1 by running the same command again
    script.write_text(GRADS_AFTER_MICROBATCH)
    proc = subprocess.run(
        [sys.executable, str(script), "finetune_full", *SMALL, "--strategy", "fsdp", "--fsdp.sharding_strategy",
         "FULL_SHARD", "--devices", "2", "--train.global_batch_size", "8", "--train.micro_batch_size", "2", "--out_dir", str(tmp_path / "o")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Two ranks share the pipe, so their lines may interleave: each record is found by its braces.
    records = [json.loads(found) for found in re.findall(r"GRADS (\{[^{}]*\})", proc.stdout)]
    assert len(records) == 2  # each rank's first of its two micro-batches
    for record in records:
        assert record["sharded"] and 0.45 <= record["grad_elements"] / record["param_elements"] <= 0.55, record


def test_score_with_fewer_prompts_than_ranks_finishes_under_fsdp(tmp_path):
    """One prompt, two FSDP ranks: rank 1 generates a stand-in so that every sharded forward has its partner."""
    out = tmp_path / "scored"
    run_cli(
        "finetune_full", *SMALL, "--strategy", "fsdp", "--fsdp.sharding_strategy", "FULL_SHARD", "--devices", "2",
        "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--eval.score_samples", "1", "--eval.max_new_tokens", "4",
        "--out_dir", out, timeout=240,
    )
    scores = [r["val_score"] for r in read_metrics(out) if "val_score" in r]
    assert len(scores) == 1 and scores[0] in (0.0, 1.0)  # the final scoring of the one prompt, counted once


def test_out_dir_that_nodes_do_not_share_is_named(tmp_path):
    """Two 'nodes' on 127.0.0.1 whose relative out_dir resolves to different folders stop within seconds, before training."""
    port = str(free_port())
    started = time.monotonic()
    nodes = []
    for rank in (0, 1):
        cwd = tmp_path / f"node{rank}"
        cwd.mkdir()
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "litft", "finetune_full", *SMALL, "--devices", "1", "--num_nodes", "2", "--train.global_batch_size", "2",
             "--train.micro_batch_size", "1", "--out_dir", "out"],
            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(rank), PYTHONPATH=str(ROOT)),
        ))
    errors = [node.communicate(timeout=240)[1] for node in nodes]
    assert time.monotonic() - started < 120
    node1 = errors[1].strip().splitlines()[-1]
    assert nodes[1].returncode == 2 and node1.startswith("litft: error: --out_dir out is not the folder rank 0 writes to: rank 1 (node 1)"), errors[1][-2000:]
    assert nodes[0].returncode == 2 and "failed while checking that out_dir is shared" in errors[0].strip().splitlines()[-1], errors[0][-2000:]
    assert not (tmp_path / "node0" / "out" / "checkpoints").exists()  # nothing trained


def test_rank_zero_tokenizing_longer_than_the_process_group_timeout_does_not_kill_the_run(tmp_path):
    """Rank 0 tokenizes for 20 s under a 15 s process-group timeout (the shortest that lets two processes meet here):
    the other rank waits on the store, not in a collective."""
    out = tmp_path / "slow"
    proc = run_cli(
        "finetune_full", *SMALL, "--data", "tests.distributed.slow_data.SlowTinyTasks", "--data.num_train", "32", "--data.num_val", "4",
        "--data.delay", "20",
        "--devices", "2", "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--out_dir", out, timeout=240, check=False,
        env={"LITFT_PROCESS_GROUP_TIMEOUT": "15"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "final" / "model.safetensors").is_file()


def test_stop_signal_during_a_hung_collective_ends_the_run(tmp_path):
    """Rank 1 frozen mid-run, the peer watch set to wait long: SIGTERM to rank 0 still ends it within LITFT_STOP_GRACE."""
    args = ["finetune_full", *SMALL, "--train.max_steps", "200", "--devices", "2", "--train.global_batch_size", "4", "--train.micro_batch_size", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "litft", *args, "--out_dir", str(tmp_path / "hung")], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1", LITFT_COLLECTIVE_TIMEOUT="600", LITFT_STOP_GRACE="2"),
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 2/200"):
            break
    rank_1 = int(open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()[0])
    os.kill(rank_1, signal.SIGSTOP)
    time.sleep(1)  # rank 0 is now in the next step's collective, waiting for rank 1
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    try:
        status = proc.wait(timeout=60)
        waited = time.monotonic() - signalled
    finally:
        os.kill(rank_1, signal.SIGKILL)
    lines += proc.stdout.readlines()
    hung = [line for line in lines if "has not reached the end of its step" in line]
    assert status == 1 and hung and hung[0].startswith("litft: error: SIGTERM arrived 2 s ago and step"), "".join(lines)[-3000:]
    assert waited < 15, waited


def test_qlora_under_hybrid_shard_across_two_nodes_finishes(tmp_path):
    """Two launches (node ranks 0 and 1) of one process each: two replicas; the replica check skips the 4-bit base."""
    out = tmp_path / "hybrid-qlora"
    port = str(free_port())
    args = [
        sys.executable, "-m", "litft", "finetune_lora", *SMALL, "--lora_r", "4", "--lora_dropout", "0", "--quantize", "bnb.nf4",
        "--strategy", "fsdp", "--devices", "1", "--num_nodes", "2", "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
        "--out_dir", str(out),
    ]
    nodes = [
        subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(rank)))
        for rank in (1, 0)
    ]
    logs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), logs[1][-3000:] + logs[0][-3000:]
    assert [r["replica_checksum_spread"] for r in read_metrics(out) if "replica_checksum_spread" in r] == [0.0]
    assert (out / "final-adapter" / "adapter_model.safetensors").is_file()
