"""EleutherAI's lm-evaluation-harness on a model in memory: ``litft evaluate`` and ``--eval.tasks`` during training.

lm-eval's own Hugging Face model class (``HFLM``) scores the model, so every log-likelihood is what ``lm_eval --model hf``
computes, and its tasks, few-shot seeds, filters and aggregation are its own. What litft adds: the documents of several
ranks (each rank takes every world-th document, lm-eval gathers the metrics on rank 0, and the results are one process's),
a model that is sharded while it trains (every rank makes the same number of forward calls: no per-context logits cache,
a fixed batch), and generation through litft's one generation service (the model's own generation config set aside, eval
mode, the sharded weights gathered once per call, every rank stepping to the longest answer).
"""

import contextlib
import difflib
import functools
import importlib.util
from typing import Dict, List, Optional

import torch

from litft.errors import LitftError

INSTALL = "lm-evaluation-harness is not installed: pip install 'litft[eval]'"


def require_lm_eval() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise LitftError(INSTALL)


@functools.lru_cache(maxsize=4)
def task_manager(include_path: Optional[str] = None):
    """lm-eval's index of tasks, with the YAML tasks under ``include_path`` added (indexed once: some 15,000 tasks)."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path) if include_path else TaskManager()


def check_tasks(tasks: List[str], include_path: Optional[str]) -> None:
    """One line for a task lm-eval does not know (one of several too), before anything is loaded or evaluated."""
    require_lm_eval()
    if include_path is not None:
        from pathlib import Path

        if not Path(include_path).is_dir():
            raise LitftError(f"--include_path {include_path} is not a folder of task YAML files")
    known = set(task_manager(include_path).all_tasks)
    for task in tasks:
        if task not in known:
            near = difflib.get_close_matches(task, known, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(near)}?" if near else "; lm_eval --tasks list shows them (or give --include_path DIR)"
            raise LitftError(f"--tasks {task} is no lm-eval task{hint}")


def harness_model(model, tokenizer, batch_size: int, rank: int = 0, world_size: int = 1, generation=None):
    """lm-eval's HFLM around ``model``, for ``world_size`` ranks, its generate calls through ``generation`` where given."""
    require_lm_eval()
    from lm_eval.models.huggingface import HFLM

    class LitftLM(HFLM):
        """HFLM on a model litft holds: its ranks are litft's, its generation litft's service."""

        def all_gather(self, tensor):
            if self.world_size <= 1:
                return tensor
            out = [torch.zeros_like(tensor) for _ in range(self.world_size)]
            torch.distributed.all_gather(out, tensor.contiguous())
            return torch.cat([t.reshape(-1) for t in out])

        def barrier(self):
            if self.world_size > 1:
                torch.distributed.barrier()

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            if generation is None:
                return super()._model_generate(context, max_length, stop, **generation_kwargs)
            with generation.generating():  # the model's config set aside: its end-of-turn tokens are litft's stop tokens again
                return super()._model_generate(context, max_length, stop, synced_gpus=world_size > 1,
                                               **{"eos_token_id": generation.stops, **generation_kwargs})

    lm = LitftLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, logits_cache=world_size == 1)
    lm._rank, lm._world_size = rank, world_size
    return lm


def evaluate_tasks(lm, tasks: List[str], include_path: Optional[str] = None, num_fewshot: Optional[int] = None,
                   limit: Optional[float] = None) -> Optional[dict]:
    """lm-eval's results (its own layout) on rank 0, None on the others; lm-eval's default seeds."""
    from lm_eval import simple_evaluate

    with contextlib.redirect_stdout(None) if lm.rank else contextlib.nullcontext():
        return simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=task_manager(include_path),
                               log_samples=False)


def flat_metrics(results: dict) -> Dict[str, float]:
    """``lm_eval/<task>/<metric>`` for every number in the results (the log's and every tracker's columns)."""
    out = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            if "," in key and "_stderr" not in key and isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"lm_eval/{task}/{key.replace(',none', '')}"] = float(value)
    return out
