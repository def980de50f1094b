"""Preference objectives (DPO, IPO, SimPO, ORPO) on litft's one loop: a pair is a sample, its loss a sum the loop averages.

A pair is one sample of two sequences (the prompt with the chosen response, then the
prompt with the rejected one, positions restarting between them); collate adds which
sequence each target token belongs to (``targets["sequence"]``), the pair count, and
the reference's scores where they were computed before training.

Every objective reads the same four numbers per pair: the summed log-probs of the
chosen and the rejected response under the trained model, their token counts, and
(DPO, IPO) the reference model's sums. The per-pair losses are summed like the
next-token loss is; the loop divides by the pairs of the whole global batch
(``Preference.count``), so a step is the same however pairs are split over ranks.

The formulas, with pi/ref the summed log-probs and m the per-token means:
    DPO    -(1-e) log s(b*h) - e log s(-b*h),        h = (pi_c - pi_r) - (ref_c - ref_r)
    IPO    (h_m - 1 / (2b))^2,                       h_m = h on per-token means
    SimPO  -(1-e) log s(z) - e log s(-z),            z = b*(m_c - m_r) - gamma
    ORPO   -m_c - b * log s(log odds(m_c) - log odds(m_r)),   odds(p) = p / (1 - p)
Rewards (logged): b * (policy - reference) for DPO and IPO on the log-probs each uses, b * m for SimPO and ORPO.
"""

import time
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from litft.objectives.args import ObjectiveArgs
from litft.errors import LitftError
from litft.objectives.base import Objective, sums_per_sequence
from litft.parallel.context import MARK

# Per-step sums kept on the device and reduced at log steps: the pairs, then each figure summed over them.
STATS = ("pairs", "reward_chosen", "reward_rejected", "preference_accuracy", "logp_chosen", "logp_rejected")


def sequence_sums(token_logps: torch.Tensor, sequence: torch.Tensor, pairs: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs and token counts of every sequence, as (pairs, 2): chosen in column 0, rejected in 1."""
    sums, counts = sums_per_sequence(token_logps.float(), sequence, 2 * pairs)
    return sums.view(pairs, 2), counts.view(pairs, 2)


def log_odds(mean_logp: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) of a mean log-prob, with 1 - p as -expm1 (exact where p is near 1)."""
    return mean_logp - torch.log(-torch.expm1(mean_logp.clamp(max=-1e-7)))


def pair_losses(objective: ObjectiveArgs, policy: torch.Tensor, lengths: torch.Tensor, reference: Optional[torch.Tensor]):
    """Each pair's loss, rewards (pairs, 2) and the log-probs the objective compares (pairs, 2)."""
    beta, smoothing = objective.effective_beta, objective.label_smoothing
    name = objective.name
    if name == "dpo":
        h = (policy[:, 0] - policy[:, 1]) - (reference[:, 0] - reference[:, 1])
        losses = -(1 - smoothing) * F.logsigmoid(beta * h) - smoothing * F.logsigmoid(-beta * h)
        return losses, beta * (policy - reference), policy
    mean = policy / lengths
    if name == "ipo":
        ref_mean = reference / lengths
        h = (mean[:, 0] - mean[:, 1]) - (ref_mean[:, 0] - ref_mean[:, 1])
        return (h - 1 / (2 * beta)) ** 2, beta * (mean - ref_mean), mean
    if name == "simpo":
        z = beta * (mean[:, 0] - mean[:, 1]) - objective.gamma
        losses = -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)
        return losses, beta * mean, mean
    if name == "orpo":
        losses = -mean[:, 0] - beta * F.logsigmoid(log_odds(mean[:, 0]) - log_odds(mean[:, 1]))
        return losses, beta * mean, mean
    raise ValueError(f"no preference objective {name}")


def preference_loss(objective: ObjectiveArgs, policy, lengths, reference, counted: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The summed loss of the pairs and their figures (``STATS``, summed; zero where another rank of the group counts them)."""
    losses, rewards, logps = pair_losses(objective, policy.double(), lengths.double(), None if reference is None else reference.double())
    with torch.no_grad():
        pairs = float(len(losses)) if counted else 0.0
        figures = torch.stack([  # the pair count filled on the device: no host copy
            losses.new_full((), pairs, dtype=torch.float64), rewards[:, 0].sum(), rewards[:, 1].sum(),
            (rewards[:, 0] > rewards[:, 1]).double().sum(), logps[:, 0].sum(), logps[:, 1].sum(),
        ])
    return losses.sum().float(), figures * float(counted)


def figures_of(summed: torch.Tensor, prefix: str = "") -> Dict[str, float]:
    """Means per pair of the summed ``STATS`` (every rank's), and the reward margin."""
    values = summed.tolist()
    pairs = max(values[0], 1.0)
    means = {name: value / pairs for name, value in zip(STATS[1:], values[1:])}
    means["reward_margin"] = means["reward_chosen"] - means["reward_rejected"]
    return {f"{prefix}{name}": value for name, value in means.items()}


REFERENCE_FILE = "reference_logps.pt"  # in every checkpoint of a run whose reference was scored before training


@torch.no_grad()
def score_pairs(fabric, module, samples, micro_batch_size: int, pad_id: int, padding_free: bool, context) -> torch.Tensor:
    """Summed log-probs (pairs, 2) of every pair under the model as it is now, each rank scoring its share, every rank given all.

    Every rank makes the same number of forwards (sharded forwards are collectives); the ranks of a context group
    score slices whose sums ``CausalLM.sequence_log_probs`` makes whole, and those of a tensor-parallel group the
    same pairs, so each pair is added by one rank of its group.
    """
    from litft.data.collate import collate
    from litft.data.order import eval_batches

    module.eval()
    table = torch.zeros((len(samples), 2), dtype=torch.float64, device=fabric.device)
    counts_here = context.place == 0 and fabric.global_rank % context.tensor == 0
    for idx in eval_batches(len(samples), micro_batch_size, context.data_rank, context.data_world):
        batch = fabric.to_device(context.split(collate([samples[i] for i in (idx or [0])], pad_id, padding_free)))
        with fabric.autocast():
            sums = module.predict_step(batch).double()
        if idx and counts_here:
            table[torch.tensor(idx, device=table.device)] = sums
    module.train()
    return (fabric.all_reduce(table, reduce_op="sum") if fabric.world_size > 1 else table).float().cpu()


def attach_reference(samples, table: torch.Tensor) -> None:
    """Each pair carries its reference log-probs from here on: collate hands them to the step (``batch["reference"]``)."""
    if len(table) != len(samples):
        raise ValueError(f"{len(table)} reference scores for {len(samples)} pairs")
    for sample, row in zip(samples, table):
        sample["reference"] = row


def sequence_log_probs(lm, batch: dict) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Summed log-probs and token counts of each pair's chosen and rejected response, (pairs, 2) each, whole under context
    parallel; and the router's auxiliary loss (MoE) or None."""
    pairs = len(batch["ids"])
    token_logps, aux = lm.token_log_probs(batch)
    sums, counts = sequence_sums(token_logps, batch["targets"]["sequence"], pairs)
    group = (batch.get("varlen") or {}).get(MARK)
    if group is not None:  # each rank of a context group holds a slice of every sequence
        sums, counts = group.sum(sums), group.sum(counts.detach())
    return sums, counts, aux


class Preference(Objective):
    """DPO, IPO, SimPO and ORPO: the formula of ``pair_losses`` on each pair's sums, counted per pair."""

    unit = "pairs"
    progress = (("acc", "preference_accuracy", ".2f"), ("margin", "reward_margin", ".3f"))
    rows_per_sample = 2

    def __init__(self, args: ObjectiveArgs, lora: bool):
        super().__init__(args, lora)
        self.name = args.name
        self.precomputed = args.reference_precomputed(lora)
        # DPO/IPO under LoRA: the reference is the base with the adapter off, one more forward per micro-batch.
        self.reference_forwards = int(args.uses_reference and not self.precomputed)

    @staticmethod
    def counted(batch: dict) -> bool:
        """Whether this rank counts the batch's pairs: not a stand-in batch, and the first slice of a context group."""
        return bool(batch.get("counted", True) and batch.get("lead_slice", True))

    @classmethod
    def default_data(cls):
        from litft.data.preference import TinyPreferences

        return TinyPreferences()

    @classmethod
    def check_data(cls, args: ObjectiveArgs, data) -> None:
        from litft.data.preference import PreferenceData

        if not isinstance(data, PreferenceData):
            raise LitftError(
                f"--objective {args.name} trains on preference pairs; give --data Preferences (prompt/chosen/rejected records) "
                "or TinyPreferences, not " + type(data).__name__
            )

    def count(self, batch: dict) -> int:
        return int(batch["pairs"]) if self.counted(batch) else 0

    def reference_log_probs(self, lm, batch: dict) -> torch.Tensor:
        """The reference model's summed log-probs per pair: scored before training, or the base with the adapter switched off."""
        if "reference" in batch:
            return batch["reference"].float()
        with torch.no_grad(), lm.model.disable_adapter():
            return sequence_log_probs(lm, batch)[0]

    def loss_sum(self, lm, batch: dict) -> torch.Tensor:
        """The summed preference loss of the micro-batch's pairs; its figures are kept for the log."""
        reference = self.reference_log_probs(lm, batch) if self.args.uses_reference else None
        policy, lengths, aux = sequence_log_probs(lm, batch)
        counted = self.counted(batch)  # under context parallel one rank of each group counts the loss and its figures
        loss, figures = preference_loss(self.args, policy, lengths, reference, counted)
        self.pending.append(figures)
        # The zero keeps this rank's slice in the graph: the group sum's backward gives it the gradient. MoE: the router's balance of
        # this rank's tokens, weighted by the pairs as the loss is; under context parallel every slice adds its share, as a
        # supervised run's slices do, so that the group weighs it by the pairs once.
        share = len(policy) / batch.get("slices", 1) if batch.get("counted", True) else 0
        return lm.with_router_aux(loss if counted else loss * 0.0, aux, share)

    def score(self, lm, batch: dict) -> torch.Tensor:
        """Each pair's summed log-probs under the model as it is (the reference, scored before training)."""
        return sequence_log_probs(lm, batch)[0]

    def figures(self, summed: torch.Tensor, prefix: str = "", maxima: Optional[torch.Tensor] = None) -> Dict[str, float]:
        return figures_of(summed, prefix)

    def describe(self) -> str:
        """Where the reference comes from, and what it costs in memory (the estimate's line)."""
        if not self.args.uses_reference:
            return "none (reference-free)"
        if self.precomputed:
            return "scored before training: a table of 2 log-probs per pair, no reference weights"
        return "the base with the adapter off: no second copy, one no-grad forward per micro-batch (counted in the activations)"

    def validation_figures(self, val_loss: float, summed: Optional[torch.Tensor]) -> Dict[str, float]:
        return {} if summed is None else figures_of(summed, prefix="val_")

    def prepare(self, trainer, resumed: Optional[Path]) -> Dict[str, object]:
        """DPO/IPO with the reference scored before training: every pair's log-probs under the initial model, no reference weights.

        Scored once, at the start, and kept in every checkpoint: a resumed run reads them back and does not score again.
        """
        if not self.precomputed:
            return {}
        fabric, data, train = trainer.fabric, trainer.data, trainer.spec.train
        trainer.watch.at(trainer.state.step, "scoring the reference log-probs")
        stored = resumed / REFERENCE_FILE if resumed is not None else None
        if stored is not None and not stored.is_file():  # scoring now would score the trained weights, not the initial ones
            raise LitftError(
                f"checkpoint {resumed} holds no reference log-probs ({REFERENCE_FILE}), so its run's initial model cannot be "
                "scored again; resume it with the objective it was trained with, or start this run afresh from its exported model"
            )
        if stored is not None:
            tables = torch.load(stored, weights_only=True)
            if len(tables["train"]) != len(data.train) or len(tables["val"]) != len(data.val):
                raise LitftError(
                    f"checkpoint {resumed} holds reference scores of {len(tables['train'])} train / {len(tables['val'])} val pairs, and the data "
                    f"has {len(data.train)} / {len(data.val)}; resume with the data it was trained on"
                )
            fabric.print(f"reference log-probs of {len(data.train) + len(data.val):,} pairs read from {resumed}")
        else:
            started = time.perf_counter()
            pad = trainer.tokenizer.pad_token_id

            def score(samples):
                return score_pairs(fabric, trainer.module, samples, train.micro_batch_size, pad, trainer.padding_free, trainer.context)

            tables = {"train": score(data.train), "val": score(data.val)}
            fabric.print(
                f"reference: {len(data.train) + len(data.val):,} pairs scored by the initial model in {time.perf_counter() - started:.1f} s; "
                "their log-probs are kept with every checkpoint and no reference weights are held"
            )
        attach_reference(data.train, tables["train"])
        attach_reference(data.val, tables["val"])
        return {REFERENCE_FILE: tables}

    def fake_batch(self, rows: int, seq_len: int, tokens: torch.Tensor) -> dict:
        """Each row a sequence: chosen and rejected of pair k in rows 2k and 2k + 1; the reference's scores where precomputed."""
        batch = super().fake_batch(rows, seq_len, tokens)
        pairs = rows // 2
        batch.update(ids=torch.arange(pairs), pairs=pairs)
        batch["targets"]["sequence"] = batch["targets"]["index"] // seq_len
        if self.precomputed:
            batch["reference"] = torch.zeros(pairs, 2)
        return batch
