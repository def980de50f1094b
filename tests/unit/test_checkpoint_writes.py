"""Checkpoints written in the background (--train.async_save), in one process with DCP's real writer.

The background write is held until the test lets it go, so what is checked does not depend on timing: the checkpoint
holds the training state of its step even though training changed it in place meanwhile, it counts only once committed,
and a write that fails stops the run in one line with the checkpoint before it kept. (Sharded runs resumed from
background checkpoints: tests/distributed/test_resume.py.)
"""

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

import litft.checkpoint.manager as manager
from litft.checkpoint.format import CheckpointMeta, complete_checkpoints
from litft.checkpoint.manager import Checkpointer, host_copy
from litft.errors import LitftError


class OneProcess:
    global_rank, world_size = 0, 1

    def barrier(self):
        pass


class Strategy:
    def __init__(self, weight: torch.Tensor, moment: torch.Tensor):
        self.weight, self.moment = weight, moment

    def checkpoint_state(self, lm, optimizer) -> dict:
        return {"model": {"w": self.weight}, "optimizer": {"state": {"w": {"exp_avg": self.moment, "step": 3}}, "param_groups": [{"lr": 0.1}]}}


def checkpointer(out_dir: Path, strategy: Strategy) -> Checkpointer:
    meta = CheckpointMeta(job="finetune_full", model="m", quantize=None, format="dcp", strategy="single", zero_stage=None,
                          model_fingerprint={}, trained_shapes=None, global_batch_size=8, num_train_samples=64, seed=0)
    scheduler = SimpleNamespace(state_dict=lambda: {"last_epoch": 1})
    train = SimpleNamespace(keep_checkpoints=2, async_save=True)
    return Checkpointer(OneProcess(), strategy, None, None, scheduler, out_dir, train, meta, {"job": "finetune_full"})


def position(step: int) -> dict:
    return {"step": step, "epoch": 0, "epoch_step": step, "tokens": 10 * step, "samples": 8 * step}


def read_back(folder: Path) -> dict:
    state = {"model": {"w": torch.zeros(4, 3)}, "optimizer": {"state": {"w": {"exp_avg": torch.zeros(4, 3), "step": 0}}, "param_groups": [{"lr": 0.0}]}}
    dcp.load(state, checkpoint_id=str(folder / "model"))
    return state


@pytest.fixture
def held_writes(monkeypatch):
    """DCP's save, held in its background thread until the test sets the event."""
    go = threading.Event()
    real = dcp.save

    def held(*args, **kwargs):
        assert go.wait(60), "the test never released the write"
        return real(*args, **kwargs)

    monkeypatch.setattr(manager.dcp, "save", held)
    return go


def test_a_background_checkpoint_holds_its_steps_state(tmp_path, held_writes):
    weight, moment = torch.arange(12.0).view(4, 3), torch.full((4, 3), 0.5)
    saver = checkpointer(tmp_path, Strategy(weight, moment))
    assert saver.save(position(2)) is None  # being written
    weight.add_(100.0)  # training goes on, in place, while the write waits
    moment.mul_(3.0)
    assert complete_checkpoints(tmp_path) == [] and not saver.written()  # uncommitted: not a checkpoint yet
    held_writes.set()
    final = saver.complete()
    assert final == tmp_path / "checkpoints" / "step-00000002" and complete_checkpoints(tmp_path) == [final]
    assert saver.last_path == final and saver.last_saved == 2
    got = read_back(final)
    assert torch.equal(got["model"]["w"], torch.arange(12.0).view(4, 3))
    assert torch.equal(got["optimizer"]["state"]["w"]["exp_avg"], torch.full((4, 3), 0.5))
    assert CheckpointMeta.read(final).step == 2


def test_a_failed_background_write_keeps_the_checkpoint_before(tmp_path, monkeypatch):
    weight = torch.ones(4, 3)
    saver = checkpointer(tmp_path, Strategy(weight, torch.zeros(4, 3)))
    saver.save(position(2))
    first = saver.complete()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device\nand more lines")

    monkeypatch.setattr(manager.dcp, "save", disk_full)
    saver.save(position(4))
    with pytest.raises(LitftError, match=r"^writing checkpoint .*step-00000004 in the background failed \(OSError: .*No space left on device\)") as err:
        saver.complete()
    assert "\n" not in str(err.value)
    assert complete_checkpoints(tmp_path) == [first] and saver.last_path == first
    assert (tmp_path / "checkpoints" / ".step-00000004.partial").is_dir()  # never committed, never resumed from


def test_host_copy_copies_host_tensors_and_keeps_the_rest():
    tensor = torch.ones(3)
    state = {"a": [tensor, 2, "x"], "b": (tensor,), "c": None}
    copied = host_copy(state)
    tensor.add_(1)
    assert torch.equal(copied["a"][0], torch.ones(3)) and isinstance(copied["b"], tuple) and copied["a"][1:] == [2, "x"]
    assert copied["c"] is None
