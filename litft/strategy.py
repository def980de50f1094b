"""The one place where flags become a Fabric: accelerator, strategy, precision, loggers.

Model and loop code never look at ranks or meshes; they get a Fabric from here.
New strategies (FSDP, DeepSpeed) are added to ``STRATEGIES`` and ``make_strategy``.
"""

from pathlib import Path
from typing import Literal, Optional

import torch

from litft.errors import LitftError

Strategy = Literal["auto", "ddp"]
Precision = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed"]
Accelerator = Literal["auto", "cpu", "cuda", "gpu"]
STRATEGIES = ("auto", "ddp")


def resolve_accelerator(accelerator: str) -> str:
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator in ("cuda", "gpu") and not torch.cuda.is_available():
        raise LitftError(f"--accelerator {accelerator} was asked for but no CUDA device is visible; use --accelerator cpu")
    return "cuda" if accelerator == "gpu" else accelerator


def resolve_precision(precision: Optional[str], accelerator: str) -> str:
    """bf16-mixed where the GPU supports it, full fp32 elsewhere, unless the user chose."""
    if precision is None:
        if accelerator == "cuda" and torch.cuda.is_bf16_supported():
            return "bf16-mixed"
        return "32-true"
    if precision == "16-mixed" and accelerator == "cpu":
        raise LitftError("--precision 16-mixed needs a GPU (fp16 autocast is not supported on the CPU); use bf16-mixed or 32-true")
    return precision


def param_dtype(precision: str) -> torch.dtype:
    """The dtype weights are loaded in: the low-precision one for *-true, fp32 under autocast."""
    return {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision, torch.float32)


def compute_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") else torch.float32


def make_strategy(strategy: str, accelerator: str, world_size: int):
    if strategy not in STRATEGIES:
        raise LitftError(f"--strategy {strategy} is unknown; choose one of {', '.join(STRATEGIES)}")
    if strategy == "auto" and world_size == 1:
        return "auto"
    from lightning.fabric.strategies import DDPStrategy

    # gloo is the only backend that works on the CPU; NCCL on GPUs.
    return DDPStrategy(process_group_backend="nccl" if accelerator == "cuda" else "gloo")


def build_fabric(*, accelerator: str, devices: int, num_nodes: int, strategy: str, precision: str, out_dir: Optional[Path]):
    """A Fabric with CSV and TensorBoard loggers under ``out_dir/logs``."""
    import lightning as L
    from lightning.fabric.loggers import CSVLogger, TensorBoardLogger

    loggers = []
    if out_dir is not None:
        loggers = [
            CSVLogger(root_dir=str(out_dir), name="logs", version="csv", flush_logs_every_n_steps=1),
            TensorBoardLogger(root_dir=str(out_dir), name="logs", version="tensorboard"),
        ]
    return L.Fabric(
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=make_strategy(strategy, accelerator, devices * num_nodes),
        precision=precision,
        loggers=loggers,
    )
