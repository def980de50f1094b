"""The objective a run optimizes, one module per family behind one interface (litft.objectives.base.Objective).

    supervised   sft: next-token cross-entropy on the target tokens (pretraining, SFT)
    preference   dpo, ipo, simpo, orpo: a loss on each pair's chosen and rejected log-probs
    rl           grpo (and DAPO, Dr. GRPO, GSPO as its flags): the clipped policy gradient on sampled, rewarded completions
"""

from litft.config import ObjectiveArgs
from litft.objectives.base import Objective
from litft.objectives.preference import Preference
from litft.objectives.rl import GroupRelative
from litft.objectives.supervised import Supervised

FAMILIES = {"sft": Supervised, "dpo": Preference, "ipo": Preference, "simpo": Preference, "orpo": Preference, "grpo": GroupRelative}


def build_objective(args: ObjectiveArgs, lora: bool) -> Objective:
    """The run's objective from its flags (``--objective``); ``lora``: whether the base is frozen (a reference for free)."""
    return FAMILIES[args.name](args, lora)


__all__ = ["Objective", "Supervised", "Preference", "GroupRelative", "build_objective", "FAMILIES"]
