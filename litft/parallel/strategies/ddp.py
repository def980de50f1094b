"""One device, and DistributedDataParallel: every rank holds the whole model and its states."""

from typing import List, Optional

from lightning_fabric.strategies import DDPStrategy

from litft.cluster import process_group_timeout
from litft.config import Layout, TrainArgs
from litft.memory import Param, Row, States
from litft.parallel.strategies.base import TrainingStrategy


def whole_model_states(tensors: List[Param]) -> States:
    """Everything on one rank: parameters (4-bit ones packed), gradients and AdamW's two states of what trains."""
    trained = [t for t in tensors if t.trainable]
    grads = sum(t.nbytes for t in trained)
    return States(
        params=Row(sum(t.nbytes + t.quant_state for t in tensors)),
        grads=Row(grads),
        # torch's AdamW keeps exp_avg and exp_avg_sq in each parameter's dtype, and a 4-byte step per tensor.
        optimizer=Row(2 * grads + 4 * len(trained), note="AdamW exp_avg + exp_avg_sq"),
        step=Row(0, note="fused AdamW updates in place"),
    )


class SingleDevice(TrainingStrategy):
    name = "one device"

    def fabric_strategy(self):
        return "auto"

    @classmethod
    def memory_layout(cls, tensors: List[Param], layout: Layout, precision: str, train: TrainArgs, hidden_size: Optional[int] = None) -> States:
        return whole_model_states(tensors)


class DDP(TrainingStrategy):
    """Gradients are averaged across ranks in the backward of the last micro-batch of a step."""

    name = "DDP"

    def fabric_strategy(self):
        return DDPStrategy(process_group_backend=self.backend, timeout=process_group_timeout())

    @classmethod
    def memory_layout(cls, tensors: List[Param], layout: Layout, precision: str, train: TrainArgs, hidden_size: Optional[int] = None) -> States:
        states = whole_model_states(tensors)
        # DDP copies gradients into flat buckets for the all-reduce (gradient_as_bucket_view is off).
        states.buffers.append(("DDP gradient buckets", Row(states.grads.gpu)))
        return states
