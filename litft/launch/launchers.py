"""Launchers that start every process themselves and tell each one its place through the environment.

The ``deepspeed`` launcher, ``accelerate launch`` on the CPU, mpirun and a hand-made
environment all start the processes and set (or let the user set) RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT. litft then joins the world they made
instead of starting processes of its own. Lightning reads only LOCAL_RANK and
NODE_RANK and computes the global rank as ``NODE_RANK x devices + LOCAL_RANK``, so
the launcher's numbering is checked to be that one, and NODE_RANK is filled in
where the launcher leaves it out: a world that does not match fails here in one
line instead of training twice the same ranks.
"""

import os
import random
import re
import socket
from typing import Dict, List

from litft.errors import LitftError

# OpenMPI's names (mpirun, and srun --mpi=pmix) for the standard variables.
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK": "LOCAL_RANK",
    "OMPI_COMM_WORLD_SIZE": "WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "LOCAL_WORLD_SIZE",
}
STANDARD = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
# Where launchers put the node's index and the number of processes on it (torchrun, Lightning, deepspeed).
NODE_RANK_NAMES = ("NODE_RANK", "GROUP_RANK", "CROSS_RANK")
LOCAL_SIZE_NAMES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")
LOCAL_RANK_ARGUMENT = re.compile(r"^--local[-_]rank=(\d+)$")


def started_by_environment(env) -> bool:
    """True when a launcher other than torchrun gave this process its ranks (the variables, or OpenMPI's)."""
    return all(k in env for k in STANDARD) or all(k in env for k in OPENMPI)


def who_launched(env) -> str:
    """The launcher's name as the error messages give it."""
    if "OMPI_COMM_WORLD_SIZE" in env:
        return "mpirun"
    if env.get("LITFT_LAUNCHER") == "ray":
        return "Ray"
    if "CROSS_RANK" in env and "LOCAL_SIZE" in env:
        return "the deepspeed launcher"
    return "the launcher"


def _number(env, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise LitftError(f"{name}={env[name]} in the environment is not a number; fix the launcher's environment") from None


def environment_world(devices: int, num_nodes: int, env=None) -> Dict[str, str]:
    """Check the world an environment launcher made against the flags; the variables Lightning still needs.

    OpenMPI's variables are read under the standard names, the node's rank is the one
    the launcher gave or ``RANK // devices``, and MASTER_ADDR defaults to this machine
    when every rank runs on it. What is returned is added to the environment.
    """
    env = os.environ if env is None else env
    named = {std: env[ompi] for ompi, std in OPENMPI.items() if ompi in env and std not in env}
    view = {**env, **named}
    who = who_launched(env)
    world, rank, local = (_number(view, k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
    local_size_name = next((k for k in LOCAL_SIZE_NAMES if k in view), None)
    wanted = devices * num_nodes
    if local_size_name is not None:
        local_size = _number(view, local_size_name)
        if local_size != devices:
            raise LitftError(
                f"{who} started {local_size} processes on this node ({local_size_name}) but --devices is {devices}; pass --devices {local_size}"
            )
    if world != wanted:
        if local_size_name is not None and world % devices == 0:  # --devices matches the node, so the node count is wrong
            hint = f"pass --num_nodes {world // devices}"
        else:
            hint = f"pass --devices {world} on one node, or --devices and --num_nodes whose product is {world}"
        raise LitftError(f"{who}'s world has {world} processes (WORLD_SIZE) but --devices {devices} x --num_nodes {num_nodes} is {wanted}; {hint}")
    if not 0 <= local < devices:
        raise LitftError(f"LOCAL_RANK={local} is outside 0..{devices - 1} for --devices {devices}; {who} and --devices disagree")
    if not 0 <= rank < world:
        raise LitftError(f"RANK={rank} is outside 0..{world - 1} for a world of {world} processes; fix the launcher's RANK")
    node_name = next((k for k in NODE_RANK_NAMES if k in view), None)
    node = _number(view, node_name) if node_name else rank // devices
    if rank != node * devices + local:
        given = f"{node_name}={node}" if node_name else f"node {node}"
        raise LitftError(
            f"RANK={rank} is not {given} x --devices {devices} + LOCAL_RANK={local}: litft numbers ranks node by node, "
            "so give each node's processes consecutive ranks (or set NODE_RANK)"
        )
    added = {k: v for k, v in named.items() if k in STANDARD}  # OpenMPI's local size is read, not passed on
    added["NODE_RANK"] = str(node)
    if world > 1:
        if "MASTER_ADDR" not in env and num_nodes == 1:
            added["MASTER_ADDR"] = "127.0.0.1"
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env and k not in added]
        if missing:
            how = " (mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<free port>)" if who == "mpirun" else ""
            raise LitftError(f"{who} started {world} processes but {', '.join(missing)} is not set; set it to rank 0's host and a free port{how}")
    return added


def without_local_rank_argument(argv: List[str], env=None) -> List[str]:
    """The command line without the ``--local_rank=N`` that the deepspeed launcher appends (LOCAL_RANK says the same)."""
    env = os.environ if env is None else env
    if "LOCAL_RANK" not in env:
        return argv
    kept = []
    for arg in argv:
        match = LOCAL_RANK_ARGUMENT.match(arg)
        if match and match.group(1) != env["LOCAL_RANK"]:
            raise LitftError(f"{arg} disagrees with LOCAL_RANK={env['LOCAL_RANK']} in the environment")
        if not match:
            kept.append(arg)
    return kept


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on ``host``, below the ephemeral range (32768 and up) that the system hands out for outgoing
    connections, gloo's among them: a port taken from that range can be reused by one before the store listens on it."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 30000)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
