"""What a job asked for and what it leaves: the layer below the trainer, the launchers and the jobs.

``RunSpec`` holds a job's flags as typed groups, checked before any process
starts; every layer above reads it, none below it.
"""

from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import List, Optional, Tuple, Union

import torch

from litft.config import EvalArgs, Layout, LoraArgs, TrainArgs
from litft.objectives.args import ObjectiveArgs
from litft.data.base import DataModule, data_config
from litft.data.tiny import TinyTasks
from litft.errors import LitftError
from litft.model.fp8 import check_recipe
from litft.objectives import FAMILIES
from litft.parallel.mesh import Mesh, layout_data_world


@dataclass
class RunSpec:
    """Everything one job asked for, as typed flag groups, checked before any process starts."""

    job: str
    model: str  # where the architecture (and weights) come from: a folder or a hub id
    data: DataModule
    out_dir: Path
    precision: Optional[str]
    accelerator: str
    layout: Layout
    train: TrainArgs
    eval: EvalArgs
    seed: int = 42
    attn_implementation: str = "auto"
    compile: Union[bool, str] = "auto"  # --compile as given; the trainer decides what it means here (litft.model.compiling.choose)
    fp8: Optional[str] = None  # torchao's float8 recipe, or None for the precision's own matmuls
    kernels: str = "auto"
    lora: Optional[LoraArgs] = None
    objective: ObjectiveArgs = field(default_factory=ObjectiveArgs)
    tokenizer: Optional[str] = None
    random_init: bool = False
    overwrite: bool = False
    resume: Optional[str] = None
    loggers: Tuple[str, ...] = ("tensorboard",)
    profile: bool = False
    launcher: str = "auto"
    recorded: dict = field(default_factory=dict)  # the flags as given: run_config.yaml, reusable with --config

    @classmethod
    def from_flags(cls, job: str, flags: dict, **job_fields) -> "RunSpec":
        """The spec of a job's own (flat) arguments, plus what only that job decides."""
        default_data = job_fields.pop("default_data", None)
        objective = ObjectiveArgs.of(flags.get("objective"))  # finetune_lora(objective="dpo") from Python, as --objective dpo
        default_data = FAMILIES[objective.name].default_data() or default_data
        flags = dict(flags, data=flags["data"] or default_data or TinyTasks(), objective=objective)
        lora = None
        if "lora_r" in flags:
            lora = LoraArgs(
                flags["lora_r"], flags["lora_alpha"], flags["lora_dropout"], flags["lora_target_modules"], flags["quantize"], flags["export"]
            )
        layout = Layout.of(flags)
        common = dict(
            job=job, model=flags["model"], data=flags["data"], out_dir=Path(flags["out_dir"]), precision=flags["precision"],
            accelerator=flags["accelerator"], attn_implementation=flags["attn_implementation"], compile=flags["compile"], fp8=flags["fp8"], kernels=flags["kernels"],
            layout=layout, train=flags["train"], eval=flags["eval"], seed=flags["seed"],
            lora=lora, objective=objective, overwrite=flags["overwrite"], resume=flags["resume"], profile=flags["profile"], launcher=flags["launcher"],
            loggers=(flags["logger_name"],) if isinstance(flags["logger_name"], str) else tuple(flags["logger_name"]),
            recorded=config_of({k: v for k, v in flags.items() if k not in ("overwrite", "resume")}),
        )
        return cls(**{**common, **job_fields})

    def check(self) -> Optional[str]:
        """Each flag group's own values (what the groups combine into, with the machine and the model, is refused by the run
        plan's table: litft.run.plan). A global batch left out is derived from the world size; the line saying so is returned."""
        self.layout.check()  # the world size comes first: the batch checks divide by it
        Mesh.check_groups_fit_nodes(self.layout)
        if self.train.micro_batch_size < 1:
            raise LitftError("--train.global_batch_size and --train.micro_batch_size must be at least 1")
        self.train, note = self.train.resolved(self.data_world)
        if not self.objective.rl:  # RL's global batch counts prompts and its micro-batches completions: no common multiple
            self.train.check(self.data_world)
        self.eval.check()
        self.data.check()
        if not 0 <= self.seed < 2**32:
            raise LitftError(f"--seed must be in [0, 2**32) (what numpy and torch accept), got {self.seed}")
        if self.lora is not None:
            self.lora.check()
        self.objective.check()
        check_recipe(self.fp8)
        return note

    @property
    def data_world(self) -> int:
        """Data-parallel ranks: those that take different samples."""
        return layout_data_world(self.layout)

    def final_exports(self) -> List[Tuple[str, Path]]:
        """What the end of the run writes, in order: LoRA's adapter first (the smallest, and it holds the training, so a
        disk too small for the merged model still gets it), then the model."""
        lora = self.lora
        exports = [("adapter", self.out_dir / "final-adapter")] if lora is not None and lora.writes_adapter else []
        if lora is None or lora.writes_merged:
            exports.append(("model", self.out_dir / "final"))
        return exports

    @property
    def resumes_inside_out_dir(self) -> bool:
        """Whether ``--resume`` continues from a checkpoint under out_dir (which ``--overwrite`` would delete)."""
        if self.resume is None:
            return False
        if self.resume == "auto":
            return True
        return Path(self.resume).expanduser().resolve().is_relative_to(self.out_dir.expanduser().resolve())


def config_of(values: dict) -> dict:
    """Arguments as YAML-ready data that ``--config`` reads back."""
    out = {}
    for key, value in values.items():
        if isinstance(value, DataModule):
            out[key] = data_config(value)
        else:
            out[key] = _plain(asdict(value) if is_dataclass(value) else value)
    return out


def _plain(value):
    """YAML-safe: paths as strings, tuples as lists, all the way down."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value


@dataclass
class RunResult:
    """What a finished job leaves: the trained module's HF model and the loop's record."""

    model: torch.nn.Module
    history: list
    out_dir: Path
    final_dir: Optional[Path]  # None when the run stopped early, before its export
