"""Activation offloading: what autograd keeps from the forward for the backward waits in host memory.

A long sequence's activations outgrow the device long before its weights do. Under ``--train.activation_offload``
every tensor the forward saves for the backward (above a small size, and not a weight) is copied to pinned host memory
on a side stream while the forward goes on, and its device memory is released once the copy is done; in the backward
each comes back on the same stream a little ahead of use (the next tensors in backward order, about one block's bytes),
so the copies overlap the compute. With activation checkpointing only the blocks' inputs are saved outside the
checkpointed regions (torch's checkpoint saves its inputs through the saved-tensor hooks around it), so only those move.

The values are copies, so losses and gradients are exactly those of the run without it. On the CPU there is no device
memory to spare: the same hooks copy within host memory (the path tested in CI, nothing saved).
"""

import contextlib
import weakref
from typing import Iterator, List, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

# Smaller tensors (a norm's per-token statistics, index vectors) stay: a copy's fixed cost outweighs their bytes.
MIN_BYTES_CUDA = 64 * 1024


def _weight(tensor: torch.Tensor) -> bool:
    """A parameter, or autocast's cast of a trained one (its grad_fn a copy whose source accumulates into a leaf)."""
    if isinstance(tensor, torch.nn.Parameter):
        return True
    grad_fn = tensor.grad_fn
    if grad_fn is None or type(grad_fn).__name__ != "ToCopyBackward0":
        return False
    source = grad_fn.next_functions[0][0]
    return source is not None and type(source).__name__ == "AccumulateGrad"


def _dense(tensor: torch.Tensor) -> bool:
    """Whether the tensor's elements fill its memory without gaps or overlaps, in some order of its dimensions: then
    ``empty_like`` gives a copy the very same strides (size-1 dimensions' included, which matmul reads to choose a kernel)."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class _Saved:
    """One saved tensor's host copy, and its device copy once fetched back."""

    __slots__ = ("host", "shape", "stride", "dtype", "device", "on_device", "ready", "index", "nbytes", "saves", "uses", "ahead")

    def __init__(self, tensor: torch.Tensor, host: Optional[torch.Tensor], index: int):
        self.host, self.index = host, index
        self.shape, self.stride, self.dtype, self.device = tensor.shape, tensor.stride(), tensor.dtype, tensor.device
        self.on_device: Optional[torch.Tensor] = None
        self.ready = None  # the side stream's event once the device copy is written
        self.nbytes = tensor.numel() * tensor.element_size()
        self.saves = 1  # the saves it stands for (a tensor saved by several ops is copied once)
        self.uses = 1  # those not unpacked yet: the device copy is kept until the last of them is
        self.ahead = False  # fetched before it was asked for, and not used yet


_SIDE_STREAMS = {}  # one per device for the process: a stream taken from torch's pool each step could be NCCL's


class _SideStream:
    """The CUDA side stream the copies run on, and the waits that keep them ordered against the compute stream."""

    pin = True

    def __init__(self, device: torch.device):
        if device not in _SIDE_STREAMS:
            _SIDE_STREAMS[device] = torch.cuda.Stream(device)
        self.stream = _SIDE_STREAMS[device]

    def copying(self, after_compute: bool):
        """The side stream, waiting for the compute stream's work so far where a copy reads what it wrote (out to the host);
        a copy back reads only the host copy, which the side stream itself wrote earlier."""
        if after_compute:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        return torch.cuda.stream(self.stream)

    def keep_until_copied(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(self.stream)  # its memory is not reused before the side stream has read it

    def written(self):
        """An event after the copies queued so far: what one tensor's use waits for (not the later prefetches)."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def hand_over(self, tensor: torch.Tensor, ready) -> None:
        compute = torch.cuda.current_stream(self.stream.device)
        compute.wait_event(ready)
        tensor.record_stream(compute)  # fetched on the side stream, freed only after the compute stream is done with it


class _SameStream:
    """The CPU's stand-in: copies are synchronous, and nothing waits."""

    pin = False

    def copying(self, after_compute: bool):
        return contextlib.nullcontext()

    def keep_until_copied(self, tensor: torch.Tensor) -> None:
        pass

    def written(self):
        return None

    def hand_over(self, tensor: torch.Tensor, ready) -> None:
        pass


class ActivationOffload:
    """Saved-tensor hooks for one forward; ``hooks()`` is entered around it, and the backward unpacks what it packed.

    ``prefetch_bytes``: how far ahead of use the backward fetches (0: each tensor when asked, which waits on the copy);
    by default about the bytes of one block, measured from the forward as the packed bytes over ``blocks``.
    ``streams``: what orders the copies on a device (default: a CUDA side stream; on the CPU, nothing to order).
    ``host_bytes`` counts what the host holds: torch's pinned-memory cache rounds each block up to a power of two
    (``pinned_sizes``: count it so; default: where the copies are pinned).
    """

    def __init__(self, blocks: int = 1, min_bytes: Optional[int] = None, prefetch_bytes: Optional[int] = None, streams=None,
                 pinned_sizes: Optional[bool] = None):
        self.blocks = max(blocks, 1)
        self.min_bytes = min_bytes
        self.prefetch_bytes = prefetch_bytes
        self.saved: List[_Saved] = []
        self.moved_bytes = 0  # bytes copied to the host in the forward
        self.host_bytes = 0  # what holding them takes there
        self.pinned_sizes = pinned_sizes
        self.fetched_bytes = 0  # bytes copied back in the backward
        self._streams = {}
        self._make_streams = streams or (lambda device: _SideStream(device) if device.type == "cuda" else _SameStream())
        self._latest = {}  # a tensor seen twice (q, k and v's input) is copied once: (storage, layout) -> (weakref, saved)
        self._next_fetch = -1  # the highest index not yet fetched ahead, counting down as the backward goes
        self._ahead_bytes = 0  # fetched ahead and not yet used
        self.active = True  # cleared after the last block (``stop``): what the head saves is the backward's first need

    @contextlib.contextmanager
    def hooks(self) -> Iterator["ActivationOffload"]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self
        self._latest.clear()  # the forward is over: later tensors may take these addresses
        self._next_fetch = len(self.saved) - 1
        self._fetch_ahead(len(self.saved))  # the backward starts with the last ones saved: start bringing them back now

    def stop(self) -> None:
        """Keep what is saved from here on on the device: past the last block the backward starts at once with it (the head's
        gradients, made in the forward, are as large as its weight), so a copy out and back would only cost time."""
        self.active = False

    def _streams_for(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = self._make_streams(device)
        return self._streams[device]

    def _moves(self, tensor: torch.Tensor) -> bool:
        """Activations only: not a parameter, a cast of a trained weight (autocast's copy, alive for the step anyway), or a
        view of either (a weight kept transposed for its input's gradient); not a tensor subclass, a slice with gaps, nor a
        small tensor."""
        if not self._plain(tensor) or tensor.device.type == "meta" or _weight(tensor) or (tensor._base is not None and _weight(tensor._base)):
            return False
        if not _dense(tensor):  # a slice with gaps: its copy would come back contiguous, and strides can choose kernels
            return False
        floor = self.min_bytes if self.min_bytes is not None else (MIN_BYTES_CUDA if tensor.device.type == "cuda" else 0)
        return tensor.numel() * tensor.element_size() >= max(floor, 1)

    @staticmethod
    def _plain(tensor: torch.Tensor) -> bool:
        return type(tensor) is torch.Tensor

    def _pack(self, tensor: torch.Tensor):
        if not self.active or not self._moves(tensor):
            return tensor
        key = (tensor.untyped_storage()._cdata, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        seen = self._latest.get(key)
        if seen is not None and seen[0]() is tensor:
            seen[1].saves += 1
            seen[1].uses += 1
            return seen[1]
        streams = self._streams_for(tensor.device)
        saved = _Saved(tensor, self._copy_out(tensor, streams), len(self.saved))
        self.saved.append(saved)
        self.moved_bytes += saved.nbytes
        pinned = self.pinned_sizes if self.pinned_sizes is not None else streams.pin
        self.host_bytes += 1 << max(saved.nbytes - 1, 0).bit_length() if pinned else saved.nbytes
        self._latest[key] = (weakref.ref(tensor), saved)
        return saved

    def _copy_out(self, tensor: torch.Tensor, streams) -> Optional[torch.Tensor]:
        with streams.copying(after_compute=True):
            host = torch.empty_like(tensor, device="cpu", pin_memory=streams.pin)
            host.copy_(tensor, non_blocking=streams.pin)
        streams.keep_until_copied(tensor)
        return host

    def _copy_in(self, saved: _Saved, streams) -> torch.Tensor:
        with streams.copying(after_compute=False):
            on_device = torch.empty_like(saved.host, device=saved.device)
            on_device.copy_(saved.host, non_blocking=streams.pin)
        return on_device

    def _unpack(self, packed):
        if not isinstance(packed, _Saved):
            return packed
        if packed.on_device is None:
            self._fetch(packed)
        elif packed.ahead:
            self._ahead_bytes -= packed.nbytes
            packed.ahead = False
        # A tensor saved once is where the backward has come to; one saved by several ops is first asked for at its last
        # save, far below its own index, and moving the cursor there would end the prefetching.
        self._fetch_ahead(packed.index if packed.saves == 1 else self._next_fetch + 1)
        tensor, ready = packed.on_device, packed.ready
        packed.uses -= 1
        if packed.uses <= 0:
            packed.on_device = packed.ready = None  # one more unpack (a second backward with retain_graph) fetches it again
        self._streams_for(packed.device).hand_over(tensor, ready)
        return tensor

    def _fetch(self, saved: _Saved) -> None:
        streams = self._streams_for(saved.device)
        saved.on_device = self._copy_in(saved, streams)
        saved.ready = streams.written()
        self.fetched_bytes += saved.nbytes

    def _fetch_ahead(self, asked: int) -> None:
        """Fetch the tensors the backward will want next (saved before index ``asked``), up to the prefetch budget in flight."""
        budget = self.prefetch_bytes if self.prefetch_bytes is not None else self.moved_bytes // self.blocks
        self._next_fetch = min(self._next_fetch, asked - 1)
        while self._next_fetch >= 0 and self._ahead_bytes < budget:
            ahead = self.saved[self._next_fetch]
            if ahead.on_device is None:
                self._fetch(ahead)
                ahead.ahead = True
                self._ahead_bytes += ahead.nbytes
            self._next_fetch -= 1


class CountedOffload(ActivationOffload):
    """The estimate's stand-in (litft.estimate.trace): no copy is made, the device side is what a traced step holds (a tensor
    fetched back is made anew, ahead as the real one fetches), and ``host_bytes`` is the pinned host memory it would take."""

    def __init__(self, blocks: int = 1):
        super().__init__(blocks, min_bytes=MIN_BYTES_CUDA, streams=lambda device: _SameStream(), pinned_sizes=True)

    @staticmethod
    def _plain(tensor: torch.Tensor) -> bool:
        return type(tensor) is FakeTensor  # the trace's activations; parameters stay Parameters

    def _copy_out(self, tensor: torch.Tensor, streams) -> None:
        return None

    def _copy_in(self, saved: _Saved, streams) -> torch.Tensor:
        # The same strides, size-1 dimensions' too: matmul reads them to choose its kernel, and a recompute must choose alike.
        return torch.empty_strided(saved.shape, saved.stride, dtype=saved.dtype, device=saved.device)
