"""Where a run's metrics go (CSV always, TensorBoard, W&B, MLflow under out_dir/logs), and the library noise kept off its screen."""

import csv
import logging
import os
import warnings
from pathlib import Path
from typing import List, Optional, Sequence

import lightning_utilities.core.rank_zero as lightning_rank_zero
import transformers
from lightning_fabric.loggers import CSVLogger, TensorBoardLogger

from litft.run.trackers import TRACKERS


class ContinuingCSVLogger(CSVLogger):
    """Lightning's CSV logger, except that a resumed run continues the earlier run's metrics.csv.

    Lightning deletes an existing file; here its rows up to the resumed step are kept
    (later ones were logged by the run that died after its last checkpoint).
    """

    resumed_step: Optional[int] = None

    @property
    def experiment(self):
        if self._experiment is not None:
            return self._experiment
        previous = Path(self.log_dir) / "metrics.csv"
        rows, keys = [], []
        if self.resumed_step is not None and previous.is_file():
            with open(previous, newline="") as f:
                reader = csv.DictReader(f)
                keys = list(reader.fieldnames or [])
                rows = [r for r in reader if r.get("step") and int(float(r["step"])) <= self.resumed_step]
        writer = super().experiment
        if rows and hasattr(writer, "metrics_keys"):
            with open(previous, "w", newline="") as f:
                out = csv.DictWriter(f, fieldnames=keys)
                out.writeheader()
                out.writerows(rows)
            writer.metrics_keys = keys
        return writer


    def log_hyperparams(self, params, *args, **kwargs) -> None:
        """The run's config is out_dir/run_config.yaml; Lightning's CSV logger has no place for it."""


def make_loggers(out_dir: Optional[Path], names: Sequence[str] = ("tensorboard",)) -> List:
    """CSV always (litft's plot and tests read it), and those of TensorBoard, W&B and MLflow that ``names`` asks for."""
    if out_dir is None:
        return []
    loggers = [ContinuingCSVLogger(root_dir=str(out_dir), name="logs", version="csv", flush_logs_every_n_steps=1)]
    if "tensorboard" in names:
        loggers.append(TensorBoardLogger(root_dir=str(out_dir), name="logs", version="tensorboard"))
    return loggers + [TRACKERS[name](out_dir) for name in names if name in TRACKERS]


def log_config(fabric, config: dict) -> None:
    """The run's flags, as run_config.yaml holds them, to every logger (each logs on rank 0)."""
    for logger in fabric.loggers:
        logger.log_hyperparams(config)


def close_loggers(fabric, failed: bool) -> None:
    """Let every logger finish its run (W&B and MLflow mark it finished or failed)."""
    for logger in fabric.loggers:
        logger.finalize("failed" if failed else "success")


def continue_logs(fabric, step: int) -> None:
    """Tell the CSV logger that this run resumes after ``step`` (before anything is logged)."""
    for logger in fabric.loggers:
        if isinstance(logger, ContinuingCSVLogger):
            logger.resumed_step = step


class KnownNoise(logging.Filter):
    """Drops Lightning's process-group banners (one per rank, and a framed one); litft's own line gives the world size."""

    MESSAGES = ("Initializing distributed: GLOBAL_RANK", "All distributed processes registered", "initializing deepspeed distributed: GLOBAL_RANK")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.MESSAGES)


def quiet_libraries() -> None:
    """Silence progress bars and known advice that libraries print on every rank, when a run starts."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # datasets is quieted where litft imports it (litft.data.hf.hf_datasets).
    # Lightning's CSV logger says this whenever logs/ has files; ContinuingCSVLogger keeps them on purpose.
    warnings.filterwarnings("ignore", message=".*Experiment logs directory .* exists and is not empty.*")
    # transformers' own name change, said whenever peft or a model asks the old name: advice for them, not the user.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    # DCP says this on every single-process save and load.
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")
    # litft joins srun's tasks itself (litft/launch/cluster.py), so Lightning's advice to prepend srun does not apply.
    warnings.filterwarnings("ignore", message=".*The `srun` command is available on your system but is not used.*")
    # DeepSpeed calls torch's old collective names on every step; advice for DeepSpeed, not the user.
    warnings.filterwarnings(
        "ignore", message=r".*`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated.*", category=FutureWarning
    )
    # Lightning's rank-zero messages go to whichever logger its last imported package installed.
    loggers = ("lightning_fabric.utilities.distributed", "lightning_fabric.strategies.deepspeed")
    for logger in (*map(logging.getLogger, loggers), lightning_rank_zero.log):
        if not any(isinstance(f, KnownNoise) for f in logger.filters):
            logger.addFilter(KnownNoise())
