"""Weights & Biases and MLflow as Fabric loggers: metrics on rank 0, the run's config once, one run continued across resumes.

Both are optional packages (``pip install 'litft[wandb]'``, ``'litft[mlflow]'``),
imported when a run asks for them. Each keeps the id of its run in
``out_dir/logs``, so a resumed run logs into the run it continues.
"""

import importlib
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Optional

from lightning_fabric.loggers import Logger
from lightning_fabric.utilities.rank_zero import rank_zero_only

from litft.errors import LitftError


def flat(params: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Nested flag groups as dotted names, the way they are given on the command line."""
    out: Dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def optional_package(name: str, extra: str):
    """An optional extra, imported when a run asks for it; if absent, one line that says what to install."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise LitftError(f"--logger_name {extra} needs the {name.split('.')[0]} package: pip install 'litft[{extra}]'") from None


class Tracker(Logger):
    """What both share: the run id kept in a file under out_dir/logs, a lazily started run, and rank-zero logging."""

    kind = ""

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir)
        self.id_file = self.out_dir / "logs" / f"{self.kind}-run-id"
        self._run_id: Optional[str] = None
        self.continued = False  # whether the run existed before this launch

    @property
    def name(self) -> str:
        return self.kind

    @property
    def version(self) -> Optional[str]:
        return self._run_id

    def run_id(self) -> str:
        """This run's id: the one an earlier launch into out_dir recorded, or a new one."""
        if self._run_id is None:
            self.continued = self.id_file.is_file()
            self._run_id = self.id_file.read_text().strip() if self.continued else self.start()
            self.id_file.parent.mkdir(parents=True, exist_ok=True)
            self.id_file.write_text(self._run_id)
        return self._run_id

    def start(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError


class WandbTracker(Tracker):
    """Weights & Biases: online, or offline with ``WANDB_MODE=offline`` (files under out_dir/logs/wandb, ``wandb sync`` later)."""

    kind = "wandb"

    def __init__(self, out_dir: Path):
        super().__init__(out_dir)
        self.wandb = optional_package("wandb", self.kind)
        self.run = None

    def start(self) -> str:
        return uuid.uuid4().hex[:12]

    def experiment(self):
        if self.run is None:
            folder = self.out_dir / "logs"
            folder.mkdir(parents=True, exist_ok=True)
            self.run = self.wandb.init(
                project=os.environ.get("WANDB_PROJECT", "litft"), name=self.out_dir.name, dir=str(folder), id=self.run_id(), resume="allow",
                settings=self.wandb.Settings(silent=True),  # its banner and summary; litft says where the run is in one line
            )
            # Charts follow litft's step, so a resumed run's steps line up with the first launch's.
            self.run.define_metric("*", step_metric="step")
            offline = self.run.settings.mode in ("offline", "dryrun")
            where = f"{self.run.settings.sync_dir} (offline; upload it with wandb sync)" if offline else self.run.url
            print(f"wandb: run {self.run.id} at {where}", file=sys.stderr, flush=True)
        return self.run

    @rank_zero_only
    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        self.experiment().log({**metrics, "step": step})

    @rank_zero_only
    def log_hyperparams(self, params: Dict[str, Any], *args, **kwargs) -> None:
        self.experiment().config.update(flat(params), allow_val_change=True)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "success" else 1)
            self.run = None


class MLflowTracker(Tracker):
    """MLflow: ``MLFLOW_TRACKING_URI`` if set, else a file store in out_dir/logs/mlruns; experiment ``MLFLOW_EXPERIMENT_NAME`` or litft."""

    kind = "mlflow"

    def __init__(self, out_dir: Path):
        super().__init__(out_dir)
        entities, tracking = optional_package("mlflow.entities", self.kind), optional_package("mlflow.tracking", self.kind)
        self.Metric, self.Param, self.Client = entities.Metric, entities.Param, tracking.MlflowClient
        self._client = None

    @property
    def client(self):
        """Made on first use: a file store creates its folder, and out_dir is checked before anything is written."""
        if self._client is None:
            uri = os.environ.get("MLFLOW_TRACKING_URI")
            if not uri:
                # MLflow keeps its file store only on request; it is the one that needs no server or database.
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
                uri = (self.out_dir / "logs" / "mlruns").resolve().as_uri()
            self._client = self.Client(tracking_uri=uri)
        return self._client

    def start(self) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "litft")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        return self.client.create_run(experiment_id, run_name=self.out_dir.name).info.run_id

    @rank_zero_only
    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id(), metrics=[self.Metric(k, float(v), now, step or 0) for k, v in metrics.items()])

    @rank_zero_only
    def log_hyperparams(self, params: Dict[str, Any], *args, **kwargs) -> None:
        run_id = self.run_id()
        self.client.log_dict(run_id, params, "run_config.yaml")
        if not self.continued:  # MLflow's params cannot change; a resumed run's config is in the artifact
            self.client.log_batch(run_id, params=[self.Param(k, str(v)[:6000]) for k, v in flat(params).items()])

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._run_id is not None:
            self.client.set_terminated(self._run_id, "FINISHED" if status == "success" else "FAILED")


TRACKERS = {"wandb": WandbTracker, "mlflow": MLflowTracker}
