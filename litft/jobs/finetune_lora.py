"""LoRA and QLoRA finetuning: the base model is frozen (4-bit with --quantize), adapters train."""

from pathlib import Path
from typing import List, Literal, Optional, Union

from litft.args import DeepSpeedArgs, EvalArgs, FSDPArgs, TrainArgs
from litft.data.base import DataModule
from litft.jobs.run import LoraSpec, RunResult, execute, make_run
from litft.strategy import Accelerator, Precision, Strategy
from litft.tiny import TINY_NAME


def finetune_lora(
    model: str = TINY_NAME,
    data: Optional[DataModule] = None,
    out_dir: Path = Path("out/finetune_lora"),
    precision: Optional[Precision] = None,
    devices: int = 1,
    num_nodes: int = 1,
    strategy: Strategy = "auto",
    fsdp: FSDPArgs = FSDPArgs(),
    deepspeed: DeepSpeedArgs = DeepSpeedArgs(),
    accelerator: Accelerator = "auto",
    quantize: Optional[Literal["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq"]] = None,
    lora_r: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.05,
    lora_target_modules: Union[str, List[str]] = "all-linear",
    train: TrainArgs = TrainArgs(global_batch_size=32, micro_batch_size=8, learning_rate=1e-3, warmup_steps=20),
    eval: EvalArgs = EvalArgs(interval=200, score_samples=0),
    seed: int = 42,
    overwrite: bool = False,
    resume: Optional[str] = None,
) -> RunResult:
    """Train LoRA adapters on a frozen causal LM; out_dir/final-adapter holds them, out_dir/final the merged model.

    Args:
        model: Hugging Face hub id or local model folder (litft-tiny is built locally).
        data: Training data (default: TinyTasks, generated here).
        out_dir: Folder for logs, the run's config, the adapter and the merged model.
        precision: 32-true, bf16-mixed, bf16-true or 16-mixed (default: bf16-mixed on GPUs that have it, else 32-true).
        devices: Processes (GPUs) per node.
        num_nodes: Nodes taking part.
        strategy: auto (one device, or DDP for several), ddp, fsdp (FSDP2, sharded per block) or deepspeed (ZeRO).
        fsdp: Sharding options for --strategy fsdp.
        deepspeed: ZeRO stage, offload and config file for --strategy deepspeed.
        accelerator: auto, cpu or cuda.
        quantize: Load the frozen base in 4 bits with bitsandbytes (QLoRA); -dq also quantizes the scales.
        lora_r: Rank of the adapters.
        lora_alpha: Adapter scale numerator (the update is scaled by alpha / r).
        lora_dropout: Dropout on the adapters' input.
        lora_target_modules: Module names to adapt, or "all-linear" for every linear layer but the output head.
        train: Batch, schedule and run length.
        eval: Validation cadence and scoring.
        seed: Seeds the adapters' init, the data order and dropout.
        overwrite: Replace the final model, logs and checkpoints of an earlier litft run in out_dir (nothing else there is touched).
        resume: Continue from a checkpoint: "auto" takes the newest finished one in out_dir (or starts afresh if there is none), or a checkpoint folder's path.
    """
    arguments = dict(locals())  # the flags as given: recorded in run_config.yaml
    from litft.lora import apply_lora

    lora = LoraSpec(r=lora_r, alpha=lora_alpha, dropout=lora_dropout, target_modules=lora_target_modules)
    run = make_run("finetune_lora", arguments, lora=lora, quantize=quantize)
    return execute(
        run,
        transform=lambda m: apply_lora(
            m, lora_r, lora_alpha, lora_dropout, lora_target_modules,
            quantized=quantize is not None, gradient_checkpointing=train.gradient_checkpointing,
        ),
    )
