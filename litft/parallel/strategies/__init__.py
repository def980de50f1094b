"""Parallelism in one place: each strategy is one module behind ``TrainingStrategy``; a new strategy is one new module."""

from typing import Type

from litft.config import Layout
from litft.errors import LitftError
from litft.parallel.mesh import Mesh
from litft.parallel.strategies.base import TrainingStrategy
from litft.parallel.strategies.ddp import DDP, SingleDevice
from litft.parallel.strategies.deepspeed import DeepSpeed
from litft.parallel.strategies.fsdp import FSDP

BY_NAME = {"ddp": DDP, "fsdp": FSDP, "deepspeed": DeepSpeed}


def strategy_class(layout: Layout) -> Type[TrainingStrategy]:
    """The strategy a layout asks for: ``auto`` is one device, or DDP for several."""
    if layout.strategy == "auto":
        return SingleDevice if layout.world_size == 1 else DDP
    return BY_NAME[layout.strategy]


def checked_strategy_class(layout: Layout, accelerator: str, precision: str) -> Type[TrainingStrategy]:
    """The layout checked, generic part, the mesh and the chosen strategy's own, in one place for the jobs and ``litft estimate``."""
    layout.check()
    Mesh.check_groups_fit_nodes(layout)
    chosen = strategy_class(layout)
    for other in BY_NAME.values():
        group = other.options
        if other is not chosen and group is not None and layout.options(group) != type(layout.options(group))():
            raise LitftError(f"--{group}.* options only apply to --strategy {group} (this run uses --strategy {layout.strategy})")
    if layout.tensor_parallel > 1 and not chosen.splits_blocks:
        raise LitftError(
            f"--tensor_parallel splits blocks as DTensors that FSDP2 shards further; {chosen.name} cannot hold them, use --strategy fsdp"
        )
    if layout.expert_parallel > 1 and not chosen.splits_blocks:
        raise LitftError(
            f"--expert_parallel deals experts out as DTensors that FSDP2 shards further; {chosen.name} cannot hold them, use --strategy fsdp"
        )
    chosen.check(layout, accelerator, precision)
    Mesh.of(layout, chosen).check(layout)
    return chosen


__all__ = ["TrainingStrategy", "SingleDevice", "DDP", "FSDP", "DeepSpeed", "strategy_class", "checked_strategy_class"]
