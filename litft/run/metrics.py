"""What the loop measures and when it acts: throughput, memory, MFU, the progress line, cadences and stop requests.

Each piece is a small object of its own, so the loop stays a dozen lines and each
policy is tested without processes.
"""

import json
import resource
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch
from tqdm import tqdm

from litft.config import EvalArgs, TrainArgs
from litft.device import release_freed_host_memory
from litft.model.experts import load_figures


def peak_memory_gb(device: torch.device) -> List[float]:
    """Peak memory of this process in GB: allocated and reserved by PyTorch's allocator on a GPU, resident memory on the CPU."""
    if device.type == "cuda":
        return [torch.cuda.max_memory_allocated(device) / 1e9, torch.cuda.max_memory_reserved(device) / 1e9]
    return [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9]  # ru_maxrss is in KiB on Linux


def every_rank(fabric, local: List[float]) -> List[List[float]]:
    """Every rank's ``local`` values, a row per rank: each rank fills its own row and a sum gathers them (Lightning's
    all_gather goes through a deprecated torch call)."""
    rows = torch.zeros((fabric.world_size, len(local)), dtype=torch.float64, device=fabric.device)
    rows[fabric.global_rank] = torch.tensor(local, dtype=torch.float64)
    return (fabric.all_reduce(rows, reduce_op="sum") if fabric.world_size > 1 else rows).tolist()


def peak_memory_by_rank(fabric, phases: Optional["PhasePeaks"] = None) -> Dict[str, float]:
    """Every rank's peak memory (GB) since the last reset, and the fullest rank: the rank that runs out is rarely rank 0.

    On a GPU, ``peak_reserved_gb`` beside it is what the allocator held: fragmentation
    and caching included, it is what runs out first.
    """
    local = phases.device_peaks() if phases is not None and fabric.device.type == "cuda" else peak_memory_gb(fabric.device)
    rows = every_rank(fabric, local)
    peaks = [row[0] for row in rows]
    fullest = max(range(len(peaks)), key=peaks.__getitem__)
    metrics = {"peak_memory_gb": peaks[fullest], "peak_memory_rank": fullest}
    if len(local) > 1:
        metrics["peak_reserved_gb"] = max(row[1] for row in rows)
    if len(peaks) > 1:
        # Not peak_memory_gb/<rank>: an MLflow file store keeps each metric as a file, and peak_memory_gb is one already.
        metrics.update({f"rank_peak_gb/{r}": gb for r, gb in enumerate(peaks)})
    return metrics


PHASES = ("load", "first_step", "steps", "validation", "save", "export")


class PhasePeaks:
    """This process's peak memory in each phase of the run (loading, the first step, later steps, validation, saves, the
    export), so that the phase which takes a rank over its share is named rather than guessed.

    On a GPU a phase starts by resetting the allocator's peak and ends by reading it; the log rows' ``peak_memory_gb``
    keeps its meaning through ``mark`` (the peak since the first step, as it was when the meter reset the statistics
    itself). On the CPU a thread samples the process's anonymous resident memory every 20 ms (the kernel's high-water
    mark is left alone: launchers and benchmarks read it as the whole run's). A phase entered again keeps its largest
    peak; where nothing can be measured, nothing is reported.
    """

    def __init__(self, device: torch.device):
        self.device, self.current = device, "load"  # loading starts with the process: its peak is since the start
        self.peaks: Dict[str, float] = {}
        self._sampler = None if device.type == "cuda" else _HostSampler.start()
        self.measures = device.type == "cuda" or self._sampler is not None
        self._marked: Optional[str] = None
        self._since_mark = [0.0, 0.0]  # allocated and reserved peaks of the phases closed since the mark (CUDA)

    def enter(self, phase: str) -> None:
        """End the current phase (its peak kept) and start ``phase``, unless it is the current one already.

        On the CPU the heap's freed pages go back to the system first (``release_freed_host_memory``): glibc keeps what the
        last phase freed resident, and the next phase's tensors, of other sizes, only partly fit in it. ZeRO-3 LoRA's
        validation after a step held 31 MB more than the step itself on a 0.89 GB model (2 ranks); trimmed, it holds less.
        """
        if phase == self.current or not self.measures:
            return
        self.close()
        self.current = phase
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            release_freed_host_memory()
            self._sampler.reset()

    def _now(self) -> List[float]:
        if self.device.type == "cuda":
            return [torch.cuda.max_memory_allocated(self.device) / 1e9, torch.cuda.max_memory_reserved(self.device) / 1e9]
        return [self._sampler.peak]

    def close(self) -> None:
        if not self.measures:
            return
        now = self._now()
        self.peaks[self.current] = max(self.peaks.get(self.current, 0.0), now[0])
        if self.current != self._marked:
            self._since_mark = [max(a, b) for a, b in zip(self._since_mark, now)]

    def mark(self) -> None:
        """From here on ``device_peaks`` leaves out the current phase and everything before it (the meter: after the first step)."""
        self._marked, self._since_mark = self.current, [0.0, 0.0]

    def device_peaks(self) -> List[float]:
        """The GPU's allocated and reserved peaks since the mark (since the start before it)."""
        now = self._now() if self.current != self._marked else [0.0, 0.0]
        return [max(a, b) for a, b in zip(self._since_mark, now)]

    def by_rank(self, fabric) -> Dict[str, float]:
        """Each phase's peak on the fullest rank (``phase_peak_gb/<phase>``) and that rank (``phase_peak_rank/<phase>``; MLflow's
        file store makes a folder of a name's prefix, so no name may extend another, as peak_memory_gb/load would); every rank
        calls it."""
        self.close()
        rows = every_rank(fabric, [self.peaks.get(p, 0.0) for p in PHASES])
        metrics = {}
        for column, phase in enumerate(PHASES):
            fullest = max(range(len(rows)), key=lambda r: rows[r][column])
            if rows[fullest][column] > 0:
                metrics[f"phase_peak_gb/{phase}"], metrics[f"phase_peak_rank/{phase}"] = rows[fullest][column], fullest
        return metrics


class _HostSampler:
    """The largest anonymous resident memory (RssAnon) of this process since the last ``reset``, sampled by a daemon thread."""

    def __init__(self, first: float):
        self.peak = first
        threading.Thread(target=self._run, name="litft-memory-sampler", daemon=True).start()

    @classmethod
    def start(cls) -> Optional["_HostSampler"]:
        first = _rss_anon_gb()
        return None if first is None else cls(first)

    def reset(self) -> None:
        self.peak = _rss_anon_gb() or 0.0

    def _run(self) -> None:
        while True:
            time.sleep(0.02)
            now = _rss_anon_gb() or 0.0
            if now > self.peak:
                self.peak = now


def describe_phases(metrics: Dict[str, float], world_size: int) -> Optional[str]:
    """The phases' peaks in one line for the end of the run."""
    parts = []
    for phase in PHASES:
        if f"phase_peak_gb/{phase}" in metrics:
            rank = f" (rank {metrics[f'phase_peak_rank/{phase}']})" if world_size > 1 else ""
            parts.append(f"{phase.replace('_', ' ')} {metrics[f'phase_peak_gb/{phase}']:.2f}{rank}")
    return f"peak memory by phase, GB{' on the fullest rank' if world_size > 1 else ''}: " + ", ".join(parts) if parts else None


def _rss_anon_gb() -> Optional[float]:
    """This process's anonymous resident memory (RssAnon: its heap, not the files it maps), or None where /proc lacks it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        return None
    return None


@dataclass
class Cadence:
    """When the loop validates and saves, and when the run has trained enough."""

    total_steps: int
    eval: EvalArgs
    save_interval: Optional[int]
    max_tokens: Optional[int] = None

    def more(self, step: int, tokens: int) -> bool:
        return step < self.total_steps and (self.max_tokens is None or tokens < self.max_tokens)

    def validate_first(self, step: int) -> bool:
        return self.eval.initial_validation and step == 0

    def validate_now(self, step: int) -> bool:
        return bool(self.eval.interval) and step % self.eval.interval == 0 and step < self.total_steps

    def save_now(self, step: int) -> bool:
        """Periodic saves; the last step is saved by the end of the loop, whatever the interval."""
        return bool(self.save_interval) and step % self.save_interval == 0 and step < self.total_steps


# Why a rank stops when, as the step's counts were shared, only another rank had been asked to.
ANOTHER_RANK = "a signal to another rank"


class StopRequests:
    """Why this rank wants the run to end after the current step, if it does.

    A stop signal (noted by ``watch.StopSignals``) or ``--train.stop_after_steps``
    steps trained in this launch; the loop shares the answer with every rank.
    """

    def __init__(self, signals=None, stop_after_steps: Optional[int] = None, start_step: int = 0):
        self.signals, self.stop_after_steps, self.start_step = signals, stop_after_steps, start_step

    def agreed(self) -> None:
        """Every rank stops after this step: a signal's deadline for reaching a step boundary is met."""
        if self.signals is not None:
            self.signals.acknowledge()

    def said(self, stopped_by: str, step: int) -> str:
        """What the last line names: a signal sent to every rank (Ctrl-C to the process group) may reach this rank just
        after the counts were shared, and then it is this rank's own reason too."""
        return (self.reason(step) or stopped_by) if stopped_by == ANOTHER_RANK else stopped_by

    def reason(self, step: int) -> Optional[str]:
        if self.signals is not None and self.signals.received is not None:
            return self.signals.received
        if self.stop_after_steps is not None and step - self.start_step >= self.stop_after_steps:
            return f"--train.stop_after_steps {self.stop_after_steps}"
        return None


class SampleLog:
    """This rank's sample ids per step, in a JSONL file (``--train.record_sample_ids``), to audit data order."""

    def __init__(self, path: Optional[Path]):
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, epoch: int, indices: List[List[int]]) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "epoch": epoch, "ids": [i for idx in indices for i in idx]}) + "\n")


@dataclass
class Throughput:
    """Tokens, samples and model FLOPs since the last log step, and the rates they make."""

    started: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    samples: int = 0
    flops: float = 0.0
    steps: int = 0
    batches_s: float = 0.0  # making the batches (RL: sampling and scoring them)

    def add(self, tokens: int, samples: int, flops: float, batches_s: float = 0.0) -> None:
        self.steps += 1
        self.tokens += tokens
        self.samples += samples
        self.flops += flops
        self.batches_s += batches_s

    def rates(self, world_size: int, peak: Optional[float], excluded_s: float = 0.0) -> Dict[str, float]:
        """Rates over the window's wall time, less ``excluded_s`` (compilation) spent inside it."""
        elapsed = max(time.perf_counter() - self.started - excluded_s, 1e-9)
        rates = {
            "tokens_per_s": self.tokens / elapsed,
            "tokens_per_s_per_device": self.tokens / elapsed / world_size,
            "samples_per_s": self.samples / elapsed,
        }
        if self.flops:
            rates["tflops_per_s_per_device"] = self.flops / elapsed / world_size / 1e12
            if peak:
                rates["mfu"] = self.flops / elapsed / world_size / peak
        return rates


class Progress:
    """Rank 0's view of the run: a live bar on a terminal, one line per log step otherwise."""

    def __init__(self, enabled: bool, total: int, start: int, shown: tuple = ()):
        self.enabled, self.shown = enabled, shown  # shown: the objective's (label, figure, format) beside the loss
        self.total = total
        self.started, self.start = time.perf_counter(), start
        self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True) if enabled and sys.stderr.isatty() else None

    def update(self, step: int, metrics: Dict[str, float]) -> None:
        if not self.enabled:
            return
        figures = "".join(f" | {label} {metrics[key]:{form}}" for label, key, form in self.shown if key in metrics)
        text = f"loss {metrics['loss']:.4f}{figures} | {metrics['tokens_per_s']:,.0f} tok/s"
        if "mfu" in metrics:
            text += f" | MFU {metrics['mfu']:.1%}"
        elif "tflops_per_s_per_device" in metrics:
            text += f" | {metrics['tflops_per_s_per_device']:.2f} TFLOP/s/device"
        rank = f" (rank {metrics['peak_memory_rank']})" if any(k.startswith("rank_peak_gb/") for k in metrics) else ""
        text += f" | peak mem {metrics['peak_memory_gb']:.2f} GB{rank}"
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(step - self.bar.n)
        else:
            per_step = (time.perf_counter() - self.started) / max(step - self.start, 1)
            eta = time.strftime("%H:%M:%S", time.gmtime(per_step * (self.total - step)))
            print(f"step {step}/{self.total} | {text} | lr {metrics['lr']:.2e} | eta {eta}", file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class StepMeter:
    """What every step logs (loss, lr, grad norm), what log steps add (rates, MFU, memory), and state bytes once."""

    def __init__(self, fabric, strategy, train: TrainArgs, flops, total_steps: int, start_step: int, compiled=None, objective=None,
                 phases: Optional[PhasePeaks] = None):
        self.fabric, self.strategy, self.train, self.flops, self.compiled = fabric, strategy, train, flops, compiled
        self.phases = phases  # the run's phase peaks: on a GPU the rows' peak is read through them
        self.objective = objective  # its figures join the log (litft.objectives)
        self.total_steps, self.start_step = total_steps, start_step
        self.window = Throughput()
        self.progress = Progress(fabric.is_global_zero, total_steps, start_step, getattr(objective, "progress", ()))
        self.grad_bytes = 0
        self.compile_s = 0.0  # compilation time already taken out of earlier windows

    def before_optimizer_step(self, step: int, lm, optimizer) -> None:
        if step == self.start_step:  # gradients as the step sees them; zero_grad frees them
            self.grad_bytes = self.strategy.state_bytes(lm, optimizer)["grads"]

    def after_step(self, state, loss_sum: torch.Tensor, lr: float, grad_norm, batch, lm, optimizer, router_aux=None, expert_load=None,
                   figures=None, maxima=None) -> dict:
        """The step's metrics; only log steps read the loss and norm back from the device, and gather memory."""
        metrics = {"lr": lr, "epoch": state.epoch, "tokens": state.tokens}
        first = state.step == self.start_step + 1
        if first:
            metrics.update(self._state_bytes(lm, optimizer))
        self.window.add(batch.tokens, batch.samples, batch.flops, batch.fetch_s)
        if state.step % self.train.log_interval == 0 or state.step == self.total_steps:
            metrics["loss"] = self.fabric.all_reduce(loss_sum, reduce_op="sum").item() / max(batch.targets, 1)
            if router_aux is not None:  # MoE: the router's load-balancing loss, included in "loss", averaged over the ranks
                metrics["router_aux_loss"] = self.fabric.all_reduce(router_aux, reduce_op="mean").item()
            counts = expert_load.take() if expert_load is not None else None
            if counts is not None:  # MoE: how evenly the router spread the tokens since the last log step, over every rank
                metrics.update(load_figures(self.fabric.all_reduce(counts, reduce_op="sum"), expert_load.groups))
            if figures is not None:  # the objective's own figures of the step (a preference objective's rewards, margin, accuracy)
                largest = None if maxima is None else self.fabric.all_reduce(maxima, reduce_op=torch.distributed.ReduceOp.MAX)
                metrics.update(self.objective.figures(self.fabric.all_reduce(figures, reduce_op="sum"), maxima=largest))
            if grad_norm is not None:
                metrics["grad_norm"] = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            compiling = self.compiled.read() if self.compiled is not None else {"compile_s": 0.0}
            metrics.update(self.window.rates(self.fabric.world_size, self.flops.peak if self.flops else None, compiling["compile_s"] - self.compile_s))
            if self.objective is not None:
                metrics.update(self.objective.window_times(time.perf_counter() - self.window.started, self.window.batches_s, self.window.steps,
                                                           self.window.tokens))
            metrics.update(peak_memory_by_rank(self.fabric, self.phases))
            if self.compiled is not None:  # torch.compile's time and frames so far; the time is kept out of the rates
                metrics.update(compiling)
                self.compile_s = compiling["compile_s"]
            self.fabric.log_dict(metrics, step=state.step)
            self.progress.update(state.step, metrics)
            self.window = Throughput()
        if first and self.phases is not None:
            self.phases.mark()  # later rows' peaks are training's, not setup's or the first step's
        elif first and self.fabric.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.fabric.device)
        return metrics

    def _state_bytes(self, lm, optimizer) -> Dict[str, int]:
        """What sharding saves: parameters, gradients and optimizer states on the fullest rank; they do not change. With
        activation offload, the host bytes of a micro-batch's saved activations too."""
        held = self.strategy.state_bytes(lm, optimizer)
        names, values = ["params_bytes", "grads_bytes", "optimizer_bytes"], [held["params"], self.grad_bytes, held["optimizer"]]
        if self.train.activation_offload:  # host memory a micro-batch's saved activations took (the last micro-batch's)
            names.append("offloaded_bytes")
            values.append(getattr(lm, "offloaded_bytes", 0))
        most = torch.tensor(values, dtype=torch.float64, device=self.fabric.device)
        if self.fabric.world_size > 1:  # the rank that holds the most is the one that runs out of memory
            most = self.fabric.all_reduce(most, reduce_op="max")
        return dict(zip(names, (int(v) for v in most.tolist())))
