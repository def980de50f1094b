"""The words ``litft estimate`` and the strategies share to describe what a rank holds.

Each strategy lays the model's tensors (:class:`Param`) out on the fullest rank as
:class:`States`; the estimate adds activations and renders them.
"""

import math
from dataclasses import dataclass, field
from typing import List, Tuple

GiB = 2**30


@dataclass
class Param:
    """One parameter as the estimate needs it; ``itemsize`` is 0.5 for a packed 4-bit weight."""

    name: str
    shape: Tuple[int, ...]
    itemsize: float
    trainable: bool
    unit: str  # the part of the model holding it: "block.<i>", untied "embeddings" or "head", or "root"
    quantized: bool = False
    quant_state: int = 0  # bytes of absmax (and nested quantization) beside a 4-bit weight

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return math.ceil(self.numel * self.itemsize)


@dataclass
class Row:
    """One line of the estimate: bytes on the GPU and in CPU memory, and what they are."""

    gpu: float = 0
    cpu: float = 0
    note: str = ""

    def moved_to_cpu(self, note: str) -> "Row":
        return Row(0, self.gpu + self.cpu, note)


@dataclass
class States:
    """Parameters, gradients and optimizer states on the fullest rank, and the strategy's own buffers."""

    params: Row
    grads: Row
    optimizer: Row
    buffers: List[Tuple[str, Row]] = field(default_factory=list)
    step: Row = field(default_factory=Row)  # temporaries of the optimizer step, when activations are gone
