"""The flag groups of a run: typed, each with ``--help`` text in its attribute docstrings, each checking itself.

Every group is built once from the command line (or a YAML file) and checked
before any process starts or any file is touched; the jobs and ``litft
estimate`` build the same groups and run the same checks.
"""

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import List, Literal, Optional, Tuple, Union

from litft.errors import LitftError
from litft.flag_checks import at_least, fraction, positive

Precision = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed"]
Accelerator = Literal["auto", "cpu", "cuda", "gpu"]
StrategyName = Literal["auto", "ddp", "fsdp", "deepspeed"]
Quantize = Literal["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq"]
STRATEGY_NAMES = ("auto", "ddp", "fsdp", "deepspeed")
QUANTIZE_CHOICES = ("bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq")
EXPORT_CHOICES = ("adapter", "merged", "both", "none")
VISION_ENCODER_CHOICES = ("frozen", "trained")  # a vision-language model's image encoder (litft.model.vision)
DEFAULT_GLOBAL_BATCH_SIZE = 32


@dataclass
class TrainArgs:
    """What the training loop does: batch, schedule, length of the run."""

    global_batch_size: Optional[int] = None
    """Samples per optimizer step, summed over every rank and accumulation step (default: 32, rounded up to a multiple of micro_batch_size x world size)."""
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
    activation_offload: bool = False
    """Keep what the forward saves for the backward in host memory, copied out and back on a side stream while the GPU computes (with gradient_checkpointing: only each block's input). Exact; costs host memory and PCIe time the compute usually hides."""
    tiled_mlp: bool = False
    """Run each dense MLP over the sequence in chunks of hidden_size tokens, each recomputed in the backward, so a long sequence never holds its whole MLP intermediate (ALST's tiled MLP). Exact up to float rounding; a third more MLP compute."""
    vision_encoder: str = "frozen"
    """A vision-language model's image encoder: frozen (the projector and language model learn; LoRA adapts the language model) or trained (full fine-tuning trains it, LoRA adapts its linear layers too)."""
    stop_after_steps: Optional[int] = None
    """End this launch after this many steps with a checkpoint, as a stop signal does (for queues whose time limit is shorter than the run: each job continues with --resume auto)."""
    log_interval: int = 1
    """Log metrics every this many optimizer steps."""
    save_interval: Optional[int] = 1000
    """Write a resumable checkpoint to out_dir/checkpoints every this many optimizer steps (one is always written at the end; null: only then)."""
    keep_checkpoints: int = 2
    """Finished checkpoints kept in out_dir/checkpoints; older ones are deleted once a newer one is complete."""
    async_save: bool = False
    """Write checkpoints in the background: each rank copies its part to host memory and trains on while a thread writes it (one more host copy of a rank's training state; a checkpoint counts once complete, the run's last is waited for)."""
    peak_tflops: Optional[float] = None
    """Dense peak TFLOP/s of one device at the run's precision, for MFU (default: litft/model/flops.py's table for known GPUs; none for the CPU)."""
    record_sample_ids: bool = False
    """Each rank writes the indices of the samples it trained on, per step, to out_dir/logs/samples/rank-N.jsonl (to audit data order across resumes)."""

    def resolved(self, world_size: int) -> Tuple["TrainArgs", Optional[str]]:
        """These args with the global batch set where the user left it out, and a line saying so when it is not the default."""
        if self.global_batch_size is not None:
            return self, None
        unit = self.micro_batch_size * world_size
        chosen = max(unit, -(-DEFAULT_GLOBAL_BATCH_SIZE // unit) * unit)
        note = None
        if chosen != DEFAULT_GLOBAL_BATCH_SIZE:
            note = (
                f"global batch {chosen} samples (--train.global_batch_size not given; the default {DEFAULT_GLOBAL_BATCH_SIZE} rounded up "
                f"to a multiple of micro batch {self.micro_batch_size} x {world_size} ranks)"
            )
        return replace(self, global_batch_size=chosen), note

    def check(self, world_size: int) -> None:
        if self.micro_batch_size < 1 or (self.global_batch_size is not None and self.global_batch_size < 1):
            raise LitftError("--train.global_batch_size and --train.micro_batch_size must be at least 1")
        if self.global_batch_size % (self.micro_batch_size * world_size):
            raise LitftError(
                f"--train.global_batch_size {self.global_batch_size} is not divisible by micro_batch_size x world size "
                f"({self.micro_batch_size} x {world_size} = {self.micro_batch_size * world_size}); change one of them"
            )
        for name in ("epochs", "max_steps", "max_tokens", "stop_after_steps"):
            at_least(getattr(self, name), 1, f"--train.{name}", "for no limit")
        at_least(self.log_interval, 1, "--train.log_interval")
        at_least(self.save_interval, 1, "--train.save_interval", "to save only at the end")
        at_least(self.keep_checkpoints, 1, "--train.keep_checkpoints")
        at_least(self.warmup_steps, 0, "--train.warmup_steps")
        positive(self.learning_rate, "--train.learning_rate", "the peak of the schedule")
        at_least(self.min_lr, 0, "--train.min_lr")
        if self.min_lr > self.learning_rate:
            raise LitftError(f"--train.min_lr {self.min_lr} is above --train.learning_rate {self.learning_rate}; the schedule decays to it")
        at_least(self.weight_decay, 0, "--train.weight_decay")
        fraction(self.beta1, "--train.beta1", "AdamW's decay rate of the gradient mean,")
        fraction(self.beta2, "--train.beta2", "AdamW's decay rate of the squared gradients,")
        positive(self.max_norm, "--train.max_norm", "the largest gradient norm", nullable="for no clipping")
        positive(self.peak_tflops, "--train.peak_tflops", "one device's dense peak at the run's precision")
        if self.vision_encoder not in VISION_ENCODER_CHOICES:
            raise LitftError(f"--train.vision_encoder {self.vision_encoder} is unknown; choose {' or '.join(VISION_ENCODER_CHOICES)}")


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
    tasks: Optional[str] = None
    """Comma-separated lm-evaluation-harness tasks run at each validation and the final one, on the weights being trained (metrics.csv's lm_eval/<task>/<metric>; pip install 'litft[eval]')."""
    include_path: Optional[str] = None
    """A folder of lm-eval task YAML files of your own, for --eval.tasks."""
    task_limit: Optional[float] = None
    """Documents per task at each validation (a number, or a share below 1); all of them where left out."""

    def check(self) -> None:
        if self.tasks is not None and not [t for t in self.tasks.split(",") if t.strip()]:
            raise LitftError("--eval.tasks names no task; give lm-eval tasks, e.g. --eval.tasks hellaswag,arc_easy, or leave it out")
        if self.task_limit is not None and not self.task_limit > 0:
            raise LitftError(f"--eval.task_limit must be above 0, got {self.task_limit}")
        at_least(self.interval, 0, "--eval.interval")
        at_least(self.max_batches, 1, "--eval.max_batches", "for all of the validation data")
        at_least(self.score_samples, 0, "--eval.score_samples")
        at_least(self.max_new_tokens, 1, "--eval.max_new_tokens")


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


@dataclass
class LoraArgs:
    """LoRA adapters on a frozen base, and QLoRA's 4-bit base: one group, however the flags were given."""

    r: int = 8
    alpha: float = 16
    dropout: float = 0.0  # peft's default; why: describe_lora_dropout in litft/run/plan.py
    target_modules: Union[str, List[str]] = "all-linear"
    quantize: Optional[str] = None
    export: str = "adapter"  # what the end of the run writes: the adapter (peft), the merged model, both or none

    @property
    def writes_adapter(self) -> bool:
        return self.export in ("adapter", "both")

    @property
    def writes_merged(self) -> bool:
        return self.export in ("merged", "both")

    def check(self) -> None:
        at_least(self.r, 1, "--lora_r")
        positive(self.alpha, "--lora_alpha", "the update is scaled by alpha / r")
        fraction(self.dropout, "--lora_dropout", "a probability")
        if self.quantize is not None and self.quantize not in QUANTIZE_CHOICES:
            raise LitftError(f"--quantize {self.quantize} is unknown; choose one of {', '.join(QUANTIZE_CHOICES)}")
        if not self.target_modules:
            raise LitftError("--lora_target_modules names no module; give module names or all-linear")
        if self.export not in EXPORT_CHOICES:
            raise LitftError(f"--export {self.export} is unknown; choose one of {', '.join(EXPORT_CHOICES)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    @property
    def targets(self) -> Union[str, List[str]]:
        return self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)


@dataclass
class Layout:
    """Where a run's processes are and how they share the model: the strategy and its option groups."""

    strategy: str = "auto"
    devices: int = 1
    num_nodes: int = 1
    fsdp: FSDPArgs = field(default_factory=FSDPArgs)
    deepspeed: DeepSpeedArgs = field(default_factory=DeepSpeedArgs)
    context_parallel: int = 1  # ranks that split each sequence between them (litft.parallel.context)
    tensor_parallel: int = 1  # ranks that split each block's weights between them (litft.parallel.tensor)
    expert_parallel: int = 1  # ranks that deal each MoE layer's experts out between them (litft.parallel.expert)

    @classmethod
    def of(cls, flags: dict) -> "Layout":
        """The layout a command's flat flags give (a job's, or litft estimate's)."""
        return cls(
            flags["strategy"], flags["devices"], flags["num_nodes"], flags["fsdp"], flags["deepspeed"], flags["context_parallel"],
            flags["tensor_parallel"], flags["expert_parallel"],
        )

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    def check(self) -> None:
        """The flags' own ranges; the mesh (litft.parallel.mesh) and the chosen strategy check the rest (``strategies.checked_strategy_class``)."""
        at_least(self.devices, 1, "--devices")
        at_least(self.num_nodes, 1, "--num_nodes")
        at_least(self.fsdp.shard_size, 1, "--fsdp.shard_size", "for one node")
        at_least(self.context_parallel, 1, "--context_parallel")
        at_least(self.tensor_parallel, 1, "--tensor_parallel")
        if self.context_parallel > 1 and self.tensor_parallel > 1:
            raise LitftError("--context_parallel and --tensor_parallel together are not supported yet; choose one of them")
        at_least(self.expert_parallel, 1, "--expert_parallel")
        if self.expert_parallel > 1 and self.tensor_parallel > 1:
            raise LitftError("--expert_parallel and --tensor_parallel together are not supported yet; choose one of them")
        if self.strategy not in STRATEGY_NAMES:
            raise LitftError(f"--strategy {self.strategy} is unknown; choose one of {', '.join(STRATEGY_NAMES)}")

    def options(self, group: str):
        """The option group of that name (``fsdp``, ``deepspeed``), as the user gave it."""
        return getattr(self, group)
