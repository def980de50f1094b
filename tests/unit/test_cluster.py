import threading
import time

import pytest

from litft.launch.cluster import apply_launcher_env, check_in, launcher, preflight
from litft.errors import LitftError
from litft.launch.launchers import free_port

TORCHRUN = {"RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}
# What srun sets for `sbatch --nodes=2 --ntasks-per-node=4`.
SLURM = {"SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_NAME": "train", "SLURM_PROCID": "0"}


def test_launchers_are_told_apart():
    assert launcher(TORCHRUN) == "torchrun"
    assert launcher(SLURM) == "slurm"
    assert launcher(dict(SLURM, SLURM_JOB_NAME="interactive")) == "litft"  # salloc shell: litft launches
    assert launcher({"LOCAL_RANK": "1", "NODE_RANK": "0"}) == "litft"  # a process litft itself started


def test_matching_worlds_pass():
    preflight(4, 2, TORCHRUN)
    preflight(4, 2, SLURM)
    preflight(4, 2, {"SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "train"})
    preflight(2, 1, {})


@pytest.mark.parametrize(
    "devices, num_nodes, env, message",
    [
        (8, 1, TORCHRUN, "torchrun started 4 processes on this node but --devices is 8; pass --devices 4"),
        (4, 1, TORCHRUN, "torchrun's world has 8 processes but --devices 4 x --num_nodes 1 is 4; pass --num_nodes 2"),
        (8, 2, SLURM, "SLURM runs 4 tasks per node but --devices is 8; set #SBATCH --ntasks-per-node=8"),
        (4, 4, SLURM, "SLURM gave 2 nodes but --num_nodes is 4"),
        (2, 2, {"MASTER_ADDR": "10.0.0.1"}, "--num_nodes 2 needs MASTER_PORT, NODE_RANK set on every node"),
        (2, 2, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "2"}, "NODE_RANK=2 is outside 0..1"),
    ],
)
def test_mismatched_worlds_fail_in_one_line(devices, num_nodes, env, message):
    with pytest.raises(LitftError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        preflight(devices, num_nodes, env)


def test_node_zero_unreachable_fails_within_the_timeout():
    port = free_port()
    started = time.monotonic()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "1", "LITFT_RENDEZVOUS_TIMEOUT": "2"}
    with pytest.raises(LitftError, match=f"node 0 at MASTER_ADDR=127.0.0.1 did not answer on MASTER_PORT \\+ 1 = {port + 1} within 2 s"):
        preflight(2, 2, env)
    assert time.monotonic() - started < 15


def check_in_all(nodes, num_nodes, timeout=3.0):
    """Node main processes as threads; what each one raised (None when it may go on)."""
    port, outcome = free_port(), {}

    def node(rank):
        try:
            check_in(rank, num_nodes, 2, "127.0.0.1", port, timeout)
            outcome[rank] = None
        except LitftError as err:
            outcome[rank] = str(err)

    threads = [threading.Thread(target=node, args=(r,)) for r in nodes]
    for t in threads:
        t.start()
        time.sleep(0.2)  # node 0 first, as its store must listen before the others connect
    for t in threads:
        t.join(timeout=60)
    return outcome


def test_every_node_checks_in():
    assert check_in_all([0, 1, 2], 3) == {0: None, 1: None, 2: None}


def test_a_missing_node_is_named_on_every_node_that_came():
    started = time.monotonic()
    outcome = check_in_all([0, 2], 3)
    expected = "node 1 (ranks 2-3) did not join within 3 s of node 0 (2 of 3 nodes arrived)"
    assert outcome.keys() == {0, 2} and all(expected in message for message in outcome.values()), outcome
    assert time.monotonic() - started < 20


def test_nnodes_and_nproc_per_node_fill_default_flags():
    assert apply_launcher_env(1, 1, {"NNODES": "2", "NPROC_PER_NODE": "8"}) == (8, 2)
    assert apply_launcher_env(8, 2, {"NNODES": "2", "NPROC_PER_NODE": "8"}) == (8, 2)
    assert apply_launcher_env(4, 1, {}) == (4, 1)
    with pytest.raises(LitftError, match="--devices 4 disagrees with NPROC_PER_NODE=8"):
        apply_launcher_env(4, 1, {"NPROC_PER_NODE": "8"})


def test_a_restarted_run_is_recognised(monkeypatch):
    from litft.launch.cluster import restarted

    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert restarted() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert restarted() is None
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert restarted() == "SLURM requeue 2"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restarted() == "torchrun restart 1"


def test_peer_watch_names_a_frozen_rank_and_a_straggler():
    """Three ranks' records in a real store: rank 1 keeps beating in step 7, rank 2 stopped beating."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from litft.launch.watch import PeerWatch

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    watch = PeerWatch(rank=0, world_size=3, devices=2, timeout=0.5, store=store)
    watch.at(8)
    watch._publish()
    store.set("2", "5 8")

    def rank_1_in_step_7():
        alive = PeerWatch(rank=1, world_size=3, devices=2, timeout=600, store=store, interval=0.1)  # beats, never judges
        alive.at(7)
        return alive

    with rank_1_in_step_7():
        verdict, fatal = watch.verdict()
    assert fatal and "for rank 2 (node 1): no sign of life" in verdict, verdict
    store.set("2", "done")  # a rank that left the loop is not missing
    with rank_1_in_step_7():
        verdict, fatal = watch.verdict()
    assert not fatal and "for rank 1 (node 0), alive but still in an earlier step" in verdict, verdict


def test_peer_watch_ranks_judging_together_see_each_other_alive(capfd):
    """A slow phase on every rank: both judge at once, and each keeps beating while it judges; no one is killed."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from litft.launch.watch import PeerWatch

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    killed = []
    watches = [PeerWatch(rank=r, world_size=2, devices=1, timeout=0.3, store=store, interval=0.1) for r in (0, 1)]
    for watch in watches:
        watch.on_fatal = lambda rank=watch.rank: killed.append(rank)
        watch.at(5, "saving a checkpoint")
    with watches[0], watches[1]:
        time.sleep(2.0)
    assert killed == []
    assert "litft: warning: step 5 (saving a checkpoint) has taken" in capfd.readouterr().err
