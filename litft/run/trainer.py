"""One run's parts, made once, in the order a cluster needs them; ``run_job`` is the single path of every job.

The order matters on a cluster: the launcher's world is checked before anything
loads (a wrong world explains every later complaint), the flags before any file is
touched, rank 0 tokenizes before the others read its cache, and the model is built
on the meta device and filled as the strategy shards it.
"""

import math
import os
import time
from pathlib import Path
from typing import List, Tuple

import lightning_fabric as L
import yaml
from lightning_fabric.plugins.environments import LightningEnvironment

from litft.model.attention import PACKED_SAFE
from litft.model.attention import choose as choose_attention
from litft.model.kernels import choose_kernels, describe_kernels
from litft.model.attention import describe as describe_attention
from litft.run.build import build_module
from litft.checkpoint import CheckpointMeta, Checkpointer, resolve_resume
from litft.checkpoint.convert import DTYPE_NAMES, export
from litft.checkpoint.format import RUN_CONFIG
from litft.model.compiling import CompileChoice, CompileStats
from litft.model.compiling import choose as choose_compile
from litft.launch.cluster import (
    apply_launcher_env, check_shared_out_dir, join_torchrun_group, launcher, leave_process_group, preflight, process_group_timeout, restarted,
)
from litft.data.base import PreparedData, mean_length
from litft.data.order import SampleOrder, StepBatches
from litft.data.stream import StreamSource
from litft.device import compute_dtype, cuda_allocator_defaults, map_large_host_allocations, param_dtype, resolve_accelerator, resolve_precision
from litft.errors import LitftError
from litft.model.experts import ExpertLoad
from litft.model.experts import describe as describe_experts
from litft.model.flops import StepFlops
from litft.model.fp8 import check as check_fp8
from litft.model.fp8 import describe as describe_fp8
from litft.model.generation import Generation
from litft.run.logs import close_loggers, continue_logs, log_config, make_loggers, quiet_libraries
from litft.run.loop import LoopState, fit
from litft.run.metrics import Cadence, SampleLog, StepMeter, StopRequests
from litft.model.recurrent import boundary_kernels, carries_state, describe as describe_recurrent
from litft.model.loading import check_architecture, keep_rotary_fp32, load_config, load_tokenizer, resolve_model
from litft.parallel.context import check_context_parallel
from litft.parallel.expert import check_expert_parallel
from litft.parallel.mesh import Mesh
from litft.parallel.strategies import checked_strategy_class
from litft.parallel.tensor import check_tensor_parallel
from litft.run.plot import plot_losses
from litft.run.profiling import StepProfiler
from litft.ranks import on_rank_zero, rank_zero_first
from litft.run.spec import RunResult, RunSpec
from litft.launch.watch import PeerWatch, StopSignals

def plan_steps(train, num_samples: int, mean_tokens: float, steps_per_batch: int = 1) -> int:
    """Optimizer steps the run will take: the first of max_steps, epochs and max_tokens to end it (``steps_per_batch``: RL's
    iterations on each batch of rollouts)."""
    steps_per_epoch = num_samples // train.global_batch_size * steps_per_batch
    limits = []
    if train.max_steps is not None:
        limits.append(train.max_steps)
    if train.epochs is not None:
        limits.append(train.epochs * steps_per_epoch)
    if train.max_tokens is not None:
        # Only an estimate for variable-length samples; the loop stops on the real count.
        limits.append(math.ceil(train.max_tokens / (train.global_batch_size * mean_tokens)))
    return max(1, min(limits)) if limits else max(1, steps_per_epoch)


class Trainer:
    """Owns a run's fabric, strategy, module, optimizer, scheduler, data, checkpointer and meter."""

    def __init__(self, spec: RunSpec, fabric, strategy, precision: str, attention: str, compiling: CompileChoice = CompileChoice(False, ""),
                 config=None):
        self.spec, self.fabric, self.strategy, self.precision, self.attention = spec, fabric, strategy, precision, attention
        self.compiling, self.config = compiling, config
        self.state = LoopState()
        self.context = strategy.mesh.place(fabric.global_rank)  # which samples this rank takes, and its slice of them
        self.stops = StopRequests()
        self.watch = PeerWatch.idle()

    @classmethod
    def launch(cls, spec: RunSpec) -> "Trainer":
        """Check the world and the flags, pick the strategy, and start (or join) the processes."""
        quiet_libraries()
        cuda_allocator_defaults()
        layout = spec.layout
        layout.devices, layout.num_nodes = apply_launcher_env(layout.devices, layout.num_nodes)
        # A wrong world explains every later complaint, so it goes first; Lightning then places
        # this process where an environment launcher did, whatever else the environment says.
        os.environ.update(preflight(layout.devices, layout.num_nodes))
        plugins = [LightningEnvironment()] if launcher() == "environment" else None
        batch_note = spec.check()
        if spec.resume is None and restarted():
            spec.resume = "auto"  # a launcher brought the run back: continue from its newest checkpoint
        accelerator = resolve_accelerator(spec.accelerator)
        precision = resolve_precision(spec.precision, accelerator)
        chosen = checked_strategy_class(layout, accelerator, precision)
        attention = choose_attention(spec.attn_implementation, accelerator, precision, layout.context_parallel)
        if spec.objective.rl and layout.context_parallel > 1:
            raise LitftError(f"--objective {spec.objective.name} samples completions with transformers' generate, which litft does not yet "
                             "run with the sequence split by --context_parallel; drop it (FSDP, ZeRO-3, tensor and expert parallel split the model)")
        compiling = choose_compile(spec.compile, accelerator, chosen.compiles, chosen.name, quantize=spec.lora.quantize if spec.lora else None,
                                   context_parallel=layout.context_parallel, tensor_parallel=layout.tensor_parallel,
                                   expert_parallel=layout.expert_parallel, generates=spec.objective.rl, fp8=spec.fp8)
        check_fp8(spec.fp8, accelerator, precision, quantize=spec.lora.quantize if spec.lora else None, strategy_name=chosen.name,
                  tensor_parallel=layout.tensor_parallel)
        config = load_config(resolve_model(spec.model))  # the model's description, read once: every check and the build take it
        check_architecture(config)  # before any process starts
        if carries_state(config) and getattr(spec.data, "packing", False) and not boundary_kernels(config, accelerator, attention in PACKED_SAFE):
            raise LitftError(f"--data.packing puts several samples in one row, and {config.model_type}'s state-carrying layers would carry "
                             "one sample's state into the next; drop --data.packing (litft trains these models a sample per padded row "
                             "unless their kernels take per-sample boundaries: litft.model.recurrent)")
        if layout.context_parallel > 1:
            check_context_parallel(config, layout.context_parallel)
        if layout.expert_parallel > 1:
            check_expert_parallel(config, layout.expert_parallel)
        if layout.tensor_parallel > 1:
            check_tensor_parallel(config, layout.tensor_parallel, spec.lora.quantize if spec.lora else None)
        strategy = chosen(layout, accelerator, precision, spec.train, Mesh.of(layout, chosen))
        fabric = L.Fabric(
            accelerator=accelerator, devices=layout.devices, num_nodes=layout.num_nodes, strategy=strategy.fabric_strategy(),
            precision=precision, loggers=make_loggers(spec.out_dir, spec.loggers), plugins=plugins,
        )
        join_torchrun_group(strategy.backend, accelerator)
        fabric.launch()
        # Every device mesh and process group of the run, once (FSDP's were made as Fabric set it up); counts reduce on the CPU.
        strategy.mesh.build(fabric.device.type, process_group_timeout(), host_group="gloo" not in strategy.backend)
        if fabric.world_size > 1:
            fabric.print(f"strategy: {strategy.name} over {fabric.world_size} processes; {strategy.mesh.describe()}")
        if accelerator == "cpu" and strategy.gathers_weights:
            # Host memory is the device's: gathered weights must leave it when dropped. Elsewhere glibc's reuse of freed
            # heap is kept (mapping every large tensor afresh costs one run in ten on the CPU: benchmarks/record.py).
            map_large_host_allocations()
        if batch_note:
            fabric.print(batch_note)
        return cls(spec, fabric, strategy, precision, attention, compiling, config)

    def prepare(self) -> None:
        """Data and tokenizer (rank 0 first), the model built, filled and wrapped, the checkpointer, a resume."""
        spec, fabric = self.spec, self.fabric

        def load():
            if fabric.global_rank == 0:
                spec.check_out_dir()
            resume_from = resolve_resume(spec.resume, spec.out_dir)
            source = resolve_model(spec.model)
            tokenizer = load_tokenizer(resolve_model(spec.tokenizer) if spec.tokenizer else source)
            return source, tokenizer, spec.data.load_or_tokenize(tokenizer, spec.seed), resume_from

        self.watch.at(0, "loading the tokenizer and data")
        source, self.tokenizer, self.data, resume_from = rank_zero_first(fabric, load, "loading the tokenizer and data")
        on_rank_zero(fabric, self._record_config, "writing the run's config")
        log_config(fabric, spec.recorded)
        check_shared_out_dir(fabric, spec.out_dir)
        data: PreparedData = self.data
        for note in data.notes:
            fabric.print(note)
        streamed = isinstance(data.train, StreamSource)
        num_train = 0 if streamed else len(data.train)  # a stream's length is not known
        if not streamed and num_train < spec.train.global_batch_size:
            raise LitftError(
                f"the training data has {num_train} samples, fewer than one global batch ({spec.train.global_batch_size}); "
                "add data or lower --train.global_batch_size"
            )
        self.total_steps = spec.train.max_steps if streamed else plan_steps(spec.train, num_train, mean_length(data.train),
                                                                                   spec.objective.iterations if spec.objective.rl else 1)
        warmup = spec.train.warmup_steps
        if warmup >= self.total_steps > 0 and warmup > 0:
            fabric.print(f"warmup: --train.warmup_steps {warmup} is at least the run's {self.total_steps} steps, so the learning rate peaks at "
                         f"{self.total_steps / warmup:.0%} of --train.learning_rate and never decays; lower --train.warmup_steps")
        self.watch.at(0, "building the model")
        fabric.seed_everything(spec.seed, verbose=False)
        attention = self.attention
        fabric.print(describe_attention(attention, fabric.device.type, self.precision))
        packed_by = boundary_kernels(self.config, fabric.device.type, attention in PACKED_SAFE)  # empty for attention-only models
        if carries_state(self.config):
            fabric.print(describe_recurrent(self.config, packed_by))
        fabric.print(self.compiling.line())
        liger = choose_kernels(spec.kernels, fabric.device.type)
        fabric.print(describe_kernels(spec.kernels, liger))
        self.lm, fill, on_device = build_module(
            source, self.precision, spec.lora, spec.train, self.total_steps, random_init=spec.random_init, seed=spec.seed,
            device=fabric.device, strategy=self.strategy, attention=attention, compile=self.compiling.enabled, fp8=spec.fp8, config=self.config,
            liger=liger, objective=spec.objective,
        )
        if spec.fp8 is not None:
            fabric.print(describe_fp8(spec.fp8, self.lm.model.fp8_layers, self.lm.hf_model))
        self.module, self.optimizer, self.scheduler = self.strategy.setup(fabric, self.lm, fill, on_device)
        self.generation = Generation(fabric, self.module, self.tokenizer, self.context)  # evaluation's answers, RL's rollouts
        keep_rotary_fp32(self.lm)
        experts = describe_experts(self.lm.hf_model, fabric.device.type, compute_dtype(self.precision))
        if experts:
            fabric.print(experts)
        self.expert_load = ExpertLoad.of(self.lm.hf_model)  # tokens per expert, logged as the router's balance
        model = self.lm.model
        fabric.print(
            f"{spec.job}: {sum(self.strategy.numel(p) for p in model.parameters()):,} parameters, "
            f"{sum(self.strategy.numel(p) for p in model.parameters() if p.requires_grad):,} trained; "
            f"{'streamed' if streamed else num_train} train / {len(data.val)} val {self.lm.objective.unit}; world size {fabric.world_size}; precision {self.precision}"
        )
        if self.lm.objective.summary():
            fabric.print(self.lm.objective.summary())
        self.checkpointer = Checkpointer(
            fabric, self.strategy, self.lm, self.optimizer, self.scheduler, spec.out_dir, spec.train, self._meta(num_train), spec.recorded,
        )
        self.watch.at(0, "resuming")
        position = self.checkpointer.resume(resume_from)
        if position is not None:
            self.state.load_state_dict(position)
            continue_logs(fabric, self.state.step)
            fabric.print(f"resumed from {resume_from}: step {self.state.step} of {self.total_steps}, {self.state.tokens:,} tokens seen")
        self.start_step = self.stops.start_step = self.state.step
        # Samples end to end in one row, no padding computed; a sample per row where layers carry state (litft.model.recurrent).
        self.lm.keep_samples_apart_in_kernels(bool(packed_by))
        self.padding_free = self.attention in PACKED_SAFE and not self.lm.whole_rows
        self.lm.objective.prepare(self, resume_from if position is not None else None)  # a reference's scores, where it needs them
        train = spec.train
        # The ranks of a context group take the same samples: between them they are one data-parallel rank.
        rank, world, pad, pin = self.context.data_rank, self.context.data_world, self.tokenizer.pad_token_id, fabric.device.type == "cuda"
        if streamed:
            self.batches = data.train.step_batches(
                train.global_batch_size, train.micro_batch_size, rank, world, pad, pin, self.padding_free, self.context.split
            )
        else:
            order = SampleOrder(num_train, train.global_batch_size, train.micro_batch_size, rank, world, spec.seed)
            self.batches = self.lm.objective.step_batches(self) or StepBatches(
                data.train, order, pad, self.padding_free, pin=pin, split=self.context.split)
        self.cadence = Cadence(self.total_steps, spec.eval, train.save_interval, train.max_tokens)
        self.flops = StepFlops.for_run(
            self.lm.hf_model.config, spec.lora, self.precision, fabric.device, train.peak_tflops, say=fabric.print,
            reference_forwards=self.lm.objective.reference_forwards,
        )
        self.meter = StepMeter(fabric, self.strategy, train, self.flops, self.total_steps, self.start_step,
                               compiled=CompileStats(self.lm.compiled_kinds) if self.compiling.enabled else None, objective=self.lm.objective)
        samples = spec.out_dir / "logs" / "samples" / f"rank-{fabric.global_rank:05d}.jsonl"
        self.sample_log = SampleLog(samples if train.record_sample_ids else None)
        profiles = spec.out_dir / "logs" / "profile"
        self.profiler = StepProfiler(spec.profile, profiles, fabric.global_rank, fabric.device, self.start_step, self.total_steps, self.meter.progress.message)
        self.profiler.after(self.start_step)

    def write_plot(self) -> None:
        """out_dir/logs/loss.png from the CSV log (rank 0): at every checkpoint and at the end."""
        if self.fabric.is_global_zero:
            logs = self.spec.out_dir / "logs"
            plot_losses(logs / "csv" / "metrics.csv", logs / "loss.png")

    def _record_config(self) -> None:
        self.spec.out_dir.mkdir(parents=True, exist_ok=True)
        (self.spec.out_dir / RUN_CONFIG).write_text(yaml.safe_dump(self.spec.recorded, sort_keys=False))

    def _meta(self, num_train: int) -> CheckpointMeta:
        """What this run's checkpoints record about it, and what a checkpoint must match to be resumed here."""
        spec = self.spec
        return CheckpointMeta(
            job=spec.job, model=spec.model, quantize=spec.lora.quantize if spec.lora else None, **self.strategy.checkpoint_fields(),
            model_fingerprint=CheckpointMeta.fingerprint(self.lm.hf_model.config), trained_shapes=self.strategy.trained_shapes(self.lm),
            global_batch_size=spec.train.global_batch_size, num_train_samples=num_train, seed=spec.seed,
        )

    def run(self, started: float) -> RunResult:
        """Every phase after launch, with stop signals noted and every rank's liveness watched throughout."""
        with PeerWatch.for_run(self.fabric, self.spec.layout.devices) as watch, StopSignals(where=watch.describe) as signals:
            self.watch = watch
            self.stops = StopRequests(signals, self.spec.train.stop_after_steps)
            self.prepare()
            try:
                fit(self)
            finally:
                self.batches.close()
                self.profiler.stop()
            return self.finish(started)

    def finish(self, started: float) -> RunResult:
        """The replica check, the export of the final checkpoint, and the run's last lines."""
        spec, fabric, state = self.spec, self.fabric, self.state
        model = self.lm.model
        self.write_plot()
        if state.stopped_by:
            last = self.checkpointer.last_path
            saved = f"checkpoint {last}" if last else "no checkpoint (no step was trained)"
            fabric.print(f"{spec.job} stopped by {state.stopped_by} after step {state.step}: {saved}; continue with --resume auto")
            return RunResult(model=model, history=state.history, out_dir=spec.out_dir, final_dir=None)
        divergence = self.strategy.replicas_in_step(self.lm)
        if divergence is not None:
            # Replicas that drifted apart would mean gradients were not averaged across them.
            fabric.log_dict({"replica_checksum_spread": divergence}, step=state.step)
            fabric.print(f"replicas in step: largest difference of parameter checksums between replica groups {divergence:.3g}")
        scores = [h["val_score"] for h in state.history if "val_score" in h]
        if len(scores) >= 2:
            n = min(spec.eval.score_samples, len(self.data.scoring))
            fabric.print(f"task score (exact match on {n} held-out prompts): {scores[0]:.3f} before, {scores[-1]:.3f} after")
        self.watch.at(state.step, "exporting the final model")
        exports = spec.final_exports()
        on_rank_zero(fabric, lambda: self._export(exports), "exporting the final model")
        where = "; ".join(f"{what} in {folder}" for what, folder in exports) or f"checkpoint {self.checkpointer.last_path} (--export none)"
        fabric.print(f"{spec.job} finished {state.step} steps in {time.perf_counter() - started:.0f} s; {where}")
        final_dir = exports[-1][1] if exports else None
        return RunResult(model=model, history=state.history, out_dir=spec.out_dir, final_dir=final_dir)

    def _export(self, exports: List[Tuple[str, Path]]) -> None:
        """From the final checkpoint, block by block: no rank gathers the whole model."""
        dtype = DTYPE_NAMES[param_dtype(self.precision)]
        for what, folder in exports:
            export(self.checkpointer.last_path, folder, merge_lora=what != "adapter", dtype=dtype)


def run_job(spec: RunSpec) -> RunResult:
    """The single path every job takes, from flags to an exported model."""
    started = time.perf_counter()
    trainer = Trainer.launch(spec)
    failed = True
    try:
        result = trainer.run(started)
        failed = False
        return result
    finally:
        close_loggers(trainer.fabric, failed)
        leave_process_group(trainer.fabric, failed)
