"""Reward functions for ``--objective grpo``, with TRL's signature so that its users' functions work unchanged.

    fn(prompts, completions, completion_ids, **columns) -> list of float or None (one per completion)

``prompts`` and ``completions`` are text, or, where the prompt is a conversation, its messages and a
one-message assistant turn (as TRL passes them); ``completion_ids`` are token ids; every other column of
the prompt data comes by name (a list, one entry per completion). None means the function does
not judge that completion: it leaves the weighted sum, and the completion is not counted in the
function's mean. Built in: ``exact_match`` (the completion, or its answer by ``--objective.answer_pattern``, equals the ``answer`` column)
and ``format`` (the whole completion matches ``--objective.format_pattern``).
"""

import importlib
import importlib.util
import math
import re
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from litft.errors import LitftError


def text_of(completion) -> str:
    """A completion's text, given as text or as TRL gives a conversation's (a list of messages, the answer last)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def exact_match(answer_pattern: Optional[str] = None) -> Callable:
    """1.0 where the completion's answer is the answer column's, else 0.0; None where the prompt has no answer. With a
    pattern, an answer is its first group's last match (in the column, where it matches: GSM8K's "#### 72")."""
    pattern = re.compile(answer_pattern, flags=re.DOTALL) if answer_pattern else None

    def extracted(text: str, fallback: Optional[str]) -> Optional[str]:
        if pattern is None:
            return text.strip()
        found = list(pattern.finditer(text))
        return (found[-1].group(1) if pattern.groups else found[-1].group(0)).strip() if found else fallback

    def exact_match(prompts, completions, completion_ids, answer=None, **columns) -> List[Optional[float]]:
        if answer is None:
            raise LitftError("the exact_match reward reads an 'answer' column, and the prompt data has none; add one (or map one with "
                             "--data.columns) or choose other rewards")
        out = []
        for completion, expected in zip(completions, answer):
            expected = None if expected is None else extracted(str(expected), str(expected).strip())
            out.append(None if expected is None else float(extracted(text_of(completion), None) == expected))
        return out

    return exact_match


def format_reward(pattern: str) -> Callable:
    """1.0 where the whole completion (stripped) matches ``pattern``."""
    compiled = re.compile(pattern, flags=re.DOTALL)

    def format(prompts, completions, completion_ids, **columns) -> List[float]:  # noqa: A001 - the reward's name in the logs
        return [float(compiled.fullmatch(text_of(c).strip()) is not None) for c in completions]

    return format


def import_file(path: str):
    """A reward module given as a file path (a script beside the data, not an installed package)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or not Path(path).is_file():
        raise ImportError(f"no file {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_rewards(spec: str, format_pattern: str, answer_pattern: Optional[str] = None) -> Dict[str, Callable]:
    """Name -> function for each entry of ``--objective.rewards``, in order; one line for one that cannot be imported."""
    functions = {}
    for entry in (e.strip() for e in spec.split(",") if e.strip()):
        if entry == "exact_match":
            functions[entry] = exact_match(answer_pattern)
        elif entry == "format":
            functions[entry] = format_reward(format_pattern)
        else:
            module, _, name = entry.rpartition(":")
            if not module or not name:
                raise LitftError(f"--objective.rewards {entry} names no function: give {entry if module else entry + ':'}FUNCTION "
                                 "(module:function or path/to/file.py:function), or the built-ins exact_match and format")
            try:
                functions[name] = getattr(import_file(module) if module.endswith(".py") else importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError, OSError) as err:
                raise LitftError(f"--objective.rewards {entry} cannot be imported ({err}); give module:function, file.py:function "
                                 "or exact_match / format") from None
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
