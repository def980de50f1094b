"""Online RL from rewards: GRPO and its variants (DAPO, Dr. GRPO, GSPO) on the one loop, as flags of one objective.

Each step takes a global batch of prompts, samples ``group_size`` completions of each with
the policy as it is (litft.rl.rollouts), scores them with the reward functions, and trains on
the completions' tokens with the clipped policy-gradient loss. With A_i the advantage of
completion i, r the probability ratio between the policy and the one that sampled (1 at
the first of ``iterations`` steps on a batch of rollouts), and k3 the KL estimate against
the reference (the base with the adapter off):

    advantage   A_i = r_i - mean(group)                   (Dr. GRPO: scale none)
                A_i = (r_i - mean(group)) / std(group)    (GRPO: scale group; batch: the global batch's std)
    ratio       token: r_t = exp(logp_t - old_t)           sequence (GSPO): s_i = exp(mean_t(logp_t - old_t)) for each token of i
    token loss  l_t = -min(r A, clip(r, 1 - eps, 1 + eps_high) A) + beta * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)
    the sum     token (DAPO): sum_t l_t over the completion tokens of the global batch
                sequence (GRPO): sum_i mean_t l_t over its completions
                constant (Dr. GRPO): sum_t l_t / max_new_tokens over its completions

The loop divides the sum by ``count`` over the whole global batch (tokens, or completions),
so a step is the same however prompts and completions are split over ranks and micro-batches.
"""

import math
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from litft.objectives.args import ObjectiveArgs
from litft.errors import LitftError
from litft.objectives.base import Objective, sums_per_sequence
from litft.rl.rewards import load_rewards
from litft.rl.rollouts import RolloutBatches, held_out_reward

ROLLOUT_STATS = ("rollout_steps", "prompts", "completions", "completion_tokens", "cut", "equal_groups", "entropy", "generation_s",
                 "reward", "reward_sq")
LOSS_STATS = ("loss_tokens", "clipped_tokens", "kl", "ratio", "logprob_gap", "gap_tokens", "is_ratio", "is_capped", "is_tokens")


def token_losses(logp: torch.Tensor, old: torch.Tensor, advantage: torch.Tensor, sequence: torch.Tensor, sequences: int, args: ObjectiveArgs,
                 reference: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each completion token's loss, whether its clip was active, and the ratio it used; ``sequence``: its completion's index."""
    low, high = args.epsilon, args.epsilon_high if args.epsilon_high is not None else args.epsilon
    token_advantage = advantage[sequence]
    if args.importance == "sequence":  # GSPO: one ratio per completion, from the mean of its tokens' log-ratios
        sums, lengths = sums_per_sequence(logp - old, sequence, sequences)
        ratio = torch.exp(sums / lengths.clamp(min=1))[sequence]
    else:
        ratio = torch.exp(logp - old)
    clipped = ratio.clamp(1 - low, 1 + high)
    losses = -torch.minimum(ratio * token_advantage, clipped * token_advantage)
    active = ((ratio < 1 - low) & (token_advantage < 0)) | ((ratio > 1 + high) & (token_advantage > 0))
    if reference is not None:
        delta = reference - logp
        losses = losses + args.effective_beta * (torch.exp(delta) - delta - 1)
    return losses, active, ratio


def loss_sum_of(losses: torch.Tensor, sequence: torch.Tensor, sequences: int, norm: str, max_new_tokens: int) -> torch.Tensor:
    """The micro-batch's share of the step's loss, as ``norm`` weighs tokens (the loop divides by ``count``)."""
    if norm == "token":
        return losses.sum()
    if norm == "constant":
        return losses.sum() / max_new_tokens
    sums, lengths = sums_per_sequence(losses, sequence, sequences)
    return (sums / lengths.clamp(min=1)).sum()


class GroupRelative(Objective):
    """GRPO and its variants: rollouts of each prompt's group, their rewards' advantages, the clipped ratio loss."""

    unit = "prompts"
    progress = (("reward", "reward_mean", ".3f"), ("len", "completion_length", ".0f"))
    generates = True  # the batches are sampled by the model as it trains (litft.rl.rollouts)

    def __init__(self, args: ObjectiveArgs, lora: bool):
        super().__init__(args, lora)
        self.name = args.name
        self.rewards = load_rewards(args.rewards, args.format_pattern, args.answer_pattern)
        self.weights = list(args.reward_weights or [1.0] * len(self.rewards))
        self.stats = ROLLOUT_STATS + tuple(f"{n}/{s}" for n in self.rewards for s in ("sum", "sq", "count")) + LOSS_STATS
        self.uses_reference = args.effective_beta > 0
        self.reference_forwards = int(self.uses_reference) + int(args.iterations > 1)  # KL's reference, the sampler's log-probs
        self.steps_per_batch = args.iterations

    @classmethod
    def default_data(cls):
        from litft.data.prompts import TinyPrompts

        return TinyPrompts()

    @classmethod
    def check_data(cls, args: ObjectiveArgs, data) -> None:
        from litft.data.prompts import PromptData

        if not isinstance(data, PromptData):
            raise LitftError(f"--objective {args.name} samples completions of prompts; give --data Prompts (prompt records) or TinyPrompts, "
                             f"not {type(data).__name__}")

    def count(self, batch: dict) -> int:
        return len(batch["targets"]["index"]) if self.args.loss_norm == "token" else len(batch["advantage"])

    def figure_vector(self, device, **values) -> torch.Tensor:
        vector = torch.zeros(len(self.stats), dtype=torch.float64, device=device)
        for name, value in values.items():
            vector[self.stats.index(name)] = value
        return vector

    def add_figures(self, device, **values) -> None:
        """Sums toward the next log step's figures (``stats`` by name): the rollouts' rewards and lengths, the loss's own."""
        self.pending.append(self.figure_vector(device, **values))

    def loss_sum(self, lm, batch: dict) -> torch.Tensor:
        targets, temperature = batch["targets"], self.args.temperature
        # Every log-prob at the sampling temperature: the policy that sampled is softmax(logits / T) (TRL and verl alike).
        logp, aux = lm.token_log_probs(batch, temperature)
        logp = logp.float()
        first = "old_logp" not in batch  # one step per batch of rollouts: this forward is the first on them
        old = logp.detach() if first else batch["old_logp"].float()
        reference = None
        if self.uses_reference:
            with torch.no_grad(), lm.model.disable_adapter():
                reference = lm.token_log_probs(batch, temperature)[0].float()
        sequences = len(batch["advantage"])
        losses, active, ratio = token_losses(logp, old, batch["advantage"].float(), targets["sequence"], sequences, self.args, reference)
        correction = {}
        if batch.get("engine_apart", False):  # sampled by another module (vLLM): weigh each token by policy / sampler, capped
            raw = torch.exp(old.detach() - batch["engine_logp"].float())
            weight = raw.clamp(max=self.args.is_cap)
            losses = losses * weight
            with torch.no_grad():
                correction = dict(is_ratio=raw.double().sum(), is_capped=(raw > self.args.is_cap).double().sum(), is_tokens=float(len(raw)))
                self.maxima.append(raw.max() if len(raw) else torch.zeros((), device=raw.device))
        with torch.no_grad():
            kl = torch.zeros((), device=logp.device) if reference is None else (torch.exp(reference - logp) - (reference - logp) - 1).sum()
            gap = {}
            if first and "engine_logp" in batch:  # with iterations above 1, litft.rl.rollouts compares the sampler's log-probs instead
                gap = dict(logprob_gap=(batch["engine_logp"].float() - old).abs().double().sum(), gap_tokens=float(len(old)))
            self.add_figures(logp.device, loss_tokens=float(len(logp)), clipped_tokens=active.double().sum(), kl=kl.double(),
                             ratio=ratio.double().sum(), **gap, **correction)
        loss = loss_sum_of(losses, targets["sequence"], sequences, self.args.loss_norm, self.args.max_new_tokens)
        return lm.with_router_aux(loss, aux, self.count(batch))

    def figures(self, summed: torch.Tensor, prefix: str = "", maxima: Optional[torch.Tensor] = None) -> Dict[str, float]:
        value = dict(zip(self.stats, summed.tolist()))
        out = {}
        completions = value["completions"]
        if completions:
            mean = value["reward"] / completions
            out.update(reward_mean=mean, reward_std=math.sqrt(max(value["reward_sq"] / completions - mean * mean, 0.0)),
                       completion_length=value["completion_tokens"] / completions, cut_share=value["cut"] / completions,
                       equal_reward_groups=value["equal_groups"] / max(value["prompts"], 1),
                       entropy=value["entropy"] / max(value["completion_tokens"], 1))
            steps = max(value["rollout_steps"], 1)
            out.update(generation_s=value["generation_s"] / steps,
                       generation_tokens_per_s=value["completion_tokens"] / max(value["generation_s"], 1e-9))
            for name in self.rewards:
                n = value[f"{name}/count"]
                if n:
                    fn_mean = value[f"{name}/sum"] / n
                    out[f"reward/{name}_mean"] = fn_mean
                    out[f"reward/{name}_std"] = math.sqrt(max(value[f"{name}/sq"] / n - fn_mean * fn_mean, 0.0))
        if value["loss_tokens"]:
            out.update(clip_fraction=value["clipped_tokens"] / value["loss_tokens"], ratio_mean=value["ratio"] / value["loss_tokens"])
            if self.uses_reference:
                out["kl"] = value["kl"] / value["loss_tokens"]
        if value["gap_tokens"]:
            out["sampler_logprob_gap"] = value["logprob_gap"] / value["gap_tokens"]
        if value["is_tokens"]:
            out.update(is_ratio_mean=value["is_ratio"] / value["is_tokens"], is_capped_share=value["is_capped"] / value["is_tokens"])
            if maxima is not None:
                out["is_ratio_max"] = float(maxima[0])
        return {f"{prefix}{k}": v for k, v in out.items()}

    def validation_figures(self, val_loss: float, summed: Optional[torch.Tensor]) -> Dict[str, float]:
        return {}

    def window_times(self, window_s: float, batches_s: float, steps: int, tokens: int) -> Dict[str, float]:
        """Training's time per step and tokens/s apart from sampling and scoring the batches (rank 0's clock)."""
        training_s = max(window_s - batches_s, 1e-9)
        return {"train_s": training_s / max(steps, 1), "train_tokens_per_s": tokens / training_s}

    def step_batches(self, trainer, resumed: Optional[Path]):
        """The rollouts, sampled by the engine the run plan chose, continued from the cycle a checkpoint was cut inside."""
        return RolloutBatches.for_run(trainer, self, resumed)

    def validation(self, trainer) -> Optional[Dict[str, float]]:
        """The held-out prompts' mean reward, one greedy completion each (and each function's)."""
        try:
            return held_out_reward(trainer, self)
        except LitftError as err:
            raise LitftError(f"step {trainer.state.step}, validation: {err}") from None

    def describe(self) -> str:
        return "the base with the adapter off (no extra weights)" if self.uses_reference else "none (no KL term)"

    def fake_batch(self, rows: int, seq_len: int, tokens: torch.Tensor) -> dict:
        """Rows of completions: each row's tokens but its last carry loss, with an advantage (and the sampler's log-probs)."""
        batch = super().fake_batch(rows, seq_len, tokens)
        index = batch["targets"]["index"]
        batch["targets"]["sequence"] = torch.div(index, seq_len, rounding_mode="floor")
        batch["advantage"] = torch.ones(rows)
        if self.args.iterations > 1:
            batch["old_logp"] = torch.zeros(index.shape)
        return batch

    def generation_bytes(self, config, prompt_len: int, itemsize: int, prompts: int = 1) -> int:
        """One generate call's device memory: the KV cache of ``prompts`` prompts' groups at their full length (the prompt
        and every new token but the last, which is not run through the model) and the sampler's fp32 vocabulary-wide rows
        (scores, their scaled copy, the probabilities and their running sums)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        rows, length = prompts * self.args.group_size, prompt_len + self.args.max_new_tokens - 1
        cache = 2 * text.num_hidden_layers * rows * length * kv_heads * head_dim * itemsize
        return int(cache + 4 * rows * text.vocab_size * 4)

    def summary(self) -> str:
        a = self.args
        high = a.epsilon_high if a.epsilon_high is not None else a.epsilon
        return (f"grpo: {a.group_size} completions per prompt (up to {a.max_new_tokens} tokens, temperature {a.temperature}, top_p {a.top_p}); "
                f"rewards {', '.join(f'{n} x{w:g}' for n, w in zip(self.rewards, self.weights))}; advantages scaled by {a.scale_advantages}; "
                f"{a.importance} ratio clipped to [{1 - a.epsilon:g}, {1 + high:g}]; {a.loss_norm} loss; {a.iterations} step(s) per batch of rollouts"
                + (f"; KL {a.effective_beta:g} against the base with the adapter off" if self.uses_reference else "")
                + f"; log-probs scored at temperature {a.temperature:g}; "
                + ("dropout off (--objective.disable_dropout)" if a.disable_dropout else "dropout on in training, off while sampling"))
