"""Preference objectives (DPO, IPO, SimPO, ORPO) on litft's one loop: a pair is a sample, its loss a sum the loop averages.

Every objective reads the same four numbers per pair: the summed log-probs of the
chosen and the rejected response under the trained model, their token counts, and
(DPO, IPO) the reference model's sums. The per-pair losses are summed like the
next-token loss is; the loop divides by the pairs of the whole global batch
(``batch["pairs"]``), so a step is the same however pairs are split over ranks.

The formulas, with pi/ref the summed log-probs and m the per-token means:
    DPO    -(1-e) log s(b*h) - e log s(-b*h),        h = (pi_c - pi_r) - (ref_c - ref_r)
    IPO    (h_m - 1 / (2b))^2,                       h_m = h on per-token means
    SimPO  -(1-e) log s(z) - e log s(-z),            z = b*(m_c - m_r) - gamma
    ORPO   -m_c - b * log s(log odds(m_c) - log odds(m_r)),   odds(p) = p / (1 - p)
Rewards (logged): b * (policy - reference) for DPO and IPO on the log-probs each uses, b * m for SimPO and ORPO.
"""

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from litft.config import ObjectiveArgs

# Per-step sums kept on the device and reduced at log steps: the pairs, then each figure summed over them.
STATS = ("pairs", "reward_chosen", "reward_rejected", "preference_accuracy", "logp_chosen", "logp_rejected")


def sequence_sums(token_logps: torch.Tensor, sequence: torch.Tensor, pairs: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs and token counts of every sequence, as (pairs, 2): chosen in column 0, rejected in 1."""
    sums = torch.zeros(2 * pairs, dtype=torch.float32, device=token_logps.device).index_add(0, sequence, token_logps.float())
    counts = torch.zeros(2 * pairs, dtype=torch.float32, device=token_logps.device).index_add(0, sequence, torch.ones_like(token_logps, dtype=torch.float32))
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
