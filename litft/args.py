"""Option groups shared by every job; their attribute docstrings are the ``--help`` text."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class TrainArgs:
    """What the training loop does: batch, schedule, length of the run."""

    global_batch_size: int = 16
    """Samples per optimizer step, summed over every rank and accumulation step."""
    micro_batch_size: int = 4
    """Samples in one forward/backward pass on one rank; accumulation makes up the rest."""
    epochs: Optional[int] = None
    """Passes over the training data; the run stops at the first limit set (one epoch when none is)."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps."""
    max_tokens: Optional[int] = None
    """Stop once this many input tokens (all ranks together) have been trained on."""
    learning_rate: float = 3e-4
    """Peak learning rate of AdamW, reached after warmup."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 10
    """Steps of linear warmup from 0 to learning_rate."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    max_norm: Optional[float] = 1.0
    """Clip the global gradient norm to this value (None: no clipping)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    log_interval: int = 1
    """Log metrics every this many optimizer steps."""


@dataclass
class EvalArgs:
    """When and how much the loop validates."""

    interval: int = 100
    """Validate every this many optimizer steps (0: only at the start and end)."""
    max_batches: Optional[int] = None
    """Micro-batches of validation data per rank at each validation (None: all of it)."""
    initial_validation: bool = True
    """Validate before the first step, so the log shows where training started."""
    final_validation: bool = True
    """Validate after the last step."""
    score_samples: int = 0
    """Validation prompts answered by greedy generation and scored by exact match, at start and end (0: off; instruction data only)."""
    max_new_tokens: int = 32
    """Longest answer generated when scoring."""
