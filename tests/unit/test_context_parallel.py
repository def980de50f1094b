"""A context group's slices of a micro-batch put back together are the micro-batch: tokens, positions and every target once."""

import pytest
import torch

from litft.data.collate import collate

from litft.data.samples import IGNORE_INDEX
from litft.config import DeepSpeedArgs, FSDPArgs, Layout
from litft.parallel.context import MARK, slice_batch
from litft.parallel.mesh import DataPlace, Mesh
from litft.parallel.strategies import DDP, FSDP


def sample(length, prompt, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (length,), generator=generator)
    labels = ids.clone()
    labels[:prompt] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "id": seed}


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("size", [2, 3])
def test_slices_make_up_the_batch(padding_free, size):
    batch = collate([sample(7, 2, 0), sample(4, 1, 1), sample(9, 3, 2)], pad_id=0, padding_free=padding_free)
    rows, width = batch["input_ids"].shape
    part = -(-width // size)
    slices = [slice_batch(batch, place, size) for place in range(size)]
    assert all(s["input_ids"].shape == (rows, part) for s in slices)
    whole = torch.cat([s["input_ids"] for s in slices], dim=1)
    assert torch.equal(whole[:, :width], batch["input_ids"])
    positions = torch.cat([s["position_ids"] for s in slices], dim=1)
    assert torch.equal(positions[:, :width], batch["position_ids"])
    # Padding counts on from the row's last position, so attention sees no new sample there.
    assert torch.equal(positions[:, width:], batch["position_ids"][:, -1:] + torch.arange(1, part * size - width + 1))
    # Every target once, on the rank that holds the token predicting it (a slice's last token predicts across its edge).
    found = []
    for place, s in enumerate(slices):
        row, column = s["targets"]["index"] // part, s["targets"]["index"] % part
        found += [(int(r) * width + int(c) + place * part, int(label)) for r, c, label in zip(row, column, s["targets"]["labels"])]
        assert s["varlen"][MARK].size == size and int(s["varlen"]["cu_seq_lens_q"][-1]) == rows * part * size
    expected = list(zip(batch["targets"]["index"].tolist(), batch["targets"]["labels"].tolist()))
    assert sorted(found) == sorted(expected) and len(found) == len(expected)


def test_one_rank_groups_leave_the_batch_alone():
    batch = collate([sample(5, 1, 0)], pad_id=0)
    ddp = Mesh.of(Layout("ddp", 4, 1, FSDPArgs(), DeepSpeedArgs()), DDP)
    place = ddp.place(3)
    assert place.split(batch) is batch and (place.data_rank, place.data_world) == (3, 4) and ddp.describe() == "mesh: replicate 4"
    cp = Mesh.of(Layout("fsdp", 4, 1, FSDPArgs(), DeepSpeedArgs(), context_parallel=2), FSDP)
    assert cp.place(3) == DataPlace(context=2, place=1, data_rank=1, data_world=2) and cp.data_world == 2
