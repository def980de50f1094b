"""The three jobs: flat flags for the CLI (declared once in ``litft.cli.flags``), one validated ``RunSpec``, one trainer.

The jobs differ only in what they hand the trainer: which weights train (all, or
LoRA adapters on a frozen, possibly 4-bit base), where the first weights come from
(a checkpoint, or a seeded random init) and the default data.
"""

from pathlib import Path
from typing import Optional

from litft.config import EvalArgs, TrainArgs
from litft.data.tiny import TinyTasks
from litft.errors import LitftError
from litft.cli.flags import DATA, EVAL, LAUNCHER, LORA, MODEL, MODEL_OPTIONS, OBJECTIVE, OUT_DIR, PARALLEL, RUN_CONTROL, SEED, TRAIN, WATCHING, Flag, command
from litft.launch.ray_launch import run_on_ray
from litft.launch.ray_worker import inside_worker
from litft.run.spec import RunResult, RunSpec
from litft.run.trainer import run_job

def _job_flags(default_out: str, train: TrainArgs, validation: EvalArgs, middle=(), head=(MODEL, DATA), **help) -> list:
    """A job's flags in CLI order, with its own defaults for out_dir, train and eval, and its own wording where ``help`` gives it."""
    out = OUT_DIR.but(default=Path(default_out), help=help.get("out_dir", OUT_DIR.help))
    tail = [TRAIN.but(default=train), EVAL.but(default=validation, help=help.get("eval", EVAL.help))]
    seeded = [SEED.but(help=help["seed"]) if f is SEED and "seed" in help else f for f in RUN_CONTROL]
    return [*head, out, *PARALLEL, LAUNCHER, *MODEL_OPTIONS, *middle, *tail, *WATCHING, *seeded]


def start(spec: RunSpec) -> RunResult:
    """Run the job here (and in the processes litft or a launcher starts), or on Ray's workers."""
    if spec.launcher == "ray" and not inside_worker():
        return RunResult(model=None, history=[], out_dir=spec.out_dir, final_dir=run_on_ray(spec))
    return run_job(spec)


FINETUNE_TRAIN = dict(micro_batch_size=8, warmup_steps=20)


@command(_job_flags("out/finetune_full", TrainArgs(**FINETUNE_TRAIN, learning_rate=3e-3), EvalArgs(interval=200), middle=(OBJECTIVE,)))
def finetune_full(**flags) -> RunResult:
    """Train all weights of a causal LM on instruction data; the result lands in out_dir/final."""
    return start(RunSpec.from_flags("finetune_full", flags))


LORA_HELP = dict(
    out_dir="Folder for logs, the run's config, the adapter and (--export merged) the merged model.", seed="Seeds the adapters' init, the data order and dropout."
)


@command(_job_flags("out/finetune_lora", TrainArgs(**FINETUNE_TRAIN, learning_rate=1e-3), EvalArgs(interval=200), middle=(*LORA, OBJECTIVE), **LORA_HELP))
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
PREFERENCE_DATA_FLAGS = ["--data", "TinyPreferences"]  # the fine-tuning jobs' default data under a preference objective
