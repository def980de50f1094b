"""The device mesh: every dimension litft splits a run over, checked, built and handed out from here alone.

A rank's place is its global rank read as digits of these sizes, outermost first:

    replicate      ranks holding the same shards, gradients all-reduced across: HYBRID_SHARD's shard groups (a node each,
                   by default), every rank under DDP
    shard          ranks that split parameters, gradients and optimizer states: FSDP's shard group, every rank under ZeRO
    tensor         --tensor_parallel: consecutive ranks that split every block, innermost (inside a node, taking the same samples)

and, inside a shard group (each cut into groups of consecutive ranks, inside a node):

    context        --context_parallel: ranks that split every sequence (taking the same samples)
    expert         --expert_parallel: ranks that deal the experts out (taking different samples); the experts' own mesh is
                   (replicate, expert_shard, expert), expert_shard being the ranks of a shard group that hold the same experts

The ranks that take different samples (the data-parallel world) are the world over context x tensor. ``Mesh.build`` makes
every device mesh and process group of the run once, after the processes have joined; nothing else in litft makes one.
"""

from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch.distributed as dist

from litft.config import Layout
from litft.errors import LitftError


def data_world(world: int, context: int = 1, tensor: int = 1) -> int:
    """Ranks that take different samples: a context- or tensor-parallel group takes the same ones."""
    return world // (context * tensor)


def layout_data_world(layout: Layout) -> int:
    return data_world(layout.world_size, layout.context_parallel, layout.tensor_parallel)


@dataclass(frozen=True)
class DataPlace:
    """Which samples a rank takes and which slice of them it keeps.

    ``data_rank`` of ``data_world``: the data-parallel rank whose samples it takes, shared by the ``context`` ranks of its
    context group (each keeping slice ``place`` of every row) or the ``tensor`` ranks of its tensor-parallel group (each
    taking them whole); ``group``: the context group's process group, which attention and the sequence sums reduce over.
    """

    context: int = 1
    place: int = 0
    data_rank: int = 0
    data_world: int = 1
    tensor: int = 1
    group: Optional[object] = field(default=None, compare=False)

    @property
    def shared(self) -> int:
        """Ranks that take the same samples: a context group, or a tensor-parallel group."""
        return self.context * self.tensor

    def split(self, batch: dict) -> dict:
        """This rank's slice of a collated micro-batch; the whole rows' boundaries stay, for attention."""
        from litft.parallel.context import slice_batch

        return batch if self.context == 1 else slice_batch(batch, self.place, self.context, self.group)


@dataclass(frozen=True)
class Mesh:
    """The sizes of every dimension of a run's mesh (1 where a dimension is not used), and, once built, its groups."""

    replicas: int
    shard: int
    tensor: int = 1
    context: int = 1
    expert: int = 1
    ranks: int = 0  # the world's processes (replicas x shard x tensor where not given); ``check`` holds the product to it
    built: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, layout: Layout, strategy) -> "Mesh":
        """The mesh of a layout under its strategy class, whose ``data_groups`` say how it replicates and shards (only FSDP
        reads ``--fsdp.*``)."""
        replicas, shard = strategy.data_groups(layout)
        return cls(replicas, shard, layout.tensor_parallel, layout.context_parallel, layout.expert_parallel, layout.world_size)

    @property
    def world(self) -> int:
        return self.ranks or self.replicas * self.shard * self.tensor

    @property
    def data_world(self) -> int:
        return data_world(self.world, self.context, self.tensor)

    @staticmethod
    def check_groups_fit_nodes(layout: Layout) -> None:
        """Groups that exchange at every layer stay inside a node: their sizes divide --devices."""
        for flag, size, what in (("--expert_parallel", layout.expert_parallel, "experts are dealt out over ranks of one node (tokens cross between them by "
                                  "all-to-all in every MoE layer)"),
                                 ("--tensor_parallel", layout.tensor_parallel, "a block is split over ranks of one node (it all-reduces twice per block)"),
                                 ("--context_parallel", layout.context_parallel, "a sequence is split over ranks of one node (its all-to-all runs at every layer)")):
            if layout.devices % size:
                raise LitftError(f"{flag} {size} must divide --devices {layout.devices}: {what}; choose a divisor of --devices")

    def check(self, layout: Layout) -> None:
        """Refuse, in one line, sizes that do not make one mesh of the layout's ranks (after the strategy's own checks)."""
        if self.replicas * self.shard * self.tensor != self.world:
            raise LitftError(f"the mesh's {self.replicas} x {self.shard} x {self.tensor} ranks are not the world's {self.world}")
        if self.expert > 1 and self.shard % self.expert:
            raise LitftError(
                f"--expert_parallel {self.expert} must divide FSDP's shard group ({self.shard} ranks under {layout.fsdp.sharding_strategy}): an "
                "expert group holds one copy of the experts between them; choose a divisor of it or another --fsdp.sharding_strategy"
            )

    def place(self, rank: int) -> DataPlace:
        """Where ``rank`` sits among the samples; its context group's process group once the mesh is built."""
        shared = self.context * self.tensor
        return DataPlace(self.context, (rank // self.tensor) % self.context, rank // shared, self.data_world, self.tensor,
                         self.built.get("context"))

    def dense_dims(self) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
        """FSDP's mesh, (replicate, shard) or (replicate, shard, tensor): shape and dimension names."""
        if self.tensor > 1:
            return (self.replicas, self.shard, self.tensor), ("replicate", "shard", "tensor")
        return (self.replicas, self.shard), ("replicate", "shard")

    def expert_dims(self) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
        """The experts' mesh over the same ranks: each shard group cut into expert groups of consecutive ranks."""
        if self.replicas > 1:
            return (self.replicas, self.shard // self.expert, self.expert), ("replicate", "expert_shard", "expert")
        return (self.shard // self.expert, self.expert), ("expert_shard", "expert")

    def build(self, device_type: str, timeout=None, host_group: bool = False) -> "Mesh":
        """Every device mesh and process group of the run, made once per process (every rank takes part in making each).

        ``host_group``: a gloo group over every rank, for the loop's counts where the run's backend has no CPU side (DeepSpeed
        takes NCCL alone): reduced there, they never wait on the GPU.
        """
        if self.built or not dist.is_initialized():
            return self
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = self.dense_dims()
        self.built["dense"] = init_device_mesh(device_type, shape, mesh_dim_names=names)
        if self.expert > 1:
            shape, names = self.expert_dims()
            self.built["experts"] = init_device_mesh(device_type, shape, mesh_dim_names=names)
        if self.context > 1:
            rank = dist.get_rank()
            for first in range(0, self.world, self.context):
                group = dist.new_group(list(range(first, first + self.context)), timeout=timeout)
                if first <= rank < first + self.context:
                    self.built["context"] = group
        if host_group:
            self.built["host"] = dist.new_group(backend="gloo", timeout=timeout)
        return self

    def _get(self, name: str):
        if name not in self.built:
            raise LitftError(f"the run's mesh has no {name} part (built: {', '.join(self.built) or 'nothing'})")
        return self.built[name]

    @property
    def dense_mesh(self):
        """FSDP's (replicate, shard[, tensor]) device mesh."""
        return self._get("dense")

    @property
    def expert_mesh(self):
        """The experts' (replicate, expert_shard, expert) device mesh, or None without expert parallel."""
        return self.built.get("experts")

    @property
    def host_group(self):
        """Where the loop's counts are summed: the default group where it has a CPU side, else the gloo group built for them."""
        return self.built.get("host")

    @property
    def tensor_group(self):
        return self.dense_mesh["tensor"].get_group()

    @property
    def replicate_group(self):
        return self.dense_mesh.get_group("replicate")

    def rows_mesh(self):
        """A 1-D mesh over every rank on the CPU: where a checkpoint's rows sit whatever the accelerator (ZeRO's litft layout)."""
        if "rows" not in self.built:
            from torch.distributed.device_mesh import init_device_mesh

            self.built["rows"] = init_device_mesh("cpu", (dist.get_world_size(),))
        return self.built["rows"]

    def describe(self) -> str:
        """The run's first-screen line: the mesh's dimensions, outermost first, and the groups cut inside shard groups."""
        dims = [f"replicate {self.replicas}"] * (self.replicas > 1) + [f"shard {self.shard}"] * (self.shard > 1 or self.replicas == 1)
        dims += [f"tensor {self.tensor}"] * (self.tensor > 1)
        inside = [f"{name} groups of {size}" for name, size in (("context", self.context), ("expert", self.expert)) if size > 1]
        return "mesh: " + " x ".join(dims) + (f" ({', '.join(inside)})" if inside else "")
