"""``--launcher ray``: one worker per device on a Ray cluster, each running litft as torchrun would.

The driver (the command the user typed) connects to the cluster at RAY_ADDRESS, or
starts a local Ray for the run, and reserves one bundle of ``--devices`` CPUs or
GPUs per node (a placement group: every bundle on one machine, each node on its
own). In each bundle it starts ``--devices`` small actors; each actor starts
``python -m litft`` with the run's flags (its ``run_config.yaml``) and the
variables of an environment launcher (RANK, LOCAL_RANK, WORLD_SIZE, NODE_RANK,
MASTER_ADDR, MASTER_PORT), so the workers form one process group and run exactly
as under torchrun: same preflight, peer watch, checkpoints and stop signals.

The training runs in a child process of the actor, not in the actor itself: a
process of its own keeps signal handling on its main thread and its process group
apart from Ray's threads, and the actor stays free to forward a signal to it.
SIGTERM or SIGUSR1 to the driver is forwarded to every worker, which finish the
same step, checkpoint and exit 0, as a SIGTERM under torchrun does. A child dies
with its actor (PR_SET_PDEATHSIG), so a driver or actor that is killed leaves no
training behind.
"""

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import yaml

from litft.launch.cluster import apply_launcher_env, launcher
from litft.errors import LitftError
from litft.launch.ray_worker import CONFIG, RayWorker
from litft.launch.watch import STOP_SIGNALS

# The driver's variables that also steer the workers (litft's own, the hub's, tokenizers').
FORWARDED = ("LITFT_", "HF_", "TRANSFORMERS_", "TOKENIZERS_")
LOG_DRAIN = 1.0  # seconds; Ray's log monitor reads the workers' output every 0.1 s
FAILURE_GRACE = 30.0  # seconds the other workers get to stop by themselves after one failed


def _import_ray():
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        raise LitftError("--launcher ray needs Ray: pip install 'litft[ray]' (or pip install ray)") from None
    return ray, placement_group, remove_placement_group, PlacementGroupSchedulingStrategy


def run_on_ray(spec) -> Optional[Path]:
    """The driver: reserve the devices, start one worker per device, forward stop signals, and report the outcome: the run's
    last export folder, or None where it wrote none."""
    ray, placement_group, remove_placement_group, InGroup = _import_ray()
    if launcher() != "litft" or "LOCAL_RANK" in os.environ:
        raise LitftError("--launcher ray starts its own workers; run it as one process, not under torchrun, srun, mpirun or another launcher")
    layout = spec.layout
    devices, num_nodes = apply_launcher_env(layout.devices, layout.num_nodes)
    layout.devices, layout.num_nodes = devices, num_nodes
    spec.check()  # bad flags fail here, before a cluster is touched
    world = devices * num_nodes
    address = os.environ.get("RAY_ADDRESS")
    local = {} if address else {"num_cpus": max(os.cpu_count() or 1, world), "include_dashboard": False}
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every rank's lines, in the order they were printed
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # the workers' lines without color codes in a log file
    ray.init(address=address or "local", logging_level=logging.WARNING, **local)
    workers, group = [], None
    try:
        use_gpu = _choose_device(ray, spec.accelerator, world)
        kind = "GPU" if use_gpu else "CPU"
        bundle = {"CPU": devices, "GPU": devices} if use_gpu else {"CPU": devices}
        group = placement_group([dict(bundle) for _ in range(num_nodes)], strategy="STRICT_PACK" if num_nodes == 1 else "STRICT_SPREAD")
        timeout = float(os.environ.get("LITFT_RENDEZVOUS_TIMEOUT", 300))
        if not ray.wait([group.ready()], timeout=timeout)[0]:
            raise LitftError(
                f"Ray could not reserve {num_nodes} node(s) with {devices} free {kind}s each within {timeout:.0f} s "
                f"(the cluster has {ray.cluster_resources()}); lower --devices or --num_nodes, or add nodes"
            )
        Worker = ray.remote(RayWorker)
        for rank in range(world):  # node by node: bundle i holds the ranks of node i
            in_bundle = InGroup(placement_group=group, placement_group_bundle_index=rank // devices)
            options = dict(num_cpus=1, num_gpus=1 if use_gpu else 0, max_concurrency=2, scheduling_strategy=in_bundle)
            workers.append(Worker.options(**options).remote(rank))
        envs = worker_environments(ray.get([w.place.remote() for w in workers]), devices, use_gpu)
        print(
            f"Ray: {world} workers, {devices} {kind}s on each of {num_nodes} node(s), cluster at {ray.get_runtime_context().gcs_address}; "
            f"rank 0 at {envs[0]['MASTER_ADDR']}:{envs[0]['MASTER_PORT']}", flush=True,
        )
        argv = [spec.job, "--config", CONFIG, "--devices", str(devices), "--num_nodes", str(num_nodes)]
        argv += ["--resume", spec.resume] if spec.resume else []
        argv += ["--overwrite", "true"] if spec.overwrite else []
        config_text = yaml.safe_dump(spec.recorded, sort_keys=False)
        forwarded = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED)}
        refs = [w.run.remote(argv, {**forwarded, **env}, os.getcwd(), config_text) for w, env in zip(workers, envs)]
        outcomes = _wait_forwarding_signals(ray, workers, refs)
        time.sleep(LOG_DRAIN)  # Ray's log monitor forwards the workers' last lines before the cluster goes
    finally:
        for worker in workers:
            ray.kill(worker)
        if group is not None:
            remove_placement_group(group)
        ray.shutdown()
    failed = [(rank, status, error) for rank, (status, error) in enumerate(outcomes) if status != 0]
    if failed:
        errors = [error for _, _, error in failed if error]
        rank, status, _ = failed[0]
        raise LitftError(errors[0] if errors else f"the Ray worker of rank {rank} exited with status {status}; its output above says why")
    exports = [folder for _, folder in spec.final_exports() if folder.is_dir()]
    return exports[-1] if exports else None


def _choose_device(ray, accelerator: str, world: int) -> bool:
    """GPUs where asked for, or (auto) where the cluster has any; the cluster must hold the world."""
    total = ray.cluster_resources()
    use_gpu = accelerator == "cuda" or (accelerator == "auto" and total.get("GPU", 0) > 0)
    kind = "GPU" if use_gpu else "CPU"
    if total.get(kind, 0) < world:
        raise LitftError(f"the run needs {world} {kind}s (--devices x --num_nodes) but the Ray cluster has {total.get(kind, 0):g}; lower --devices or add nodes")
    return use_gpu


def worker_environments(places: List[Dict], devices: int, use_gpu: bool) -> List[Dict[str, str]]:
    """Each rank's variables, from where its worker runs (``places`` in rank order, node by node)."""
    head = places[0]
    envs = []
    for rank in range(len(places)):
        node = rank // devices
        env = {
            "RANK": str(rank), "LOCAL_RANK": str(rank % devices), "WORLD_SIZE": str(len(places)), "NODE_RANK": str(node),
            "MASTER_ADDR": head["ip"], "MASTER_PORT": str(head["port"]), "LITFT_LAUNCHER": "ray", "PYTHONUNBUFFERED": "1",
        }
        if use_gpu:  # every rank of a node sees the node's GPUs in rank order, so LOCAL_RANK picks its own
            env["CUDA_VISIBLE_DEVICES"] = ",".join(g for p in places[node * devices:(node + 1) * devices] for g in p["gpus"])
        envs.append(env)
    return envs


def _wait_forwarding_signals(ray, workers: list, refs: list) -> List[Tuple[int, Optional[str]]]:
    """Wait for every worker; a stop signal to the driver goes to each of them, and one failure ends the rest after a grace."""
    received: List[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in STOP_SIGNALS}
    try:
        remaining, failed_at = list(refs), None
        while remaining:
            done, remaining = ray.wait(remaining, num_returns=len(remaining), timeout=0.5)
            while received:
                signum = received.pop(0)
                print(f"litft: {signal.Signals(signum).name} passed on to the {len(workers)} Ray workers", file=sys.stderr, flush=True)
                ray.get([w.send_signal.remote(signum) for w in workers])
            if failed_at is None and any(ray.get(ref)[0] != 0 for ref in done):
                failed_at = time.monotonic()
            if failed_at is not None and remaining and time.monotonic() - failed_at > FAILURE_GRACE:
                ray.get([w.kill_child.remote() for w in workers])  # a rank failed and its peers still wait for it
        return ray.get(refs)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
