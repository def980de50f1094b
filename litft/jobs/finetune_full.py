"""Full finetuning: every weight of a pretrained model is trained."""

from pathlib import Path
from typing import Optional

from litft.args import DeepSpeedArgs, EvalArgs, FSDPArgs, TrainArgs
from litft.data.base import DataModule
from litft.jobs.run import RunResult, execute, make_run
from litft.strategy import Accelerator, Precision, Strategy
from litft.tiny import TINY_NAME


def finetune_full(
    model: str = TINY_NAME,
    data: Optional[DataModule] = None,
    out_dir: Path = Path("out/finetune_full"),
    precision: Optional[Precision] = None,
    devices: int = 1,
    num_nodes: int = 1,
    strategy: Strategy = "auto",
    fsdp: FSDPArgs = FSDPArgs(),
    deepspeed: DeepSpeedArgs = DeepSpeedArgs(),
    accelerator: Accelerator = "auto",
    train: TrainArgs = TrainArgs(global_batch_size=32, micro_batch_size=8, learning_rate=3e-3, warmup_steps=20),
    eval: EvalArgs = EvalArgs(interval=200, score_samples=0),
    seed: int = 42,
    overwrite: bool = False,
    resume: Optional[str] = None,
) -> RunResult:
    """Train all weights of a causal LM on instruction data; the result lands in out_dir/final.

    Args:
        model: Hugging Face hub id or local model folder (litft-tiny is built locally).
        data: Training data (default: TinyTasks, generated here).
        out_dir: Folder for logs, the run's config and the final model.
        precision: 32-true, bf16-mixed, bf16-true or 16-mixed (default: bf16-mixed on GPUs that have it, else 32-true).
        devices: Processes (GPUs) per node.
        num_nodes: Nodes taking part.
        strategy: auto (one device, or DDP for several), ddp, fsdp (FSDP2, sharded per block) or deepspeed (ZeRO).
        fsdp: Sharding options for --strategy fsdp.
        deepspeed: ZeRO stage, offload and config file for --strategy deepspeed.
        accelerator: auto, cpu or cuda.
        train: Batch, schedule and run length.
        eval: Validation cadence and scoring.
        seed: Seeds the weights of new layers, the data order and dropout.
        overwrite: Replace the final model, logs and checkpoints of an earlier litft run in out_dir (nothing else there is touched).
        resume: Continue from a checkpoint: "auto" takes the newest finished one in out_dir (or starts afresh if there is none), or a checkpoint folder's path.
    """
    arguments = dict(locals())  # the flags as given: recorded in run_config.yaml
    return execute(make_run("finetune_full", arguments))
