"""What runs inside a Ray actor of ``--launcher ray``: only the standard library, so an actor starts in a moment.

The actor does not train; it starts ``python -m litft`` for its rank and passes
signals on to it. Importing torch, Lightning and transformers in the actor as
well would cost every worker seconds (minutes on a busy machine) before its
training process even starts, so nothing here imports them.
"""

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from litft.launch.launchers import free_port

CONFIG = "{run_config}"  # replaced by the path of the run's flags on the worker's machine


def inside_worker() -> bool:
    """True in the litft process a Ray worker started (it joins the world; it does not start Ray again)."""
    return os.environ.get("LITFT_LAUNCHER") == "ray"


def die_with_parent() -> None:
    """The kernel kills this process when the actor that started it dies (Linux); elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if str(os.getppid()) != os.environ.get("LITFT_RAY_ACTOR_PID", str(os.getppid())):
        os._exit(1)  # the actor died before the line above took effect


class RayWorker:
    """A Ray actor that starts one rank's litft process, forwards signals to it and reports how it ended."""

    def __init__(self, rank: int):
        self.child: Optional[subprocess.Popen] = None
        self.rank = rank

    def __repr__(self) -> str:  # Ray prefixes the worker's output with this
        return f"litft rank {self.rank}"

    def place(self) -> Dict:
        """Where this worker runs: its machine's address, the GPUs Ray gave it, and a free port there."""
        import ray  # the actor runs where Ray is installed

        return {"ip": ray.util.get_node_ip_address(), "gpus": [str(g) for g in ray.get_gpu_ids()], "port": free_port(host="")}

    def run(self, argv: List[str], env: Dict[str, str], cwd: str, config_text: str) -> Tuple[int, Optional[str]]:
        """Run litft to its end; its exit status and the last ``litft: error:`` line it printed."""
        with tempfile.TemporaryDirectory(prefix="litft-ray-") as folder:
            config = Path(folder) / "run_config.yaml"
            config.write_text(config_text)
            args = [str(config) if a == CONFIG else a for a in argv]
            child_env = {**os.environ, **env, "LITFT_RAY_ACTOR_PID": str(os.getpid())}
            self.child = subprocess.Popen(
                [sys.executable, "-m", "litft", *args], env=child_env, cwd=cwd if os.path.isdir(cwd) else None,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            )
            error = None
            for line in self.child.stdout:  # passed on as it comes, in order; the last error line is kept for the driver
                sys.stdout.write(line)
                sys.stdout.flush()
                if line.startswith("litft: error: "):
                    error = line[len("litft: error: "):].strip()
            return self.child.wait(), error

    def send_signal(self, signum: int) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def kill_child(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
