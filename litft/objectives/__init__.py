"""The objective a run optimizes, one module per family behind one interface (litft.objectives.base.Objective).

    supervised   sft: next-token cross-entropy on the target tokens (pretraining, SFT)
    preference   dpo, ipo, simpo, orpo: a loss on each pair's chosen and rejected log-probs
    grpo         grpo (and DAPO, Dr. GRPO, GSPO as its flags): the clipped policy gradient on sampled, rewarded completions
"""

from litft.objectives.args import ObjectiveArgs
from litft.objectives.base import Objective
from litft.objectives.preference import Preference
from litft.objectives.grpo import GroupRelative
from litft.objectives.supervised import Supervised

FAMILIES = {"sft": Supervised, "dpo": Preference, "ipo": Preference, "simpo": Preference, "orpo": Preference, "grpo": GroupRelative}


def build_objective(args: ObjectiveArgs, lora: bool) -> Objective:
    """The run's objective from its flags (``--objective``); ``lora``: whether the base is frozen (a reference for free)."""
    return FAMILIES[args.name](args, lora)


def next_token(lora: bool = False) -> Objective:
    """The next-token loss on target tokens (sft), for a module composed outside a run (tests, benchmarks)."""
    return build_objective(ObjectiveArgs(), lora)


__all__ = ["Objective", "Supervised", "Preference", "GroupRelative", "build_objective", "next_token", "FAMILIES"]
