"""Where a run sits in a cluster: the launcher's variables, a preflight that fails in seconds, and stop signals.

litft starts its own processes (``--devices N --num_nodes M`` with MASTER_ADDR,
MASTER_PORT and NODE_RANK on each node), or joins the processes that torchrun or
SLURM's srun started. Either way the flags must describe the world the launcher
made; a mismatch found here costs seconds, found by a collective it costs a
timeout.
"""

import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import _get_default_store

from litft.errors import LitftError

# What schedulers send before they kill: SLURM's preemption and time limit (--signal), Kubernetes, torchrun.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def launcher(env: Optional[Dict[str, str]] = None) -> str:
    """``torchrun``, ``slurm`` or ``litft`` (processes litft starts itself), detected as Lightning detects them."""
    env = os.environ if env is None else env
    if all(k in env for k in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        return "torchrun"
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


def preflight(devices: int, num_nodes: int, env: Optional[Dict[str, str]] = None, rendezvous_timeout: float = 300.0) -> None:
    """Before any process group: the launcher's world is the one the flags describe, and every node has arrived."""
    env = os.environ if env is None else env
    world = devices * num_nodes
    kind = launcher(env)
    if kind == "torchrun":
        local, total = int(env["LOCAL_WORLD_SIZE"]), int(env.get("WORLD_SIZE", env["LOCAL_WORLD_SIZE"]))
        if local != devices:
            raise LitftError(f"torchrun started {local} processes on this node but --devices is {devices}; pass --devices {local} (or torchrun --nproc_per_node {devices})")
        if total != world:
            raise LitftError(
                f"torchrun's world has {total} processes but --devices {devices} x --num_nodes {num_nodes} is {world}; pass --num_nodes {total // local}"
            )
        return
    if kind == "slurm":
        nodes = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")))
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        per_node = int(per_node) if per_node.isdigit() else int(env["SLURM_NTASKS"]) // max(nodes, 1)
        if per_node != devices:
            raise LitftError(f"SLURM runs {per_node} tasks per node but --devices is {devices}; set #SBATCH --ntasks-per-node={devices} (one task per GPU) or pass --devices {per_node}")
        if nodes != num_nodes:
            raise LitftError(f"SLURM gave {nodes} nodes but --num_nodes is {num_nodes}; set #SBATCH --nodes={num_nodes} or pass --num_nodes {nodes}")
        return
    if num_nodes > 1 and "LOCAL_RANK" not in env:  # this node's main process; its children inherit the checked env
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if k not in env]
        if missing:
            raise LitftError(f"--num_nodes {num_nodes} needs {', '.join(missing)} set on every node (node 0's address and a free port, and this node's rank), or launch with torchrun or srun")
        rank = int(env["NODE_RANK"])
        if not 0 <= rank < num_nodes:
            raise LitftError(f"NODE_RANK={rank} is outside 0..{num_nodes - 1} for --num_nodes {num_nodes}")
        timeout = float(env.get("LITFT_RENDEZVOUS_TIMEOUT", rendezvous_timeout))
        check_in(rank, num_nodes, devices, env["MASTER_ADDR"], int(env["MASTER_PORT"]) + 1, timeout)


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


def join_torchrun_group(accelerator: str) -> None:
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
    backend = "gloo"
    if accelerator == "cuda":
        torch.cuda.set_device(int(env["LOCAL_RANK"]))
        backend = "nccl"
    timeout = timedelta(minutes=30)  # torch's and Lightning's default for a collective
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


def restarted() -> Optional[str]:
    """The launcher that restarted this run after a failure or preemption, if one did."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return f"torchrun restart {os.environ['TORCHELASTIC_RESTART_COUNT']}"
    if int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
        return f"SLURM requeue {os.environ['SLURM_RESTART_COUNT']}"
    return None


class StopSignals:
    """Notes the first SIGTERM or SIGUSR1 while training, so the loop can finish its step, checkpoint and stop.

    Only one rank needs to receive it: the loop shares the flag in the all-reduce it
    makes every step anyway, so every rank stops after the same step.
    """

    def __init__(self):
        self.received: Optional[str] = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self.received = self.received or signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


class PeerWatch:
    """Names the ranks a stuck step waits for, instead of waiting out the process group's 30-minute timeout.

    A thread on every rank publishes a record (a counter that grows while the process
    lives, and the step it is in) to the process group's store every few seconds. Once
    this rank has spent ``timeout`` seconds in one phase of a step (training it,
    validating, saving a checkpoint), it reads every record twice, still publishing its
    own meanwhile: a rank whose counter stood still is dead, frozen or cut off, and this
    rank exits with one line naming it, so torchrun or SLURM can restart the run from
    its newest checkpoint. A slow phase with every rank alive, or ranks alive but still
    in an earlier step, only gets a warning; the collective's own timeout then decides.
    """

    def __init__(self, rank: int, world_size: int, devices: int, timeout: float, store=None, interval: Optional[float] = None):
        self.rank, self.world_size, self.devices, self.timeout = rank, world_size, devices, timeout
        self.interval = interval or max(0.2, min(5.0, timeout / 4))  # seconds between signs of life
        self.store = store
        self.step, self.doing, self.since, self.beats = 0, "starting", time.monotonic(), 0
        self._done = threading.Event()
        self._thread = None
        self._next_verdict = 0.0
        self.on_fatal = lambda: os._exit(1)  # the main thread is stuck in a collective: only an exit ends it

    @classmethod
    def idle(cls) -> "PeerWatch":
        """A watch that hears phases and judges nobody (one process, or before training)."""
        return cls(0, 1, 1, 0.0)

    @classmethod
    def for_run(cls, fabric, devices: int) -> "PeerWatch":
        timeout = float(os.environ.get("LITFT_COLLECTIVE_TIMEOUT", 300))
        store = None
        if fabric.world_size > 1 and timeout > 0:
            store = dist.PrefixStore("litft/watch/", _get_default_store())
        return cls(fabric.global_rank, fabric.world_size, devices, timeout, store)

    def at(self, step: int, doing: str = "training") -> None:
        """This rank started a phase of ``step``; each phase gets ``timeout`` seconds before peers are judged."""
        self.step, self.doing, self.since, self._next_verdict = step, doing, time.monotonic(), 0.0

    def __enter__(self):
        if self.store is not None:
            self._publish()
            self._thread = threading.Thread(target=self._watch, name="litft-peer-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._done.set()
            self._thread.join()
            if exc[0] is not None:
                return False  # a rank that failed is missing: its counter stops and peers name it
            try:
                self.store.set(str(self.rank), "done")  # finished ranks are not missing ones
            except Exception:  # noqa: BLE001 - the store's host may have finished first
                pass
        return False

    def _publish(self) -> None:
        self.beats += 1
        self.store.set(str(self.rank), f"{self.beats} {self.step}")

    def _records(self) -> Dict[int, Optional[tuple]]:
        """Each rank's (counter, step); None for a rank that finished; (0, -1) for one that never started training."""
        present = [r for r in range(self.world_size) if self.store.check([str(r)])]  # a plain get would wait for the rest
        values = dict(zip(present, self.store.multi_get([str(r) for r in present]))) if present else {}
        return {
            r: (0, -1) if r not in values else None if values[r] == b"done" else tuple(int(x) for x in values[r].split())
            for r in range(self.world_size)
        }

    def _watch(self) -> None:
        while not self._done.wait(self.interval):
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - judged below, once the step is overdue
                pass
            now = time.monotonic()
            if now - self.since > self.timeout and now >= self._next_verdict:
                self._next_verdict = now + self.timeout  # a straggler is named again if it stays behind
                verdict, fatal = self.verdict()
                print(f"litft: {'error' if fatal else 'warning'}: {verdict}", file=sys.stderr, flush=True)
                if fatal:
                    self.on_fatal()

    def verdict(self) -> tuple:
        """One line on who this overdue step waits for, and whether waiting longer can help."""
        step, waited = self.step, time.monotonic() - self.since
        phase = f"step {step} ({self.doing})"
        where = lambda r: f"rank {r} (node {r // self.devices})"  # noqa: E731
        window = 4 * self.interval
        try:
            first = self._records()
            end = time.monotonic() + window
            while time.monotonic() < end:  # peers judging at the same time must see this rank alive
                time.sleep(self.interval / 2)
                self._publish()
            second = self._records()
        except Exception:  # noqa: BLE001 - node 0 hosts the store; no answer means it is gone
            return (f"{phase} has waited {waited:.0f} s and the process group's store on node 0 (MASTER_ADDR) does not answer: "
                    "node 0 is gone; check its log (the launcher restarts the run from its newest checkpoint)"), True
        others = [r for r in range(self.world_size) if r != self.rank]
        gone = [r for r in others if first[r] is not None and second[r] is not None and second[r][0] == first[r][0]]
        if gone:
            return (f"{phase} has waited {waited:.0f} s for {', '.join(map(where, gone))}: no sign of life for "
                    f"{window:.0f} s (process dead or frozen, or node unreachable); check those nodes' logs "
                    "(the launcher restarts the run from its newest checkpoint)"), True
        behind = [r for r in others if second[r] is not None and second[r][1] < step]
        if behind:
            return f"{phase} has waited {waited:.0f} s for {', '.join(map(where, behind))}, alive but still in an earlier step", False
        return f"{phase} has taken {waited:.0f} s on this rank; every rank is alive and in it (slow work, or a collective that hangs)", False
