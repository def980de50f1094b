"""Option groups shared by every job; their attribute docstrings are the ``--help`` text."""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional


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
    stop_after_steps: Optional[int] = None
    """End this launch after this many steps with a checkpoint, as a stop signal does (for queues whose time limit is shorter than the run: each job continues with --resume auto)."""
    log_interval: int = 1
    """Log metrics every this many optimizer steps."""
    save_interval: Optional[int] = 1000
    """Write a resumable checkpoint to out_dir/checkpoints every this many optimizer steps (one is always written at the end; null: only then)."""
    keep_checkpoints: int = 2
    """Finished checkpoints kept in out_dir/checkpoints; older ones are deleted once a newer one is complete."""
    peak_tflops: Optional[float] = None
    """Dense peak TFLOP/s of one device at the run's precision, for MFU (default: litft/flops.py's table for known GPUs; none for the CPU)."""
    record_sample_ids: bool = False
    """Each rank writes the indices of the samples it trained on, per step, to out_dir/logs/samples/rank-N.jsonl (to audit data order across resumes)."""


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


@dataclass
class FSDPArgs:
    """How --strategy fsdp shards the model (FSDP2: one shard unit per transformer block, then the root)."""

    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"] = "HYBRID_SHARD"
    """FULL_SHARD: shard over every rank; SHARD_GRAD_OP: also keep gathered weights from forward to backward; HYBRID_SHARD: shard inside a group, replicate across groups; NO_SHARD: replicate (like DDP)."""
    shard_size: Optional[int] = None
    """HYBRID_SHARD: ranks that share one sharded copy of the model (default: --devices, i.e. one node)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer states in CPU memory between uses (GPU only)."""


@dataclass
class DeepSpeedArgs:
    """How --strategy deepspeed partitions the training state (DeepSpeed ZeRO)."""

    stage: Literal[0, 1, 2, 3] = 2
    """ZeRO stage: 0 replicates everything, 1 partitions optimizer states, 2 also gradients, 3 also parameters."""
    offload_optimizer: Optional[Literal["cpu", "nvme"]] = None
    """Move optimizer states (and the step) to CPU memory or NVMe (stage 1 and up)."""
    offload_parameters: Optional[Literal["cpu", "nvme"]] = None
    """Move partitioned parameters to CPU memory or NVMe (stage 3 only)."""
    nvme_path: Path = Path("/local_nvme")
    """Folder on a fast local disk for nvme offload."""
    config: Optional[Path] = None
    """A DeepSpeed JSON config; its "auto" values are filled from litft's flags (batch sizes, clipping, precision)."""
