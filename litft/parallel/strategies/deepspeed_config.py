"""DeepSpeed's JSON config from litft's flags, or the user's file with its "auto" values filled in."""

import json
from pathlib import Path
from typing import Optional

from litft.config import DeepSpeedArgs, Layout, TrainArgs
from litft.errors import LitftError
from litft.parallel.mesh import layout_data_world


def zero_buckets(stage: int, hidden_size: int) -> dict:
    """Communication that overlaps the backward, in buckets sized to the model's width.

    DeepSpeed turns overlap_comm on by itself only for stage 3, and its 5e8-element
    default buckets are 1 GB in bf16 whatever the model. These are the sizes HF's
    "auto" values give (h^2 for reductions, 0.9 h^2 for stage 3's prefetch, 10 h for
    the parameters stage 3 keeps whole).
    """
    if stage == 0:
        return {}
    square = hidden_size * hidden_size
    buckets = {"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": square}
    if stage == 3:
        buckets.update(stage3_prefetch_bucket_size=int(0.9 * square), stage3_param_persistence_threshold=10 * hidden_size)
    else:
        buckets["allgather_bucket_size"] = square
    return buckets


def users_config(path, ours: dict, layout: Layout) -> dict:
    """The user's ``--deepspeed.config`` file, its batch sizes and clipping filled in from litft's flags where it says "auto"."""
    try:
        config = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise LitftError(f"--deepspeed.config {path} is not valid JSON (line {err.lineno}: {err.msg})") from None
    for key, value in ours.items():
        given = config.get(key, "auto")
        if given != "auto" and given != value:
            why = ""
            if key == "train_batch_size" and layout.context_parallel > 1:
                why = " (DeepSpeed counts each sample once per rank of a --context_parallel group)"
            raise LitftError(
                f"--deepspeed.config sets {key} to {given} but litft's flags give {value}{why}; set it to \"auto\" or change the flags"
            )
        config[key] = value
    return config


def deepspeed_config(args: DeepSpeedArgs, train: TrainArgs, layout: Layout, precision: str, hidden_size: Optional[int] = None) -> dict:
    """DeepSpeed's config from litft's flags, or the user's file with its "auto" values filled in.

    The loop owns accumulation: it marks the last micro-batch as the boundary (see
    ``AccumulationBoundary``), then steps once, as under every other strategy. With
    the model's ``hidden_size``, communication overlaps the backward in sized buckets
    wherever the config leaves them out or says "auto" (``zero_buckets``).
    """
    # At least 1: under RL the global batch counts prompts and a micro-batch completions, and as the loop owns
    # accumulation DeepSpeed's count need only be consistent.
    accumulation = max(1, train.global_batch_size // (train.micro_batch_size * layout_data_world(layout)))
    ours = {
        # DeepSpeed counts a batch per rank; the ranks of a context-parallel group share theirs.
        "train_batch_size": train.micro_batch_size * accumulation * layout.world_size,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": train.max_norm or 0.0,
    }
    if args.config is not None:
        config = users_config(args.config, ours, layout)
    else:
        zero = {"stage": args.stage}
        for key, where in (("offload_optimizer", args.offload_optimizer), ("offload_param", args.offload_parameters)):
            if where is not None:
                zero[key] = {"device": where, **({"nvme_path": str(args.nvme_path)} if where == "nvme" else {})}
        config = {**ours, "zero_optimization": zero}
    for section, enabled in (("bf16", precision.startswith("bf16")), ("fp16", precision.startswith("16"))):
        given = config.get(section, {}).get("enabled", "auto")
        if given not in ("auto", enabled):
            raise LitftError(
                f"--deepspeed.config sets {section}.enabled to {str(given).lower()} but --precision is {precision}; "
                f'set it to "auto" or change --precision'
            )
        config[section] = {**config.get(section, {}), "enabled": enabled}
    config.setdefault("zero_optimization", {"stage": 0})
    zero = config["zero_optimization"]
    if hidden_size is not None:
        for key, value in zero_buckets(int(zero.get("stage", 0)), hidden_size).items():
            if zero.get(key, "auto") == "auto":
                zero[key] = value
    if zero.get("stage", 0) == 0:
        config["gradient_clipping"] = 0.0  # litft clips stage 0 itself (see DeepSpeed.optimizer_step)
    # litft's AdamW keeps the math identical across strategies; DeepSpeed warns about client optimizers otherwise.
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("zero_force_ds_cpu_optimizer", False)
    config.setdefault("steps_per_print", 10**9)
    config.setdefault("wall_clock_breakdown", False)
    return config
