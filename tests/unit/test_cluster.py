import socket
import time

import pytest

from litft.cluster import apply_launcher_env, launcher, preflight
from litft.errors import LitftError

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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    started = time.monotonic()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "1"}
    with pytest.raises(LitftError, match=f"node 0 at MASTER_ADDR=127.0.0.1 MASTER_PORT={port} did not answer within 2 s"):
        preflight(2, 2, env, reach_timeout=2)
    assert time.monotonic() - started < 10


def test_nnodes_and_nproc_per_node_fill_default_flags():
    assert apply_launcher_env(1, 1, {"NNODES": "2", "NPROC_PER_NODE": "8"}) == (8, 2)
    assert apply_launcher_env(8, 2, {"NNODES": "2", "NPROC_PER_NODE": "8"}) == (8, 2)
    assert apply_launcher_env(4, 1, {}) == (4, 1)
    with pytest.raises(LitftError, match="--devices 4 disagrees with NPROC_PER_NODE=8"):
        apply_launcher_env(4, 1, {"NPROC_PER_NODE": "8"})
