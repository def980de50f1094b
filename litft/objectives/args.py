"""``--objective``'s flag group: what a fine-tuning step optimizes, and each family's own flags, checked in one line each."""

import math
import re
from dataclasses import dataclass
from typing import List, Literal, Optional

from litft.errors import LitftError
from litft.flag_checks import at_least, positive


OBJECTIVES = ("sft", "dpo", "ipo", "simpo", "orpo", "grpo")
# Each objective's beta where --objective.beta is left out: DPO's and IPO's papers' 0.1, SimPO's 2.0, ORPO's lambda 0.1,
# GRPO's KL weight 0 (DAPO and Dr. GRPO train without the KL term).
DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0, "orpo": 0.1, "grpo": 0.0}


@dataclass
class ObjectiveArgs:
    """What a fine-tuning step optimizes: the next-token loss (sft), a preference objective on chosen/rejected pairs (dpo, ipo, simpo, orpo), or RL from rewards on sampled completions (grpo)."""

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
    """GRPO: prompts sampled together in one batched generate call (their groups left-padded into one batch): more is faster and holds a larger KV cache. Each completion draws from noise of its own, so rollouts depend on neither this nor the rank layout. It must divide each rank's share of prompts. Default: the largest of 16, 8, 4, 2, 1 that divides it."""
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
    engine: Literal["auto", "transformers", "vllm"] = "auto"
    """GRPO: what samples the rollouts: transformers' generate on the trained weights, or vLLM inside each rank's process with the weights pushed after every step; auto: vLLM on a GPU where it is installed, else transformers."""
    vllm_memory: float = 0.3
    """GRPO with --objective.engine vllm on a GPU: the share of the device's memory vLLM takes for its weights and KV cache (vLLM's gpu_memory_utilization); it sleeps between rollouts, giving it back to training."""
    is_cap: float = 2.0
    """GRPO with an engine apart from the trained module (vllm): each token's loss is weighed by the ratio of the trainer's probability to the engine's, capped at this (truncated importance sampling, TRL's vllm_importance_sampling_cap)."""
    disable_dropout: bool = True
    """GRPO: set every dropout of the model and of LoRA's adapters to 0 (TRL's disable_dropout), so that the loss trains the policy that sampled; rollouts are sampled in eval mode either way."""

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
        return DEFAULT_BETA.get(self.name, 0.0) if self.beta is None else self.beta

    def check(self) -> None:
        """The group's own values, alone and with one another (what they combine with elsewhere: litft.run.plan)."""
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
            self.check_rl()

    def check_rl(self) -> None:
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
        if not 0 < self.vllm_memory < 1:
            raise LitftError(f"--objective.vllm_memory is a share of the device's memory in (0, 1), got {self.vllm_memory}")
        if not (self.is_cap >= 1 and math.isfinite(self.is_cap)):
            raise LitftError(f"--objective.is_cap caps an importance ratio and must be at least 1, got {self.is_cap}")

    def reference_precomputed(self, lora: bool) -> bool:
        """Whether the reference log-probs come from a pass before training (else from the base with the adapter off)."""
        if not self.uses_reference:
            return False
        return not lora if self.precompute_reference is None else self.precompute_reference
