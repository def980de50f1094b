"""Where a run sits in a cluster: the launcher's variables, preflights that fail in seconds, and the process group.

litft starts its own processes (``--devices N --num_nodes M`` with MASTER_ADDR,
MASTER_PORT and NODE_RANK on each node), or joins the processes that torchrun,
SLURM's srun, or a launcher that sets RANK, LOCAL_RANK and WORLD_SIZE started
(``litft.launch.launchers``: the deepspeed launcher, mpirun, Ray, a hand-made environment). Either way the flags must describe the world the launcher
made; a mismatch found here costs seconds, found by a collective it costs a
timeout.
"""

import os
import secrets
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from litft.errors import LitftError
from litft.launch.launchers import environment_world, started_by_environment
from litft.ranks import on_every_rank, on_rank_zero


def process_group_timeout() -> timedelta:
    """How long a collective may wait before the process group gives up (LITFT_PROCESS_GROUP_TIMEOUT, seconds; 30 minutes by default).

    litft's own long waits (rank 0 tokenizing, exporting) wait on the store, not in a
    collective, so this bounds only real communication; the peer watch names dead ranks sooner.
    """
    seconds = os.environ.get("LITFT_PROCESS_GROUP_TIMEOUT", "1800")
    try:
        value = float(seconds)
    except ValueError:
        raise LitftError(f"LITFT_PROCESS_GROUP_TIMEOUT={seconds} is not a number of seconds") from None
    if value <= 0:
        raise LitftError(f"LITFT_PROCESS_GROUP_TIMEOUT must be positive, got {seconds}")
    return timedelta(seconds=value)


def launcher(env: Optional[Dict[str, str]] = None) -> str:
    """``torchrun``, ``environment``, ``slurm`` or ``litft`` (processes litft starts itself).

    The launcher nearest the process wins: torchrun, or one that set RANK, LOCAL_RANK and
    WORLD_SIZE (deepspeed's, mpirun's, Ray's), also inside a SLURM allocation, whose own
    variables then describe the allocation rather than these processes. Processes
    litft started itself are marked (LITFT_LAUNCHER=litft), whatever else they inherited.
    """
    env = os.environ if env is None else env
    if all(k in env for k in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        return "torchrun"
    if env.get("LITFT_LAUNCHER") == "litft" and "LOCAL_RANK" in env:
        return "litft"
    if started_by_environment(env):
        return "environment"
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return "slurm"
    return "litft"


def apply_launcher_env(devices: int, num_nodes: int, env: Optional[Dict[str, str]] = None):
    """NNODES and NPROC_PER_NODE (as other tools read them) stand in for --num_nodes and --devices left at 1."""
    env = os.environ if env is None else env
    for flag, name, value in (("--devices", "NPROC_PER_NODE", devices), ("--num_nodes", "NNODES", num_nodes)):
        if name not in env:
            continue
        try:
            given = int(env[name])
        except ValueError:
            raise LitftError(f"{name}={env[name]} is not a number; unset it or give a count") from None
        if value != 1 and value != given:
            raise LitftError(f"{flag} {value} disagrees with {name}={given} in the environment; pass one of them")
        if flag == "--devices":
            devices = given
        else:
            num_nodes = given
    return devices, num_nodes


def preflight(devices: int, num_nodes: int, env: Optional[Dict[str, str]] = None, rendezvous_timeout: float = 300.0) -> Dict[str, str]:
    """Before any process group: the launcher's world is the one the flags describe, and every node has arrived.

    Returns the variables to add to the environment so that Lightning places this
    process where the launcher did (an environment launcher's NODE_RANK; nothing for the others).
    """
    env = os.environ if env is None else env
    world = devices * num_nodes
    kind = launcher(env)
    if kind == "environment":
        return environment_world(devices, num_nodes, env)
    if kind == "torchrun":
        local, total = int(env["LOCAL_WORLD_SIZE"]), int(env.get("WORLD_SIZE", env["LOCAL_WORLD_SIZE"]))
        if local != devices:
            raise LitftError(f"torchrun started {local} processes on this node but --devices is {devices}; pass --devices {local} (or torchrun --nproc_per_node {devices})")
        if total != world:
            raise LitftError(
                f"torchrun's world has {total} processes but --devices {devices} x --num_nodes {num_nodes} is {world}; pass --num_nodes {total // local}"
            )
        return {}
    if kind == "slurm":
        nodes = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")))
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        per_node = int(per_node) if per_node.isdigit() else int(env["SLURM_NTASKS"]) // max(nodes, 1)
        if per_node != devices:
            raise LitftError(f"SLURM runs {per_node} tasks per node but --devices is {devices}; set #SBATCH --ntasks-per-node={devices} (one task per GPU) or pass --devices {per_node}")
        if nodes != num_nodes:
            raise LitftError(f"SLURM gave {nodes} nodes but --num_nodes is {num_nodes}; set #SBATCH --nodes={num_nodes} or pass --num_nodes {nodes}")
        return {}
    if num_nodes > 1 and "LOCAL_RANK" not in env:  # this node's main process; its children inherit the checked env
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if k not in env]
        if missing:
            raise LitftError(f"--num_nodes {num_nodes} needs {', '.join(missing)} set on every node (node 0's address and a free port, and this node's rank), or launch with torchrun or srun")
        rank = int(env["NODE_RANK"])
        if not 0 <= rank < num_nodes:
            raise LitftError(f"NODE_RANK={rank} is outside 0..{num_nodes - 1} for --num_nodes {num_nodes}")
        timeout = float(env.get("LITFT_RENDEZVOUS_TIMEOUT", rendezvous_timeout))
        check_in(rank, num_nodes, devices, env["MASTER_ADDR"], int(env["MASTER_PORT"]) + 1, timeout)
    return {"LITFT_LAUNCHER": "litft"} if world > 1 and "LOCAL_RANK" not in env else {}  # the processes Fabric starts inherit it


def check_in(node_rank: int, num_nodes: int, devices: int, host: str, port: int, timeout: float) -> None:
    """Every node's main process meets node 0 before training starts; a node that never comes is named.

    Node 0 serves a small key-value store on MASTER_PORT + 1 (a port of its own: the
    process group's store on MASTER_PORT must not meet a client of this one). Each
    node writes its arrival there; node 0 waits up to
    ``timeout`` and writes the verdict every node reads: all here, or who is missing
    with their ranks, so every node stops with the same line instead of waiting at
    the first collective until the process group's timeout (30 minutes).
    """
    wait = timedelta(seconds=timeout)
    if node_rank == 0:
        store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=wait, use_libuv=False)
        deadline = time.monotonic() + timeout
        expected = [f"litft/node/{r}" for r in range(1, num_nodes)]
        while not store.check(expected) and time.monotonic() < deadline:
            time.sleep(0.2)
        missing = [r for r in range(1, num_nodes) if not store.check([f"litft/node/{r}"])]
        verdict = ",".join(map(str, missing)) or "none"
        store.set("litft/missing", verdict)
        arrived = [f"litft/read/{r}" for r in range(1, num_nodes) if r not in missing]
        end = time.monotonic() + 30  # the verdict is read before the store goes away
        while arrived and not store.check(arrived) and time.monotonic() < end:
            time.sleep(0.1)
        del store
    else:
        try:
            store = TCPStore(host, port, is_master=False, timeout=wait, use_libuv=False)
            store.set(f"litft/node/{node_rank}", "here")
            store.wait(["litft/missing"], wait + timedelta(seconds=30))
            verdict = store.get("litft/missing").decode()
            store.set(f"litft/read/{node_rank}", "1")
        except Exception as err:  # noqa: BLE001 - a refused or timed-out connection, in torch's words
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise LitftError(
                f"node 0 at MASTER_ADDR={host} did not answer on MASTER_PORT + 1 = {port} within {timeout:.0f} s ({first[:200]}); "
                "start node 0, or check the address and that MASTER_PORT and the port after it are open between nodes"
            ) from None
        missing = [] if verdict == "none" else [int(r) for r in verdict.split(",")]
    if missing:
        named = "; ".join(f"node {r} (ranks {r * devices}-{(r + 1) * devices - 1})" for r in missing)
        raise LitftError(
            f"{named} did not join within {timeout:.0f} s of node 0 ({num_nodes - len(missing)} of {num_nodes} nodes arrived); "
            f"start the missing nodes with NODE_RANK set, or set LITFT_RENDEZVOUS_TIMEOUT (seconds) to wait longer"
        )


def join_torchrun_group(backend: str, accelerator: str) -> None:
    """Under torchrun, start the process group on keys of this restart attempt alone.

    torchrun's agent keeps one TCPStore for every restart (the store is shared
    unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) and torch's ``env://`` start uses
    it without a prefix, so a restarted group reads the dead group's addresses and
    barrier counts: gloo then refuses connections or waits forever. Fabric leaves
    an existing group alone, so starting it here on a per-attempt prefix is enough.
    """
    env = os.environ
    if launcher(env) != "torchrun" or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(env["WORLD_SIZE"]) < 2:
        return
    if dist.is_initialized():
        return
    if accelerator == "cuda":
        torch.cuda.set_device(int(env["LOCAL_RANK"]))
    timeout = process_group_timeout()
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend, store=dist.PrefixStore(f"litft/attempt-{attempt}", store), rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]), timeout=timeout,
    )


def leave_process_group(fabric, failed: bool) -> None:
    """Close the loggers and destroy the process group while the interpreter is still whole.

    A gloo group left to interpreter exit is torn down during finalization: its
    worker threads can still hold finished work with tensors whose release needs
    the interpreter, and the process then aborts ("terminate called without an
    active exception", exit -6) after a run that had finished. Destroying the group
    here ends those threads first. A failed run skips the barrier: peers may be gone.
    """
    for logger in fabric.loggers:
        logger.finalize("failed" if failed else "success")
    if not (dist.is_available() and dist.is_initialized()):
        return
    if not failed:
        dist.barrier()  # nobody tears down while a peer still talks to it
    dist.destroy_process_group()
    forget_deepspeed_groups()


def forget_deepspeed_groups() -> None:
    """Drop DeepSpeed's cached process groups with the world they belonged to, so a later run in this process starts clean.

    DeepSpeed keeps a clone of the world group in a module global; a second job in
    the same process (a sweep, a notebook, litft env --check) would otherwise hand
    the destroyed group to its engine and fail with "Group ... is not registered".
    """
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release()
        return
    for name in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP"):  # older DeepSpeed
        if hasattr(groups, name):
            setattr(groups, name, None)


def check_shared_out_dir(fabric, out_dir: Path) -> None:
    """Every rank must see the files rank 0 writes into out_dir, or checkpoints are split across nodes' disks.

    Rank 0 writes a token file with a fresh name; every rank looks for it. A node
    that cannot see it is named in one line, in seconds instead of at the first resume.
    """
    if fabric.world_size == 1:
        return
    token = fabric.broadcast(f".litft-shared-{secrets.token_hex(8)}" if fabric.global_rank == 0 else None, src=0)
    marker = Path(out_dir) / token
    on_rank_zero(fabric, lambda: marker.write_text("litft checks that every node sees this folder"), "checking out_dir")

    def look():
        if not marker.is_file():
            raise LitftError(
                f"--out_dir {out_dir} is not the folder rank 0 writes to: rank {fabric.global_rank} (node {fabric.node_rank}) cannot see its files; "
                "put out_dir on a filesystem every node mounts (NFS, Lustre, a cloud bucket mount) and pass the same path on every node"
            )

    try:
        on_every_rank(fabric, look, "checking that out_dir is shared")  # every rank has looked once this returns or raises
    finally:
        if fabric.global_rank == 0:
            # Rank 0 alone, waiting for nobody: a rank that failed the check must keep its own error, not
            # meet a store that rank 0 took down on its way out.
            marker.unlink(missing_ok=True)


def restarted() -> Optional[str]:
    """The launcher that restarted this run after a failure or preemption, if one did."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return f"torchrun restart {os.environ['TORCHELASTIC_RESTART_COUNT']}"
    if int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
        return f"SLURM requeue {os.environ['SLURM_RESTART_COUNT']}"
    return None
