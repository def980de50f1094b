"""The loop's small policies on their own, without processes: cadences, stop requests, throughput, position."""

import json
import time

import pytest
import torch

from litft.config import EvalArgs

from litft.objectives.args import ObjectiveArgs
from litft.run.loop import LoopState
from litft.run.metrics import ANOTHER_RANK, Cadence, SampleLog, StopRequests, Throughput
from litft.objectives import Supervised


def test_cadence_validates_and_saves_on_its_intervals_but_not_at_the_end():
    cadence = Cadence(total_steps=10, eval=EvalArgs(interval=4, initial_validation=True), save_interval=3)
    assert [s for s in range(1, 11) if cadence.validate_now(s)] == [4, 8]
    assert [s for s in range(1, 11) if cadence.save_now(s)] == [3, 6, 9]  # step 10 is saved by the end of the loop
    assert cadence.validate_first(0) and not cadence.validate_first(5)  # a resumed run does not validate first
    off = Cadence(total_steps=10, eval=EvalArgs(interval=0, initial_validation=False), save_interval=None)
    assert not any(off.validate_now(s) or off.save_now(s) for s in range(1, 11)) and not off.validate_first(0)


def test_cadence_ends_at_the_step_count_or_the_token_budget():
    cadence = Cadence(total_steps=5, eval=EvalArgs(), save_interval=None, max_tokens=1000)
    assert cadence.more(4, 999) and not cadence.more(5, 0) and not cadence.more(2, 1000)


class Signals:
    received = None


def test_stop_requests_name_the_signal_first_then_the_step_budget():
    signals = Signals()
    stops = StopRequests(signals, stop_after_steps=3, start_step=10)
    assert [stops.reason(s) for s in (10, 12)] == [None, None]
    assert stops.reason(13) == "--train.stop_after_steps 3"  # three steps trained in this launch
    signals.received = "SIGUSR1"
    assert stops.reason(11) == "SIGUSR1"
    assert StopRequests().reason(10**6) is None


def test_the_last_line_names_this_ranks_own_signal_when_it_arrived_after_the_counts_were_shared():
    """Ctrl-C reaches every rank, but one may read its flag a moment before the signal lands (CI saw rank 0 say
    "a signal to another rank" after printing its own Ctrl-C line)."""
    signals = Signals()
    stops = StopRequests(signals)
    assert stops.said(ANOTHER_RANK, 4) == ANOTHER_RANK  # it never came here
    signals.received = "SIGINT"
    assert stops.said(ANOTHER_RANK, 4) == "SIGINT"
    assert stops.said("SIGTERM", 4) == "SIGTERM"  # a reason agreed before is kept


def test_throughput_rates_and_mfu(monkeypatch):
    monkeypatch.setattr(time, "perf_counter", lambda: 102.0)
    window = Throughput(started=100.0)
    window.add(tokens=3000, samples=12, flops=4e12)
    window.add(tokens=1000, samples=4, flops=4e12)
    rates = window.rates(world_size=2, peak=1e12)
    assert rates == {
        "tokens_per_s": 2000.0, "tokens_per_s_per_device": 1000.0, "samples_per_s": 8.0,
        "tflops_per_s_per_device": 2.0, "mfu": 2.0,
    }
    assert "mfu" not in Throughput(flops=1.0).rates(1, peak=None)


def test_loop_position_round_trips_without_its_history():
    state = LoopState(step=7, epoch=1, epoch_step=3, tokens=900, samples=56, history=[{"loss": 1.0}], stopped_by="SIGTERM")
    again = LoopState()
    again.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert again.state_dict() == state.state_dict() == {"step": 7, "epoch": 1, "epoch_step": 3, "tokens": 900, "samples": 56}
    assert again.history == [] and again.stopped_by is None
    with pytest.raises(KeyError):
        again.load_state_dict({"step": 1})


def test_sample_log_writes_one_line_per_step(tmp_path):
    log = SampleLog(tmp_path / "logs" / "rank-00000.jsonl")
    log.write(1, 0, [[3, 1], [4]])
    log.write(2, 0, [[5], [9, 2]])
    lines = [json.loads(line) for line in (tmp_path / "logs" / "rank-00000.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "epoch": 0, "ids": [3, 1, 4]}, {"step": 2, "epoch": 0, "ids": [5, 9, 2]}]
    SampleLog(None).write(1, 0, [[1]])  # off: writes nothing, needs no folder


def test_cuda_allocator_gets_expandable_segments_unless_configured():
    from litft.device import cuda_allocator_defaults

    env = {}
    cuda_allocator_defaults(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    cuda_allocator_defaults(mine)
    assert mine == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}


class OnDevice(torch.Tensor):
    """Stands in for an accelerator tensor: records every read back to the host (each would synchronize a GPU)."""

    reads = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy"):
            cls.reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_train_step_reads_nothing_back_from_the_device_but_on_log_steps():
    from contextlib import nullcontext
    from types import SimpleNamespace

    from litft.config import TrainArgs
    from litft.run.loop import StepBatch, train_step
    from litft.run.metrics import StepMeter

    fabric = SimpleNamespace(
        world_size=1, global_rank=0, device=torch.device("cpu"), is_global_zero=False, to_device=lambda b: b, autocast=nullcontext,
        no_backward_sync=lambda module, enabled: nullcontext(), backward=lambda loss: None, all_reduce=lambda t, reduce_op: t,
        log_dict=lambda metrics, step: None,
    )
    strategy = SimpleNamespace(
        optimizer_step=lambda module, optimizer, max_norm: torch.tensor(0.5).as_subclass(OnDevice),
        state_bytes=lambda lm, optimizer: {"params": 1, "grads": 1, "optimizer": 1},
    )
    train = TrainArgs(log_interval=3, max_norm=1.0)
    trainer = SimpleNamespace(
        fabric=fabric, strategy=strategy, spec=SimpleNamespace(train=train), state=LoopState(), scheduler=SimpleNamespace(step=lambda: None),
        optimizer=SimpleNamespace(param_groups=[{"lr": 0.1}]),
        module=SimpleNamespace(training_step=lambda batch: torch.tensor(2.0).as_subclass(OnDevice)), lm=SimpleNamespace(take_router_aux=lambda: None), objective=Supervised(ObjectiveArgs(), lora=False), expert_load=None,
        meter=StepMeter(fabric, strategy, train, flops=None, total_steps=6, start_step=0), profiler=SimpleNamespace(after=lambda step: None),
    )
    batch = StepBatch(micro=[{}, {}], targets=4, tokens=10, samples=2, flops=0.0)
    reads_per_step = []
    for _ in range(3):
        OnDevice.reads.clear()
        train_step(trainer, batch)
        reads_per_step.append(len(OnDevice.reads))
    assert reads_per_step[:2] == [0, 0] and reads_per_step[2] > 0  # only step 3, a log step, reads the loss and the norm
    assert trainer.state.history[2]["loss"] == pytest.approx(4.0 / 4) and trainer.state.history[2]["grad_norm"] == 0.5
    assert "loss" not in trainer.state.history[0]


@pytest.mark.parametrize("torch_has_set_stance", [True, False])
def test_generation_runs_compiled_blocks_eagerly_and_compiles_nothing_new(monkeypatch, torch_has_set_stance):
    """Inside eager_blocks a compiled block takes new shapes and a new grad mode without a compile (torch.compiler.set_stance,
    and dynamo's disable switch on a torch without it); outside, its compiled code serves the training shape again."""
    from torch._dynamo.utils import counters

    from litft.model.compiling import eager_blocks

    if not torch_has_set_stance:
        monkeypatch.delattr(torch.compiler, "set_stance")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.linear(x)) * 2

    torch._dynamo.reset()
    block = Block()
    block.compile(backend="eager")
    x = torch.randn(4, 8)
    expected = block(x)
    frames = counters["frames"]["total"]
    with eager_blocks(), torch.no_grad():
        for rows in (1, 3, 64):
            torch.testing.assert_close(block(torch.cat([x] * 16)[:rows]), torch.cat([expected] * 16)[:rows])
    assert counters["frames"]["total"] == frames
    block(x)
    assert counters["frames"]["total"] == frames


def test_phase_peaks_tell_phases_apart():
    """A phase's peak is its own: 400 MB touched in one phase shows there and not in the next, which starts from what
    the process holds then; a phase entered again keeps its largest peak; the kernel's high-water mark is left alone."""
    import resource
    import time
    from types import SimpleNamespace

    from litft.run.metrics import PhasePeaks, describe_phases

    phases = PhasePeaks(torch.device("cpu"))
    assert phases.measures  # Linux: /proc/self/status has RssAnon
    phases.enter("first_step")
    big = torch.ones(100_000_000, dtype=torch.float32)  # 0.4 GB, written
    time.sleep(0.1)  # the sampler's 20 ms, a few times over
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del big
    phases.enter("steps")
    small = torch.ones(1_000_000)
    phases.enter("save")
    phases.enter("steps")
    del small
    fabric = SimpleNamespace(world_size=1, global_rank=0, device=torch.device("cpu"))
    peaks = phases.by_rank(fabric)
    assert peaks["phase_peak_gb/first_step"] >= peaks["phase_peak_gb/steps"] + 0.35
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >= maxrss
    assert {f"phase_peak_gb/{p}" for p in ("load", "first_step", "steps", "save")} <= peaks.keys()
    line = describe_phases(peaks, 1)
    assert line.startswith("peak memory by phase, GB: load ") and "first step" in line and "rank" not in line
