"""The device mesh: every dimension litft splits a run over, outermost first, read by every strategy and split.

A rank's place is its global rank read as digits of these sizes, outermost first:

    replicate      HYBRID_SHARD's shard groups (a node each, by default): the same shards, gradients all-reduced across
    shard          FSDP's shard group: parameters, gradients and optimizer states split over its ranks
    tensor         --tensor_parallel: consecutive ranks that split every block, innermost (inside a node, taking the same samples)

and, inside a shard group (each cut into groups of consecutive ranks, inside a node):

    context        --context_parallel: ranks that split every sequence (taking the same samples)
    expert         --expert_parallel: ranks that deal the experts out (taking different samples); the experts' own mesh is
                   (replicate, expert_shard, expert), expert_shard being the ranks of a shard group that hold the same experts

The ranks that take different samples (the data-parallel world) are the world over context x tensor.
"""

from dataclasses import dataclass
from typing import Tuple

from litft.config import Layout


@dataclass(frozen=True)
class Mesh:
    """The sizes of every dimension of a layout's mesh (1 where a dimension is not used)."""

    replicas: int
    shard: int
    tensor: int = 1
    context: int = 1
    expert: int = 1

    @classmethod
    def of(cls, layout: Layout) -> "Mesh":
        replicas, shard = fsdp_groups(layout)
        return cls(replicas, shard, layout.tensor_parallel, layout.context_parallel, layout.expert_parallel)

    @property
    def world(self) -> int:
        return self.replicas * self.shard * self.tensor

    def dense(self) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
        """FSDP's mesh, (replicate, shard) or (replicate, shard, tensor): shape and dimension names."""
        if self.tensor > 1:
            return (self.replicas, self.shard, self.tensor), ("replicate", "shard", "tensor")
        return (self.replicas, self.shard), ("replicate", "shard")

    def experts(self) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
        """The experts' mesh over the same ranks: each shard group cut into expert groups of consecutive ranks."""
        if self.replicas > 1:
            return (self.replicas, self.shard // self.expert, self.expert), ("replicate", "expert_shard", "expert")
        return (self.shard // self.expert, self.expert), ("expert_shard", "expert")

    def context_split(self, rank: int):
        """Where ``rank`` sits among the context groups (litft.parallel.context.ContextSplit)."""
        from litft.parallel.context import ContextSplit

        return ContextSplit.of(rank, self.world, self.context, self.tensor)

    def describe(self) -> str:
        """The run's first-screen line: the mesh's dimensions, outermost first, and the groups cut inside shard groups."""
        dims = [f"replicate {self.replicas}"] * (self.replicas > 1) + [f"shard {self.shard}"] + [f"tensor {self.tensor}"] * (self.tensor > 1)
        inside = [f"{name} groups of {size}" for name, size in (("context", self.context), ("expert", self.expert)) if size > 1]
        return "mesh: " + " x ".join(dims) + (f" ({', '.join(inside)})" if inside else "")

def fsdp_groups(layout: Layout) -> Tuple[int, int]:
    """(replicas, shard group size) of FSDP's mesh, over the ranks a tensor-parallel group counts as one."""
    kind, world = layout.fsdp.sharding_strategy, layout.world_size // layout.tensor_parallel
    if kind in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return 1, world
    if kind == "NO_SHARD":
        return world, 1
    shard = layout.fsdp.shard_size or layout.devices // layout.tensor_parallel
    return world // shard, shard
