"""``litft evaluate``: lm-evaluation-harness tasks on what was trained, from any of the forms a run leaves.

MODEL is a Hugging Face folder (a run's ``final/``), a peft adapter folder (a run's ``final-adapter/``, put on the base
its config names, not merged: as ``lm_eval --model hf --model_args peft=...`` does), a training checkpoint or a run's
folder (the model made in memory a block at a time, nothing written to disk), litft-tiny or a hub id. Every task, flag and
bad input is checked before anything is evaluated; ``OUT/results.json`` holds lm-eval's results with the model, the
checkpoint's step and the flags.
"""

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from litft.checkpoint.format import CHECKPOINTS, META, CheckpointMeta, resolve_resume
from litft.cli.chat import load_for_chat
from litft.cli.flags import ACCELERATOR, TRAINED_MODEL, Flag, command
from litft.errors import LitftError
from litft.model.generation import Generation
from litft.run.tasks import check_tasks, evaluate_tasks, flat_metrics, harness_model

EVALUATE_FLAGS = [
    TRAINED_MODEL,
    Flag("tasks", str, "", "Comma-separated lm-eval tasks (lm_eval --tasks list names them), e.g. hellaswag,arc_easy."),
    Flag("include_path", Optional[str], None, "A folder of task YAML files of your own, added to lm-eval's."),
    Flag("num_fewshot", Optional[int], None, "Few-shot examples in each prompt (default: each task's own); drawn with lm-eval's seed."),
    Flag("limit", Optional[float], None, "Documents per task (a number, or a share below 1): for a quick look, not for a report."),
    Flag("batch_size", int, 8, "Requests scored together."),
    Flag("devices", int, 1, "Processes that split the documents (each holds the whole model); the results are one process's."),
    ACCELERATOR,
    Flag("out_dir", Path, Path("out/evaluate"), "Where results.json goes."),
]


def describe_model(name: str) -> dict:
    """What the model argument names, checked before anything loads: its kind, and the checkpoint's step where it is one."""
    path = Path(name).expanduser()
    if (path / "adapter_config.json").is_file():
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        from litft.model.loading import resolve_model

        if not base:
            raise LitftError(f"adapter {path} names no base model (base_model_name_or_path in adapter_config.json); pass a merged model")
        try:
            resolve_model(base)
        except LitftError:
            raise LitftError(f"adapter {path} is for base {base}, which cannot be found here; pass the adapter of a base that exists") from None
        return {"kind": "adapter", "base": base}
    if path.is_dir() and not (path / "config.json").is_file():
        if (path / META).is_file() or (path / CHECKPOINTS).is_dir():
            if (path / CHECKPOINTS).is_dir() and ((path / "final" / "config.json").is_file() or (path / "final-adapter").is_dir()):
                return {"kind": "run"}
            checkpoint = resolve_resume(str(path), path)
            if checkpoint is None:
                raise LitftError(f"{path} holds no finished checkpoint to evaluate")
            return {"kind": "checkpoint", "checkpoint": str(checkpoint), "step": CheckpointMeta.read(checkpoint).step}
        raise LitftError(f"{path} holds no model: give a folder with config.json, a peft adapter folder, or a litft checkpoint")
    return {"kind": "model"}


@command(EVALUATE_FLAGS)
def evaluate(**flags) -> Optional[dict]:
    """Run lm-evaluation-harness tasks on a trained model, a LoRA adapter or a training checkpoint; print its table, write results.json."""
    tasks = [t.strip() for t in flags["tasks"].split(",") if t.strip()]
    if not tasks:
        raise LitftError("--tasks names no task; give lm-eval tasks, e.g. --tasks hellaswag,arc_easy")
    if flags["batch_size"] < 1 or flags["devices"] < 1:
        raise LitftError("--batch_size and --devices must be at least 1")
    check_tasks(tasks, flags["include_path"])
    what = describe_model(flags["model"])
    fabric = start(flags)
    model, tokenizer, loaded = load_for_chat(flags["model"], "auto")  # the weights' own dtype, as lm_eval --model hf loads them
    model.to(fabric.device)
    place = SimpleNamespace(data_rank=fabric.global_rank, data_world=fabric.world_size)
    generation = Generation(fabric, SimpleNamespace(model=model), tokenizer, place)
    lm = harness_model(model, tokenizer, flags["batch_size"], fabric.global_rank, fabric.world_size, generation)
    results = evaluate_tasks(lm, tasks, flags["include_path"], flags["num_fewshot"], flags["limit"])
    if fabric.global_rank != 0:
        return None
    from lm_eval.utils import make_table

    print(make_table(results))
    results["litft"] = {"model": flags["model"], "loaded": loaded, **what, "flags": {k: str(v) if isinstance(v, Path) else v for k, v in flags.items()}}
    out = Path(flags["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f".results.json.{os.getpid()}"
    partial.write_text(json.dumps(results, indent=1, default=str))
    os.replace(partial, out / "results.json")
    print(f"results in {out / 'results.json'}: " + ", ".join(f"{k.removeprefix('lm_eval/')} {v:.4f}" for k, v in flat_metrics(results).items()))
    return results


def start(flags: dict):
    """This command's processes: one, or --devices of them splitting the documents (gloo on the CPU, NCCL on GPUs)."""
    import lightning_fabric as L

    from litft.device import resolve_accelerator

    accelerator = resolve_accelerator(flags["accelerator"])
    fabric = L.Fabric(accelerator=accelerator, devices=flags["devices"], strategy="ddp" if flags["devices"] > 1 else "auto")
    fabric.launch()
    return fabric
