"""Launchers that set the environment: which one started a process, the world it made against the flags, OpenMPI's names."""

import pytest

from litft.launch.cluster import launcher, preflight
from litft.errors import LitftError
from litft.launch.launchers import environment_world, without_local_rank_argument

# What the deepspeed launcher sets for rank 3 of `deepspeed --num_nodes 2 --num_gpus 2` (on node 1).
DEEPSPEED = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "CROSS_RANK": "1", "CROSS_SIZE": "2", "LOCAL_SIZE": "2",
             "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
# What OpenMPI's mpirun sets for rank 5 of `mpirun -np 8 --map-by ppr:4:node` (two nodes).
OPENMPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
BY_HAND = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_environment_launchers_are_told_apart():
    assert launcher(DEEPSPEED) == launcher(OPENMPI) == launcher(BY_HAND) == "environment"
    # Inside a SLURM allocation the nearer launcher wins: these processes are not SLURM's tasks.
    assert launcher(dict(BY_HAND, SLURM_NTASKS="1", SLURM_JOB_NAME="train")) == "environment"
    # Processes litft itself started keep being litft's, even with a RANK the user's shell exported.
    assert launcher({"RANK": "0", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "NODE_RANK": "0", "LITFT_LAUNCHER": "litft"}) == "litft"
    # Lightning's own children (no RANK) as before.
    assert launcher({"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}) == "litft"


def test_a_matching_world_gives_lightning_the_node_rank():
    assert environment_world(2, 2, DEEPSPEED) == {"NODE_RANK": "1"}
    assert environment_world(2, 1, BY_HAND) == {"NODE_RANK": "0"}
    assert preflight(2, 2, DEEPSPEED) == {"NODE_RANK": "1"}
    # Without CROSS_RANK or NODE_RANK the node is RANK // devices.
    assert environment_world(2, 2, {k: v for k, v in DEEPSPEED.items() if k != "CROSS_RANK"}) == {"NODE_RANK": "1"}


def test_openmpi_variables_become_the_standard_ones():
    added = environment_world(4, 2, OPENMPI)
    assert added == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "NODE_RANK": "1"}
    # One node: rank 0's host is this one, but the port must be agreed on.
    one_node = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(LitftError, match=r"mpirun started 2 processes but MASTER_PORT is not set; .*mpirun -x MASTER_ADDR"):
        environment_world(2, 1, one_node)
    assert environment_world(2, 1, dict(one_node, MASTER_PORT="29500"))["MASTER_ADDR"] == "127.0.0.1"


@pytest.mark.parametrize(
    "devices, num_nodes, env, message",
    [
        (4, 2, DEEPSPEED, "the deepspeed launcher started 2 processes on this node (LOCAL_SIZE) but --devices is 4; pass --devices 2"),
        (2, 1, DEEPSPEED, "the deepspeed launcher's world has 4 processes (WORLD_SIZE) but --devices 2 x --num_nodes 1 is 2; pass --num_nodes 2"),
        (1, 1, BY_HAND, "the launcher's world has 2 processes (WORLD_SIZE) but --devices 1 x --num_nodes 1 is 1; pass --devices 2 on one node"),
        (2, 1, dict(BY_HAND, LOCAL_RANK="2"), "LOCAL_RANK=2 is outside 0..1 for --devices 2"),
        (2, 1, dict(BY_HAND, RANK="0"), "RANK=0 is not node 0 x --devices 2 + LOCAL_RANK=1: litft numbers ranks node by node"),
        (2, 2, dict(DEEPSPEED, CROSS_RANK="0"), "RANK=3 is not CROSS_RANK=0 x --devices 2 + LOCAL_RANK=1"),
        (2, 1, {k: v for k, v in BY_HAND.items() if k != "MASTER_PORT"}, "the launcher started 2 processes but MASTER_PORT is not set"),
        (2, 2, {k: v for k, v in DEEPSPEED.items() if k != "MASTER_ADDR"}, "started 4 processes but MASTER_ADDR is not set"),
        (2, 1, dict(BY_HAND, WORLD_SIZE="two"), "WORLD_SIZE=two in the environment is not a number"),
    ],
)
def test_a_world_that_does_not_fit_fails_in_one_line(devices, num_nodes, env, message):
    with pytest.raises(LitftError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+").replace(".", r"\.")):
        preflight(devices, num_nodes, env)


def test_the_deepspeed_launchers_local_rank_argument_is_dropped():
    argv = ["--local_rank=1", "finetune_full", "--devices", "2"]
    assert without_local_rank_argument(argv, {"LOCAL_RANK": "1"}) == ["finetune_full", "--devices", "2"]
    assert without_local_rank_argument(argv, {}) == argv  # not launched: jsonargparse names the unknown flag
    with pytest.raises(LitftError, match="--local_rank=1 disagrees with LOCAL_RANK=0"):
        without_local_rank_argument(argv, {"LOCAL_RANK": "0"})
