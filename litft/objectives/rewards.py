"""Reward functions for ``--objective grpo``, with TRL's signature so that its users' functions work unchanged.

    fn(prompts, completions, completion_ids, **columns) -> list of float or None (one per completion)

``prompts`` and ``completions`` are text, ``completion_ids`` token ids, and every other column of
the prompt data comes by name (a list, one entry per completion). None means the function does
not judge that completion: it leaves the weighted sum, and the completion is not counted in the
function's mean. Built in: ``exact_match`` (the completion, stripped, equals the ``answer`` column)
and ``format`` (the whole completion matches ``--objective.format_pattern``).
"""

import importlib
import math
import re
from typing import Callable, Dict, List, Optional, Sequence

import torch

from litft.errors import LitftError


def exact_match(prompts, completions, completion_ids, answer=None, **columns) -> List[Optional[float]]:
    """1.0 where the completion, stripped, is the answer; None where the prompt has no answer."""
    if answer is None:
        raise LitftError("the exact_match reward reads an 'answer' column, and the prompt data has none; add one or choose other rewards")
    return [None if a is None else float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def format_reward(pattern: str) -> Callable:
    """1.0 where the whole completion (stripped) matches ``pattern``."""
    compiled = re.compile(pattern, flags=re.DOTALL)

    def format(prompts, completions, completion_ids, **columns) -> List[float]:  # noqa: A001 - the reward's name in the logs
        return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]

    return format


def load_rewards(spec: str, format_pattern: str) -> Dict[str, Callable]:
    """Name -> function for each entry of ``--objective.rewards``, in order; one line for one that cannot be imported."""
    functions = {}
    for entry in (e.strip() for e in spec.split(",") if e.strip()):
        if entry == "exact_match":
            functions[entry] = exact_match
        elif entry == "format":
            functions[entry] = format_reward(format_pattern)
        else:
            module, _, name = entry.partition(":")
            try:
                functions[name or entry] = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError) as err:
                raise LitftError(f"--objective.rewards {entry} cannot be imported ({err}); give module:function or exact_match / format") from None
    return functions


def score_completions(functions: Dict[str, Callable], weights: Sequence[float], prompts: List[str], completions: List[str],
                      completion_ids: List[List[int]], columns: Dict[str, list]) -> Dict[str, List[Optional[float]]]:
    """Each function's reward per completion, checked: one value (float or None) per completion."""
    rewards = {}
    for name, function in functions.items():
        try:
            values = list(function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns))
        except LitftError:
            raise
        except Exception as err:  # noqa: BLE001 - a user's function: its failure named in one line
            raise LitftError(f"reward {name} raised {type(err).__name__}: {err}".splitlines()[0]) from None
        if len(values) != len(completions):
            raise LitftError(f"reward {name} returned {len(values)} values for {len(completions)} completions; return one per completion")
        for value in values:
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise LitftError(f"reward {name} returned {value!r}; each value must be a finite number or None")
        rewards[name] = [None if v is None else float(v) for v in values]
    return rewards


def weighted_sum(rewards: Dict[str, List[Optional[float]]], weights: Sequence[float]) -> List[float]:
    """The reward of each completion: the weighted sum of the functions that judged it (None leaves out, as TRL's nansum)."""
    count = len(next(iter(rewards.values())))
    return [sum(w * values[i] for w, values in zip(weights, rewards.values()) if values[i] is not None) for i in range(count)]


def group_advantages(rewards: torch.Tensor, scale: str, batch_std: Optional[float] = None, eps: float = 1e-4) -> torch.Tensor:
    """Advantages of (prompts, group) rewards: minus the group's mean, over the group's std, the batch's, or nothing."""
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "group":
        return centered / (rewards.std(dim=1, keepdim=True) + eps)
    if scale == "batch":
        return centered / (batch_std + eps)
    return centered
