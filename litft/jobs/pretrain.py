"""Pretraining: a model from a config (random weights) or from a checkpoint, on plain text."""

from pathlib import Path
from typing import Optional

from litft.args import DeepSpeedArgs, EvalArgs, FSDPArgs, TrainArgs
from litft.data.base import DataModule
from litft.jobs.run import RunResult, execute, make_run
from litft.strategy import Accelerator, Precision, Strategy
from litft.tiny import TINY_NAME


def pretrain(
    model: str = TINY_NAME,
    init: str = "random",
    tokenizer: Optional[str] = None,
    data: Optional[DataModule] = None,
    out_dir: Path = Path("out/pretrain"),
    precision: Optional[Precision] = None,
    devices: int = 1,
    num_nodes: int = 1,
    strategy: Strategy = "auto",
    fsdp: FSDPArgs = FSDPArgs(),
    deepspeed: DeepSpeedArgs = DeepSpeedArgs(),
    accelerator: Accelerator = "auto",
    train: TrainArgs = TrainArgs(global_batch_size=32, micro_batch_size=8, learning_rate=3e-3, warmup_steps=20, max_norm=1.0),
    eval: EvalArgs = EvalArgs(interval=200),
    seed: int = 42,
    overwrite: bool = False,
    resume: Optional[str] = None,
) -> RunResult:
    """Pretrain a causal LM on text, from random weights or from a checkpoint's weights.

    Args:
        model: Hub id, model folder, or config.json file giving the architecture (and the weights with init=pretrained).
        init: random (a fresh model of that config) or pretrained (continue from its weights).
        tokenizer: Where the tokenizer comes from (default: the model argument).
        data: Training text (default: TinyTasks rendered as plain text, generated here).
        out_dir: Folder for logs, the run's config and the final model.
        precision: 32-true, bf16-mixed, bf16-true or 16-mixed (default: bf16-mixed on GPUs that have it, else 32-true).
        devices: Processes (GPUs) per node.
        num_nodes: Nodes taking part.
        strategy: auto (one device, or DDP for several), ddp, fsdp (FSDP2, sharded per block) or deepspeed (ZeRO).
        fsdp: Sharding options for --strategy fsdp.
        deepspeed: ZeRO stage, offload and config file for --strategy deepspeed.
        accelerator: auto, cpu or cuda.
        train: Batch, schedule and run length.
        eval: Validation cadence.
        seed: Seeds the initial weights, the data order and dropout.
        overwrite: Replace the final model, logs and checkpoints of an earlier litft run in out_dir (nothing else there is touched).
        resume: Continue from a checkpoint: "auto" takes the newest finished one in out_dir (or starts afresh if there is none), or a checkpoint folder's path.
    """
    arguments = dict(locals())  # the flags as given: recorded in run_config.yaml
    from litft.data.tiny import TinyTasks
    from litft.errors import LitftError

    if init not in ("random", "pretrained"):
        raise LitftError(f"--init {init} is unknown; choose random or pretrained")
    model_source = model
    if model.endswith(".json") and Path(model).is_file():
        # A bare config file: transformers reads the architecture from its folder.
        if init == "pretrained":
            raise LitftError("--init pretrained needs a model folder or hub id with weights, not a config.json file")
        model_source = str(Path(model).parent)
    # Without data, the tiny tasks as plain text: every token trained, samples packed.
    run = make_run(
        "pretrain", arguments, model=model_source, random_init=init == "random", tokenizer=tokenizer,
        default_data=TinyTasks(mask_prompt=False, packing=True),
    )
    return execute(run)
