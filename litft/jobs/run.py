"""What the three jobs share: check flags, build Fabric, load, hand everything to ``fit``, export."""

import os
import shutil
import time
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Callable, List, Optional, Union

import torch
import yaml

from litft.args import DeepSpeedArgs, EvalArgs, FSDPArgs, TrainArgs
from litft.data.base import DataModule
from litft.errors import LitftError
from litft.ranks import on_every_rank, on_rank_zero, rank_zero_first


@dataclass
class LoraSpec:
    r: int
    alpha: int
    dropout: float
    target_modules: Union[str, List[str]]


@dataclass
class Run:
    """Everything one job asked for, after its signature's defaults were filled in."""

    job: str
    model: str
    data: DataModule
    out_dir: Path
    precision: Optional[str]
    devices: int
    num_nodes: int
    strategy: str
    accelerator: str
    seed: int
    overwrite: bool
    train: TrainArgs
    eval: EvalArgs
    fsdp: FSDPArgs = field(default_factory=FSDPArgs)
    deepspeed: DeepSpeedArgs = field(default_factory=DeepSpeedArgs)
    random_init: bool = False
    tokenizer: Optional[str] = None
    lora: Optional[LoraSpec] = None
    quantize: Optional[str] = None
    resume: Optional[str] = None
    cli_config: dict = field(default_factory=dict)


@dataclass
class RunResult:
    """What a finished job leaves: the trained module's HF model and the loop's record."""

    model: torch.nn.Module
    history: list
    out_dir: Path
    final_dir: Optional[Path]  # None when a stop signal ended the run before its export


def check_flags(run: Run) -> None:
    """Reject impossible combinations before any process starts or any file is touched."""
    train, world = run.train, run.devices * run.num_nodes
    if run.devices < 1 or run.num_nodes < 1:
        raise LitftError("--devices and --num_nodes must be at least 1")
    if train.micro_batch_size < 1 or train.global_batch_size < 1:
        raise LitftError("--train.global_batch_size and --train.micro_batch_size must be at least 1")
    if train.global_batch_size % (train.micro_batch_size * world):
        raise LitftError(
            f"--train.global_batch_size {train.global_batch_size} is not divisible by micro_batch_size x world size "
            f"({train.micro_batch_size} x {world} = {train.micro_batch_size * world}); change one of them"
        )
    for name in ("epochs", "max_steps", "max_tokens", "stop_after_steps"):
        if getattr(train, name) is not None and getattr(train, name) < 1:
            raise LitftError(f"--train.{name} must be at least 1 (or null for no limit)")
    if train.log_interval < 1:
        raise LitftError("--train.log_interval must be at least 1")
    if train.peak_tflops is not None and not train.peak_tflops > 0:
        raise LitftError(f"--train.peak_tflops must be positive (one device's dense peak at the run's precision), got {train.peak_tflops}")
    if run.quantize is not None and run.lora is None:
        raise LitftError("--quantize trains 4-bit weights only through LoRA adapters; use finetune_lora")
    if train.save_interval is not None and train.save_interval < 1:
        raise LitftError("--train.save_interval must be at least 1 (or null to save only at the end)")
    if train.keep_checkpoints < 1:
        raise LitftError("--train.keep_checkpoints must be at least 1")
    if run.resume is not None and run.overwrite:
        raise LitftError("--overwrite true deletes the checkpoints that --resume continues from; pass only one of them")
    if run.eval.score_samples and not hasattr(run.data, "prompted"):
        raise LitftError("--eval.score_samples needs instruction data (prompts with answers); set it to 0 for plain text")


RUN_MARKER = "run_config.yaml"


def check_out_dir(run: Run) -> None:
    """Refuse an out_dir with files in it, unless it is an earlier litft run and --overwrite or --resume was given."""
    out = run.out_dir
    if out.exists() and not out.is_dir():
        raise LitftError(f"--out_dir {out} is a file; choose a folder")
    if not out.exists() or not any(out.iterdir()):
        return
    if not (out / RUN_MARKER).is_file():
        raise LitftError(f"--out_dir {out} holds files that litft did not write; choose another --out_dir")
    if run.resume is not None:
        return  # continuing the run that is there
    if not run.overwrite:
        raise LitftError(f"--out_dir {out} already holds a run; choose another --out_dir, pass --resume auto to continue it or --overwrite true")
    # Only what a litft run writes is replaced; anything else the user put there stays.
    for name in ("final", "final-adapter", "logs", "checkpoints"):
        shutil.rmtree(out / name, ignore_errors=True)


def execute(run: Run, transform: Optional[Callable] = None) -> RunResult:
    """The single path every job takes, from flags to an exported model."""
    from litft.cluster import apply_launcher_env, join_torchrun_group, leave_process_group, preflight, restarted
    from litft.strategy import build_fabric, resolve_accelerator, resolve_precision

    started = time.perf_counter()
    quiet_libraries()
    run.devices, run.num_nodes = apply_launcher_env(run.devices, run.num_nodes)
    preflight(run.devices, run.num_nodes)  # a wrong world explains every later complaint, so it goes first
    check_flags(run)
    if run.resume is None and restarted():
        run.resume = "auto"  # a launcher brought the run back: continue from its newest checkpoint
    accelerator = resolve_accelerator(run.accelerator)
    precision = resolve_precision(run.precision, accelerator)
    layout = layout_of(run)
    layout.check(accelerator, precision)
    fabric = build_fabric(accelerator=accelerator, layout=layout, precision=precision, train=run.train, out_dir=run.out_dir)
    join_torchrun_group(accelerator)
    fabric.launch()
    failed = True
    try:
        result = _launched(run, fabric, precision, transform, started)
        failed = False
        return result
    finally:
        leave_process_group(fabric, failed)


def _launched(run: Run, fabric, precision: str, transform: Optional[Callable], started: float) -> RunResult:
    """Everything after the processes have met, on every rank."""
    from litft.checkpoint import resolve_resume
    from litft.cluster import PeerWatch, StopSignals
    from litft.flops import StepFlops
    from litft.loop import fit, plan_steps
    from litft.model import load_tokenizer, resolve_model
    from litft.strategy import continue_logs, is_fsdp, numel, param_dtype, replica_divergence, setup_training

    def prepare():
        if fabric.global_rank == 0:
            check_out_dir(run)
        resume_from = resolve_resume(run.resume, run.out_dir)
        source = resolve_model(run.model)
        tokenizer = load_tokenizer(resolve_model(run.tokenizer) if run.tokenizer else source)
        return source, tokenizer, run.data.load_or_tokenize(tokenizer, run.seed), resume_from

    source, tokenizer, data, resume_from = rank_zero_first(fabric, prepare, "loading the tokenizer and data")

    def record_config():
        run.out_dir.mkdir(parents=True, exist_ok=True)
        (run.out_dir / RUN_MARKER).write_text(yaml.safe_dump(run.cli_config, sort_keys=False))

    on_rank_zero(fabric, record_config, "writing the run's config")

    if len(data.train) < run.train.global_batch_size:
        raise LitftError(
            f"the training data has {len(data.train)} samples, fewer than one global batch ({run.train.global_batch_size}); add data or lower --train.global_batch_size"
        )
    mean_tokens = sum(len(s["input_ids"]) for s in data.train) / len(data.train)
    total_steps = plan_steps(run.train, len(data.train), mean_tokens)
    fabric.seed_everything(run.seed)
    lm = build_module(run, source, precision, fabric.device, transform, total_steps)
    if not is_fsdp(fabric):
        lm.materialize(lm)  # FSDP fills the model block by block while it shards it
    module, optimizer, scheduler = setup_training(fabric, lm, move_to_device=run.quantize is None)
    model = lm.model
    fabric.print(
        f"{run.job}: {sum(numel(p) for p in model.parameters()):,} parameters, "
        f"{sum(numel(p) for p in model.parameters() if p.requires_grad):,} trained; "
        f"{len(data.train)} train / {len(data.val)} val samples; world size {fabric.world_size}; precision {precision}"
    )
    checkpointer = make_checkpointer(run, fabric, lm, optimizer, scheduler, len(data.train))
    state = None
    if resume_from is not None:
        on_every_rank(fabric, lambda: checkpointer.check_fits(resume_from), "checking the checkpoint to resume from")
        state = checkpointer.load(resume_from)
        continue_logs(fabric, state.step)
        fabric.print(f"resumed from {resume_from}: step {state.step} of {total_steps}, {state.tokens:,} tokens seen")
    sample_log = None
    if run.train.record_sample_ids:
        sample_log = run.out_dir / "logs" / "samples" / f"rank-{fabric.global_rank:05d}.jsonl"
        sample_log.parent.mkdir(parents=True, exist_ok=True)
    with StopSignals() as stop, PeerWatch.for_run(fabric, run.devices) as watch:
        state = fit(
            fabric, module, optimizer, scheduler, data, run.train, run.eval, run.seed, tokenizer, total_steps,
            state=state, checkpointer=checkpointer, sample_log=sample_log, stop=stop, watch=watch,
            flops=StepFlops.for_model(model, precision, fabric.device, run.train.peak_tflops, say=fabric.print),
        )
    if state.stopped_by:
        saved = f"checkpoint {checkpointer.last_path}" if checkpointer.last_path else "no checkpoint (no step was trained)"
        fabric.print(f"{run.job} stopped by {state.stopped_by} after step {state.step}: {saved}; continue with --resume auto")
        return RunResult(model=lm.model, history=state.history, out_dir=run.out_dir, final_dir=None)

    divergence = replica_divergence(fabric, lm)
    if divergence is not None:
        # Replicas that drifted apart would mean gradients were not averaged across them.
        fabric.log_dict({"replica_max_abs_diff": divergence}, step=state.step)
        fabric.print(f"replicas in step: largest parameter difference between replica groups {divergence:.3g}")
    final_dir = run.out_dir / "final"

    def export_final():
        # From the final checkpoint, block by block: no rank gathers the whole model.
        from litft.convert import DTYPE_NAMES, export

        dtype = DTYPE_NAMES[param_dtype(precision)]
        export(checkpointer.last_path, final_dir, dtype=dtype)
        if run.lora is not None:
            export(checkpointer.last_path, run.out_dir / "final-adapter", merge_lora=False, dtype=dtype)

    on_rank_zero(fabric, export_final, "exporting the final model")
    scores = [h["val_score"] for h in state.history if "val_score" in h]
    if len(scores) >= 2:
        n = min(run.eval.score_samples, len(data.scoring))
        fabric.print(f"task score (exact match on {n} held-out prompts): {scores[0]:.3f} before, {scores[-1]:.3f} after")
    fabric.print(f"{run.job} finished {state.step} steps in {time.perf_counter() - started:.0f} s; model in {final_dir}")
    return RunResult(model=lm.model, history=state.history, out_dir=run.out_dir, final_dir=final_dir)


def make_checkpointer(run: Run, fabric, lm, optimizer, scheduler, num_train: int):
    """Saves and loads this run's checkpoints; ``meta`` is what a checkpoint must agree with to be resumed."""
    from litft.checkpoint import FORMAT_VERSION, Checkpointer, model_fingerprint, trained_shapes
    from litft.strategy import is_deepspeed

    deepspeed = is_deepspeed(fabric)
    meta = {
        "format_version": FORMAT_VERSION,
        "job": run.job,
        "model": run.model,
        "quantize": run.quantize,
        "format": "deepspeed" if deepspeed else "dcp",
        "strategy": run.strategy,
        "zero_stage": fabric.strategy.config["zero_optimization"].get("stage", 0) if deepspeed else None,
        "model_fingerprint": model_fingerprint(lm.hf_model.config),
        "trained_shapes": trained_shapes(lm),
        "global_batch_size": run.train.global_batch_size,
        "num_train_samples": num_train,
        "seed": run.seed,
    }
    return Checkpointer(
        fabric, lm, optimizer, scheduler, run.out_dir, run.train.save_interval, run.train.keep_checkpoints, meta, run.cli_config
    )


def layout_of(run: Run):
    from litft.strategy import Parallelism

    return Parallelism(run.strategy, run.devices, run.num_nodes, run.fsdp, run.deepspeed)


def build_module(run: Run, source: str, precision: str, device, transform: Optional[Callable], total_steps: int):
    """The LightningModule with the model built on the meta device, LoRA applied, ready to be materialized.

    A quantized base is the exception: bitsandbytes quantizes while loading, so it
    is loaded for real onto its device.
    """
    from litft.lora import quantization_config
    from litft.model import CausalLM, load_causal_lm, load_config
    from litft.strategy import compute_dtype, param_dtype
    from litft.weights import CheckpointWeights, Materializer, locate_checkpoint, skeleton

    if run.quantize is not None:
        model = load_causal_lm(
            source, random_init=False, dtype=param_dtype(precision),
            quantization_config=quantization_config(run.quantize, compute_dtype(precision)), device=device,
        )
    else:
        model = skeleton(load_config(source), param_dtype(precision))
    if run.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if transform is not None:
        model = transform(model)
    lm = CausalLM(model, run.train, total_steps=total_steps)
    if run.quantize is None:
        weights = None if run.random_init else CheckpointWeights(locate_checkpoint(source))
        lm.materialize = Materializer(lm.model, lm.hf_model, weights, run.seed)
    return lm


def quiet_libraries() -> None:
    """Silence progress bars and advice that libraries print on every rank."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


COMMON_FIELDS = (
    "model", "data", "out_dir", "precision", "devices", "num_nodes", "strategy", "accelerator", "seed", "overwrite", "train", "eval",
    "fsdp", "deepspeed", "resume",
)


def make_run(job: str, arguments: dict, **job_fields) -> Run:
    """A Run from a job function's own arguments (its ``locals()``), plus what only that job sets.

    The arguments, minus ``overwrite`` and ``resume``, are also what ``run_config.yaml`` records.
    """
    from litft.data.tiny import TinyTasks

    arguments = dict(arguments)
    default_data = job_fields.pop("default_data", None)
    if arguments["data"] is None:
        arguments["data"] = default_data or TinyTasks()
    recorded = config_of(**{k: v for k, v in arguments.items() if k not in ("overwrite", "resume")})
    common = {name: arguments[name] for name in COMMON_FIELDS}
    common.update({k: v for k, v in job_fields.items() if k in common})
    extra = {k: v for k, v in job_fields.items() if k not in common}
    return Run(job=job, cli_config=recorded, **common, **extra)


def config_of(**values) -> dict:
    """The job's arguments as YAML-ready data that ``--config`` reads back."""
    out = {}
    for key, value in values.items():
        if isinstance(value, DataModule):
            import litft.data

            name = type(value).__name__
            module = "litft.data" if getattr(litft.data, name, None) is type(value) else type(value).__module__
            out[key] = {"class_path": f"{module}.{name}", "init_args": value.config_dict()}
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
