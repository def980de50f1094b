"""Watching a run from beside it: stop signals, and peers that stopped answering.

Both run on threads of their own, because the main thread may be stuck in a
collective that never returns; from there Python cannot even run a signal handler.
"""

import os
import signal
import sys
import threading
import time
from typing import Callable, Dict, Optional

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

# What schedulers send before they kill (SLURM's preemption and time limit (--signal), Kubernetes, torchrun), and Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopSignals:
    """Notes the first SIGTERM, SIGUSR1 or Ctrl-C (SIGINT), so every rank finishes its step, checkpoints and stops.

    A second Ctrl-C stops the process at once, with one line and no new checkpoint.

    Only one rank needs to receive it: the loop shares the flag in the all-reduce it
    makes before every step, so every rank stops after the same step. Python runs a
    handler only when the main thread is back in Python, which a hung collective never
    is; so the C-level handler also writes the signal to a pipe (``set_wakeup_fd``) that
    a thread reads. Once the loop has seen the stop (``acknowledge``) it finishes as
    usual; if it has not seen it ``grace`` seconds after the signal (LITFT_STOP_GRACE,
    120 by default), the thread ends the process with one line saying where it hung.
    """

    def __init__(self, grace: Optional[float] = None, where: Callable[[], str] = lambda: "the run"):
        self.received: Optional[str] = None
        self._interrupts = 0
        self.grace = float(os.environ.get("LITFT_STOP_GRACE", 120)) if grace is None else grace
        self.where = where
        self.on_hang = lambda: os._exit(1)
        self._seen, self._closed = threading.Event(), threading.Event()
        self._previous, self._pipe, self._old_fd, self._thread = {}, None, None, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
            self._pipe = os.pipe()
            os.set_blocking(self._pipe[1], False)
            self._old_fd = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
            self._thread = threading.Thread(target=self._read, name="litft-stop-signals", daemon=True)
            self._thread.start()
        return self

    def _note(self, signum, frame=None) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT" and frame is not None:  # the Python-level handler, on the main thread (the reader thread passes none)
            self._interrupts += 1
            if self._interrupts > 1:
                print("litft: stopped at once by a second Ctrl-C, without a new checkpoint", file=sys.stderr, flush=True)
                os._exit(130)
            print("litft: Ctrl-C: finishing this step and saving a checkpoint to resume from (Ctrl-C again to stop at once)",
                  file=sys.stderr, flush=True)
        self.received = self.received or name

    def acknowledge(self) -> None:
        """The loop has seen the stop and ends after this step: no deadline any more."""
        self._seen.set()

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                data = os.read(self._pipe[0], 64)
            except OSError:
                return
            if self._closed.is_set() or not data:
                return
            stops = [s for s in data if s in {int(sig) for sig in STOP_SIGNALS}]
            if not stops:
                continue
            self._note(stops[0])
            if not self._seen.wait(self.grace) and not self._closed.is_set():
                print(
                    f"litft: error: {self.received} arrived {self.grace:.0f} s ago and {self.where()} has not reached the end of its "
                    "step: a collective hangs, or the phase takes longer than LITFT_STOP_GRACE; exiting without a new checkpoint",
                    file=sys.stderr, flush=True,
                )
                self.on_hang()
            return

    def __exit__(self, *exc):
        self._closed.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._pipe is not None:
            signal.set_wakeup_fd(self._old_fd)
            os.write(self._pipe[1], b"\0")  # wakes the reader, which sees the closed flag
            self._thread.join(timeout=5)
            for fd in self._pipe:
                os.close(fd)
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

    def describe(self) -> str:
        return f"step {self.step} ({self.doing})"

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
