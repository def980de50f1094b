"""The flag groups of a run: typed, each with ``--help`` text in its attribute docstrings, each checking itself.

Every group is built once from the command line (or a YAML file) and checked
before any process starts or any file is touched; the jobs and ``litft
estimate`` build the same groups and run the same checks.
"""

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import List, Literal, Optional, Tuple, Union

from litft.errors import LitftError

Precision = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed"]
Accelerator = Literal["auto", "cpu", "cuda", "gpu"]
StrategyName = Literal["auto", "ddp", "fsdp", "deepspeed"]
Quantize = Literal["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq"]
STRATEGY_NAMES = ("auto", "ddp", "fsdp", "deepspeed")
QUANTIZE_CHOICES = ("bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq")
EXPORT_CHOICES = ("adapter", "merged", "both", "none")
DEFAULT_GLOBAL_BATCH_SIZE = 32


def at_least(value: Optional[float], minimum: float, flag: str, nullable: str = "") -> None:
    """One line for a flag below its minimum (or not a finite number); ``nullable`` says what null means, where null is allowed."""
    if value is not None and not (value >= minimum and math.isfinite(value)):
        raise LitftError(f"{flag} must be at least {minimum}{f' (or null {nullable})' if nullable else ''}, got {value}")


def positive(value: Optional[float], flag: str, what: str = "", nullable: str = "") -> None:
    """One line for a flag that must be a finite number above zero; ``what`` says what it is."""
    if value is not None and not (value > 0 and math.isfinite(value)):
        detail = f" ({what})" if what else ""
        raise LitftError(f"{flag} must be positive{detail}{f' or null {nullable}' if nullable else ''}, got {value}")


def fraction(value: float, flag: str, what: str) -> None:
    """One line for a flag that must lie in [0, 1)."""
    if not 0 <= value < 1:
        raise LitftError(f"{flag} is {what} in [0, 1), got {value}")


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

    def check(self, instruction_data: bool) -> None:
        at_least(self.interval, 0, "--eval.interval")
        at_least(self.max_batches, 1, "--eval.max_batches", "for all of the validation data")
        at_least(self.score_samples, 0, "--eval.score_samples")
        at_least(self.max_new_tokens, 1, "--eval.max_new_tokens")
        if self.score_samples and not instruction_data:
            raise LitftError("--eval.score_samples needs instruction data (prompts with answers); set it to 0 for plain text")


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
    dropout: float = 0.05
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


OBJECTIVES = ("sft", "dpo", "ipo", "simpo", "orpo", "grpo")
# Each objective's beta where --objective.beta is left out: DPO's and IPO's papers' 0.1, SimPO's 2.0, ORPO's lambda 0.1,
# GRPO's KL weight 0 (DAPO and Dr. GRPO train without the KL term).
DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0, "orpo": 0.1, "grpo": 0.0}


@dataclass
class ObjectiveArgs:
    """What a fine-tuning step optimizes: the next-token loss (sft) or a preference objective on chosen/rejected pairs."""

    name: Literal["sft", "dpo", "ipo", "simpo", "orpo", "grpo"] = "sft"
    """sft: cross-entropy of the response tokens; dpo, ipo: against a reference model; simpo, orpo: reference-free; grpo: online RL from rewards on sampled completions (also --objective NAME)."""
    beta: Optional[float] = None
    """Strength of the preference term: DPO/IPO's beta (default 0.1), SimPO's beta (2.0), ORPO's lambda on the odds-ratio term (0.1); GRPO's KL weight (0)."""
    label_smoothing: float = 0.0
    """DPO and SimPO: the assumed share of pairs whose labels are flipped (conservative DPO); 0 for the plain loss."""
    gamma: float = 0.5
    """SimPO: the target reward margin subtracted from beta times the difference of mean log-probs."""
    precompute_reference: Optional[bool] = None
    """DPO/IPO: score every pair with the initial model once before training and keep only those log-probs (stored with the checkpoints); default: true for finetune_full, false under LoRA (the reference is the base with the adapter switched off)."""
    group_size: int = 8
    """GRPO: completions sampled per prompt (a step's global batch counts prompts)."""
    max_new_tokens: int = 256
    """GRPO: the longest completion; longer ones are cut there (their share is logged)."""
    generation_batch: Optional[int] = None
    """GRPO: prompts sampled together in one batched generate call (their groups left-padded into one batch). Rollouts depend on it, never on the rank layout; it must divide each rank's share of prompts. Default: the largest of 16, 8, 4, 2, 1 that divides it (set it to compare runs on different layouts)."""
    temperature: float = 1.0
    """GRPO: sampling temperature of the rollouts."""
    top_p: float = 1.0
    """GRPO: sample from the fewest tokens whose probabilities add up to top_p."""
    rewards: str = "exact_match"
    """GRPO: comma-separated reward functions, module:function or path/to/file.py:function (TRL's signature: fn(prompts, completions, completion_ids, **columns) -> list of float or None), or the built-ins exact_match and format."""
    reward_weights: Optional[List[float]] = None
    """GRPO: one weight per reward function (default: 1 each)."""
    format_pattern: str = r"^.+$"
    """GRPO: the regular expression the built-in format reward asks each whole completion to match."""
    answer_pattern: Optional[str] = None
    """GRPO: a regular expression whose first group is the answer in a completion (its last match), for the built-in exact_match; the answer column is read through it too where it matches (GSM8K's "#### 72"). Default: the whole completion."""
    loss_norm: Literal["token", "sequence", "constant"] = "token"
    """GRPO: token (DAPO: every completion token of the global batch weighs alike), sequence (GRPO: each completion's token mean, then the mean of completions), constant (Dr. GRPO: summed per completion over max_new_tokens)."""
    scale_advantages: Literal["group", "batch", "none"] = "group"
    """GRPO: divide each advantage (reward minus its group's mean) by its group's reward std (GRPO), the global batch's (as LitePPO), or nothing (Dr. GRPO)."""
    epsilon: float = 0.2
    """GRPO: the clip range below 1 of the probability ratio."""
    epsilon_high: Optional[float] = None
    """GRPO: the clip range above 1 (DAPO's clip-higher: 0.28); default: epsilon."""
    iterations: int = 1
    """GRPO: optimizer steps per batch of rollouts (mu); above 1 the rollouts' log-probs under the sampling policy are kept as the ratio's denominator."""
    importance: Literal["token", "sequence"] = "token"
    """GRPO: the probability ratio per token (GRPO, DAPO) or per completion from its mean log-prob ratio (GSPO)."""

    @classmethod
    def of(cls, value) -> "ObjectiveArgs":
        """The group as flags or Python give it: the group itself, a bare name (``objective="dpo"``), or nothing (sft)."""
        return cls(name=value) if isinstance(value, str) else value or cls()

    @property
    def preference(self) -> bool:
        return self.name in ("dpo", "ipo", "simpo", "orpo")

    @property
    def rl(self) -> bool:
        return self.name == "grpo"

    @property
    def uses_reference(self) -> bool:
        return self.name in ("dpo", "ipo")

    @property
    def effective_beta(self) -> float:
        return DEFAULT_BETA[self.name] if self.beta is None else self.beta

    def check(self, lora: bool) -> None:
        if self.name not in OBJECTIVES:
            raise LitftError(f"--objective {self.name} is unknown; choose one of {', '.join(OBJECTIVES)}")
        if not self.rl:
            positive(self.beta, "--objective.beta", "the strength of the preference term", nullable="for the objective's default")
        if not 0 <= self.label_smoothing < 0.5:
            raise LitftError(f"--objective.label_smoothing is the share of flipped labels in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.name not in ("dpo", "simpo"):
            raise LitftError(f"--objective.label_smoothing applies to dpo and simpo, not {self.name}; drop it")
        if not math.isfinite(self.gamma):
            raise LitftError(f"--objective.gamma must be a finite number, got {self.gamma}")
        if self.precompute_reference and not self.uses_reference:
            raise LitftError(f"--objective {self.name} uses no reference model; drop --objective.precompute_reference")
        if self.rl:
            self.check_rl(lora)
        if self.uses_reference and not lora and self.precompute_reference is False:
            raise LitftError(
                f"--objective {self.name} under finetune_full takes its reference log-probs from a scoring pass before training "
                "(a frozen second copy of the model is not built); drop --objective.precompute_reference false"
            )

    def check_rl(self, lora: bool) -> None:
        at_least(self.group_size, 2, "--objective.group_size", "")
        at_least(self.max_new_tokens, 1, "--objective.max_new_tokens")
        at_least(self.iterations, 1, "--objective.iterations")
        if self.generation_batch is not None:
            at_least(self.generation_batch, 1, "--objective.generation_batch")
        positive(self.temperature, "--objective.temperature", "the sampling temperature")
        if not 0 < self.top_p <= 1:
            raise LitftError(f"--objective.top_p is a probability mass in (0, 1], got {self.top_p}")
        for flag, value in (("--objective.epsilon", self.epsilon), ("--objective.epsilon_high", self.epsilon_high)):
            if value is not None and not (0 < value and math.isfinite(value)):
                raise LitftError(f"{flag} is a clip range above 0, got {value}")
        if self.epsilon >= 1:
            raise LitftError(f"--objective.epsilon clips the ratio at 1 - epsilon, which must stay above 0; got {self.epsilon}")
        names = [n for n in self.rewards.split(",") if n.strip()]
        if not names:
            raise LitftError("--objective.rewards names no reward function; give module:function or exact_match / format")
        if self.reward_weights is not None and len(self.reward_weights) != len(names):
            raise LitftError(f"--objective.reward_weights has {len(self.reward_weights)} weights for {len(names)} reward functions; give one each")
        for flag, pattern in (("--objective.format_pattern", self.format_pattern), ("--objective.answer_pattern", self.answer_pattern)):
            try:
                re.compile(pattern or "")
            except re.error as err:
                raise LitftError(f"{flag} {pattern!r} is not a regular expression ({err})") from None
        if self.effective_beta < 0:
            raise LitftError(f"--objective.beta is the KL weight, at least 0, got {self.beta}")
        if self.effective_beta > 0 and not lora:
            raise LitftError("--objective grpo with --objective.beta above 0 needs a reference model: under finetune_lora it is the base with "
                             "the adapter off; finetune_full keeps no frozen copy yet; use finetune_lora or --objective.beta 0")

    def reference_precomputed(self, lora: bool) -> bool:
        """Whether the reference log-probs come from a pass before training (else from the base with the adapter off)."""
        if not self.uses_reference:
            return False
        return not lora if self.precompute_reference is None else self.precompute_reference


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
