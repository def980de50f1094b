"""Which samples each rank trains at each step, and the step's micro-batches collated one step ahead."""

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from litft.data.samples import Sample
from litft.data.collate import collate

class SampleOrder:
    """Which samples each rank takes at each step; a pure function of (seed, epoch, step).

    Global batch ``k`` of an epoch is ``perm[k*G:(k+1)*G]``; rank ``r`` takes every
    ``world_size``-th sample of it starting at ``r``. So the same global batch is
    trained whatever the world size, and resuming at step k needs no replay.
    """

    def __init__(self, num_samples: int, global_batch_size: int, micro_batch_size: int, rank: int, world_size: int, seed: int, shuffle: bool = True):
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.steps_per_epoch = num_samples // global_batch_size
        self._perm_epoch: Optional[int] = None
        self._perm: List[int] = []

    def permutation(self, epoch: int) -> List[int]:
        if self._perm_epoch != epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                self._perm = torch.randperm(self.num_samples, generator=gen).tolist()
            else:
                self._perm = list(range(self.num_samples))
            self._perm_epoch = epoch
        return self._perm

    def micro_batches(self, epoch: int, step: int) -> List[List[int]]:
        perm = self.permutation(epoch)
        start = step * self.global_batch_size
        mine = perm[start + self.rank : start + self.global_batch_size : self.world_size]
        return [mine[i : i + self.micro_batch_size] for i in range(0, len(mine), self.micro_batch_size)]


def _pinned(batch):
    """The batch in page-locked memory, so that its copy to the GPU does not wait for the host."""
    if torch.is_tensor(batch):
        return batch.pin_memory()
    return {k: _pinned(v) for k, v in batch.items()} if isinstance(batch, dict) else batch


class StepBatches:
    """This rank's collated micro-batches of every step, made one step ahead on a worker thread.

    The next step's batches are collated (and pinned, for a GPU's non-blocking copy)
    while the current step computes; which samples they hold is still the
    ``SampleOrder``'s pure function of (epoch, step).
    """

    def __init__(self, samples: List[Sample], order: "SampleOrder", pad_id: int, padding_free: bool = False, pin: bool = False,
                 split: Optional[Callable[[dict], dict]] = None):
        self.samples, self.order, self.pad_id, self.padding_free, self.pin, self.split = samples, order, pad_id, padding_free, pin, split
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="litft-collate")
        self.ahead = None

    def position(self, epoch: int, step: int) -> Tuple[int, int]:
        """(epoch, step) itself, or the start of the next epoch once this one has no global batch left."""
        return (epoch + 1, 0) if step >= self.order.steps_per_epoch else (epoch, step)

    def make(self, epoch: int, step: int):
        indices = self.order.micro_batches(epoch, step)
        return collated([[self.samples[i] for i in idx] for idx in indices], self.pad_id, self.padding_free, self.pin, self.split)

    def get(self, epoch: int, step: int, run_step: int = 0):
        """The micro-batches of this step of this epoch; the next step's are started at once."""
        if self.ahead is not None and self.ahead[0] == (epoch, step):
            made = self.ahead[1].result()
        else:
            made = self.make(epoch, step)
        following = (epoch, step + 1) if step + 1 < self.order.steps_per_epoch else (epoch + 1, 0)
        self.ahead = (following, self.pool.submit(self.make, *following))
        return made

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def collated(micro_samples: List[List[Sample]], pad_id: int, padding_free: bool, pin: bool,
             split: Optional[Callable[[dict], dict]] = None) -> List[Dict[str, torch.Tensor]]:
    """Micro-batches of samples, collated, cut to this rank's slice where ``split`` says (context parallel), and pinned, for a
    GPU's non-blocking copy."""
    micro = [collate(samples, pad_id, padding_free) for samples in micro_samples]
    if split is not None:
        micro = [split(b) for b in micro]
    return [_pinned(b) for b in micro] if pin else micro


def eval_batches(num_samples: int, micro_batch_size: int, rank: int, world_size: int) -> Iterator[List[int]]:
    """Validation samples for this rank, every sample exactly once across ranks.

    Every rank gets the same number of batches; a rank whose share ran out gets
    empty ones, so that collective calls inside forward stay matched.
    """
    mine = list(range(rank, num_samples, world_size))
    per_rank = math.ceil(num_samples / world_size)
    for i in range(0, per_rank, micro_batch_size):
        yield mine[i : i + micro_batch_size]
