"""One device, and DistributedDataParallel: every rank holds the whole model and its states."""


from lightning_fabric.strategies import DDPStrategy

from litft.launch.cluster import process_group_timeout
from litft.parallel.strategies.base import TrainingStrategy


class SingleDevice(TrainingStrategy):
    name = "one device"

    def fabric_strategy(self):
        return "auto"



class DDP(TrainingStrategy):
    """Gradients are averaged across ranks in the backward of the last micro-batch of a step."""

    name = "DDP"

    def fabric_strategy(self):
        # A vision-language model's projector gets no gradient from a micro-batch without images (text records beside image ones).
        return DDPStrategy(process_group_backend=self.backend, timeout=process_group_timeout(), find_unused_parameters=self.idle_parameters)

