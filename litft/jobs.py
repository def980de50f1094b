"""The three jobs: flat flags for the CLI (declared once in ``litft.flags``), one validated ``RunSpec``, one trainer.

The jobs differ only in what they hand the trainer: which weights train (all, or
LoRA adapters on a frozen, possibly 4-bit base), where the first weights come from
(a checkpoint, or a seeded random init) and the default data.
"""

import shutil
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Optional, Tuple

from litft.checkpoint.format import RUN_CONFIG
from litft.config import EvalArgs, Layout, LoraArgs, TrainArgs
from litft.data.base import DataModule, data_config
from litft.data.tiny import TinyTasks
from litft.errors import LitftError
from litft.flags import DATA, EVAL, LAUNCHER, LORA, MODEL, MODEL_OPTIONS, OUT_DIR, PARALLEL, RUN_CONTROL, SEED, TRAIN, WATCHING, Flag, command
from litft.ray_launch import run_on_ray
from litft.ray_worker import inside_worker
from litft.trainer import RunResult, run_job

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
    compile: bool = False
    kernels: str = "auto"
    lora: Optional[LoraArgs] = None
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
        flags = dict(flags, data=flags["data"] or default_data or TinyTasks())
        lora = None
        if "lora_r" in flags:
            lora = LoraArgs(
                flags["lora_r"], flags["lora_alpha"], flags["lora_dropout"], flags["lora_target_modules"], flags["quantize"], flags["export"]
            )
        layout = Layout(flags["strategy"], flags["devices"], flags["num_nodes"], flags["fsdp"], flags["deepspeed"])
        common = dict(
            job=job, model=flags["model"], data=flags["data"], out_dir=Path(flags["out_dir"]), precision=flags["precision"],
            accelerator=flags["accelerator"], attn_implementation=flags["attn_implementation"], compile=flags["compile"], kernels=flags["kernels"],
            layout=layout, train=flags["train"], eval=flags["eval"], seed=flags["seed"],
            lora=lora, overwrite=flags["overwrite"], resume=flags["resume"], profile=flags["profile"], launcher=flags["launcher"],
            loggers=(flags["logger_name"],) if isinstance(flags["logger_name"], str) else tuple(flags["logger_name"]),
            recorded=config_of({k: v for k, v in flags.items() if k not in ("overwrite", "resume")}),
        )
        return cls(**{**common, **job_fields})

    def check(self) -> Optional[str]:
        """The flags' own checks (the layout's need the accelerator and are made when the run starts).

        A global batch left out is derived from the world size; the line saying so is returned.
        """
        self.layout.check()  # the world size comes first: the batch checks divide by it
        if self.train.micro_batch_size < 1:
            raise LitftError("--train.global_batch_size and --train.micro_batch_size must be at least 1")
        self.train, note = self.train.resolved(self.layout.world_size)
        self.train.check(self.layout.world_size)
        self.eval.check(instruction_data=hasattr(self.data, "prompted"))
        self.data.check()
        if getattr(self.data, "streaming", False) and self.train.max_steps is None:
            raise LitftError("--data.streaming true needs --train.max_steps: a stream's length is not known in advance")
        if not 0 <= self.seed < 2**32:
            raise LitftError(f"--seed must be in [0, 2**32) (what numpy and torch accept), got {self.seed}")
        if self.lora is not None:
            self.lora.check()
        if self.resume is not None and self.overwrite:
            raise LitftError("--overwrite true deletes the checkpoints that --resume continues from; pass only one of them")
        return note

    def check_out_dir(self) -> None:
        """Refuse an out_dir with files in it, unless it is an earlier litft run and --overwrite or --resume was given."""
        out = self.out_dir
        if out.exists() and not out.is_dir():
            raise LitftError(f"--out_dir {out} is a file; choose a folder")
        if not out.exists() or not any(out.iterdir()):
            return
        if not (out / RUN_CONFIG).is_file():
            raise LitftError(f"--out_dir {out} holds files that litft did not write; choose another --out_dir")
        if self.resume is not None:
            return  # continuing the run that is there
        if not self.overwrite:
            raise LitftError(f"--out_dir {out} already holds a run; choose another --out_dir, pass --resume auto to continue it or --overwrite true")
        # Only what a litft run writes is replaced; anything else the user put there stays.
        for name in ("final", "final-adapter", "logs", "checkpoints"):
            shutil.rmtree(out / name, ignore_errors=True)


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


def _job_flags(default_out: str, train: TrainArgs, validation: EvalArgs, middle=(), head=(MODEL, DATA), **help) -> list:
    """A job's flags in CLI order, with its own defaults for out_dir, train and eval, and its own wording where ``help`` gives it."""
    out = OUT_DIR.but(default=Path(default_out), help=help.get("out_dir", OUT_DIR.help))
    tail = [TRAIN.but(default=train), EVAL.but(default=validation, help=help.get("eval", EVAL.help))]
    seeded = [SEED.but(help=help["seed"]) if f is SEED and "seed" in help else f for f in RUN_CONTROL]
    return [*head, out, *PARALLEL, LAUNCHER, *MODEL_OPTIONS, *middle, *tail, *WATCHING, *seeded]


def start(spec: RunSpec) -> RunResult:
    """Run the job here (and in the processes litft or a launcher starts), or on Ray's workers."""
    if spec.launcher == "ray" and not inside_worker():
        return run_on_ray(spec)
    return run_job(spec)


FINETUNE_TRAIN = dict(micro_batch_size=8, warmup_steps=20)


@command(_job_flags("out/finetune_full", TrainArgs(**FINETUNE_TRAIN, learning_rate=3e-3), EvalArgs(interval=200)))
def finetune_full(**flags) -> RunResult:
    """Train all weights of a causal LM on instruction data; the result lands in out_dir/final."""
    return start(RunSpec.from_flags("finetune_full", flags))


LORA_HELP = dict(
    out_dir="Folder for logs, the run's config, the adapter and (--export merged) the merged model.", seed="Seeds the adapters' init, the data order and dropout."
)


@command(_job_flags("out/finetune_lora", TrainArgs(**FINETUNE_TRAIN, learning_rate=1e-3), EvalArgs(interval=200), middle=LORA, **LORA_HELP))
def finetune_lora(**flags) -> RunResult:
    """Train LoRA adapters on a frozen causal LM; out_dir/final-adapter holds them (out_dir/final the merged model with --export merged or both)."""
    return start(RunSpec.from_flags("finetune_lora", flags))


PRETRAIN_HEAD = (
    MODEL.but(help="Hub id, model folder, or config.json file giving the architecture (and the weights with init=pretrained)."),
    Flag("init", str, "random", "random (a fresh model of that config) or pretrained (continue from its weights)."),
    Flag("tokenizer", Optional[str], None, "Where the tokenizer comes from (default: the model argument)."),
    DATA.but(help="Training text (default: TinyTasks rendered as plain text, generated here)."),
)


PRETRAIN_HELP = dict(eval="Validation cadence.", seed="Seeds the initial weights, the data order and dropout.")


@command(_job_flags("out/pretrain", TrainArgs(**FINETUNE_TRAIN, learning_rate=3e-3), EvalArgs(interval=200), head=PRETRAIN_HEAD, **PRETRAIN_HELP))
def pretrain(**flags) -> RunResult:
    """Pretrain a causal LM on text, from random weights or from a checkpoint's weights."""
    init, model = flags["init"], flags["model"]
    if init not in ("random", "pretrained"):
        raise LitftError(f"--init {init} is unknown; choose random or pretrained")
    source = model
    if model.endswith(".json") and Path(model).is_file():
        # A bare config file: transformers reads the architecture from its folder.
        if init == "pretrained":
            raise LitftError("--init pretrained needs a model folder or hub id with weights, not a config.json file")
        source = str(Path(model).parent)
    # Without data, the tiny tasks as plain text: every token trained, samples packed.
    spec = RunSpec.from_flags(
        "pretrain", flags, model=source, random_init=init == "random", tokenizer=flags["tokenizer"],
        default_data=TinyTasks(mask_prompt=False, packing=True),
    )
    return start(spec)


JOBS = {"pretrain": pretrain, "finetune_lora": finetune_lora, "finetune_full": finetune_full}

# Each job's default data as flags, so that its options (--data.num_train 64) can be given without naming it.
DEFAULT_DATA_FLAGS = {
    "pretrain": ["--data", "TinyTasks", "--data.mask_prompt", "false", "--data.packing", "true"],
    "finetune_lora": ["--data", "TinyTasks"],
    "finetune_full": ["--data", "TinyTasks"],
}
