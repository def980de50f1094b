"""One run's parts, made once, in the order a cluster needs them; ``run_job`` is the single path of every job.

The order matters on a cluster: the launcher's world is checked before anything
loads (a wrong world explains every later complaint), the flags before any file is
touched, rank 0 tokenizes before the others read its cache, and the model is built
on the meta device and filled as the strategy shards it.
"""

import math
import os
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

import lightning_fabric as L
import torch
from lightning_fabric.plugins.environments import LightningEnvironment

from litft.checkpoint import CheckpointMeta, Checkpointer, resolve_resume
from litft.checkpoint.convert import DTYPE_NAMES, export
from litft.data.base import mean_length, samples_see_images
from litft.data.images import load_processor
from litft.data.order import SampleOrder, StepBatches
from litft.data.stream import StreamSource
from litft.device import cuda_allocator_defaults, map_large_host_allocations, resolve_accelerator, resolve_precision
from litft.errors import LitftError
from litft.launch.cluster import (
    apply_launcher_env, check_shared_out_dir, join_torchrun_group, launcher, leave_process_group, preflight, process_group_timeout, restarted,
)
from litft.launch.watch import PeerWatch, StopSignals
from litft.model.compiling import CompileStats
from litft.model.experts import ExpertLoad
from litft.model.experts import describe as describe_experts
from litft.model.flops import StepFlops
from litft.model.fp8 import describe as describe_fp8
from litft.model.generation import Generation
from litft.model.loading import check_architecture, keep_rotary_fp32, load_config, load_tokenizer, resolve_model
from litft.model.vision import (
    IMAGE_IN_EVERY_RECORD, EncoderStandIn, ImageInputs, can_read_images, check_images_fit, describe_text_model, reading_images,
    reads_images_instead_of_text, sees_images,
)
from litft.model.vision import describe as describe_vision
from litft.objectives import build_objective
from litft.parallel.mesh import Mesh
from litft.parallel.strategies import checked_strategy_class
from litft.ranks import on_every_rank, on_rank_zero, rank_zero_first
from litft.run.build import build_module
from litft.run.logs import close_loggers, continue_logs, log_config, make_loggers, quiet_libraries
from litft.run.loop import LoopState, fit
from litft.run.metrics import Cadence, PhasePeaks, SampleLog, StepMeter, StopRequests, describe_phases
from litft.run.outdir import OutDir
from litft.run.plan import PACKED_WITH_BOUNDARIES, RunPlan, facts_of
from litft.run.plot import plot_losses
from litft.run.profiling import StepProfiler
from litft.run.spec import RunResult, RunSpec
from litft.run.tasks import check_tasks


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
    """Owns a run's fabric, strategy, plan, module, optimizer, scheduler, data, checkpointer and meter."""

    def __init__(self, spec: RunSpec, fabric, strategy, plan: RunPlan, config, objective):
        self.spec, self.fabric, self.strategy, self.plan, self.config, self.objective = spec, fabric, strategy, plan, config, objective
        self.precision = plan.precision
        self.state = LoopState()
        self.context = strategy.mesh.place(fabric.global_rank)  # which samples this rank takes, and its slice of them
        self.out = OutDir(spec.out_dir, spec.overwrite, continues=spec.resumes_inside_out_dir)
        self.stops = StopRequests()
        self.watch = PeerWatch.idle()
        self.phases = PhasePeaks(fabric.device)  # each phase's peak memory, reported at the end

    @classmethod
    def launch(cls, spec: RunSpec) -> "Trainer":
        """Check the world, the flags and what they combine into (the run plan), and start (or join) the processes."""
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
        config = load_config(resolve_model(spec.model))  # the model's description, read once: every check and the build take it
        if can_read_images(config) and spec.data.names_images():
            config = reading_images(config)  # a composite folder (Qwen3.5) trains its image-text model on image records
        check_architecture(config)  # before any process starts
        plan = RunPlan.decide(facts_of(spec, accelerator, precision, chosen, config, spec.data_world))
        objective = build_objective(spec.objective, lora=spec.lora is not None)  # reward functions imported here, before any write
        if spec.eval.tasks:  # lm-eval's tasks found (or refused) before any process starts
            check_tasks([t.strip() for t in spec.eval.tasks.split(",") if t.strip()], spec.eval.include_path)
        strategy = chosen(layout, accelerator, precision, spec.train, Mesh.of(layout, chosen))
        strategy.idle_parameters = sees_images(config)
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
        return cls(spec, fabric, strategy, plan, config, objective)

    def prepare(self) -> None:
        """Every input read and checked, then out_dir claimed, the model built, a checkpoint resumed, the batches and meters."""
        resume_from, num_train = self.read_inputs()
        self.claim_out_dir()
        self.build()
        position = self.restore(resume_from, num_train)
        resumed = resume_from if position is not None else None
        checkpoint_files = self.objective.prepare(self, resumed)  # a reference's scores, where the objective needs them
        for name, value in (checkpoint_files or {}).items():
            self.checkpointer.keep_file(name, value)
        self.batches = self.make_batches(num_train, resumed)
        self.make_meters()

    def read_inputs(self) -> Tuple[Optional[Path], int]:
        """The tokenizer, the data and the checkpoint to resume from, read and checked (rank 0 first) before out_dir is
        touched: a malformed record, a missing or mismatched checkpoint fails here with the earlier run intact."""
        spec, fabric = self.spec, self.fabric
        self.watch.at(0, "loading the tokenizer and data")

        def load():
            if fabric.global_rank == 0:
                self.out.reconcile()
                self.out.check()
            resume_from = resolve_resume(spec.resume, spec.out_dir)
            tokenizer = load_tokenizer(resolve_model(spec.tokenizer or spec.model))
            return tokenizer, spec.data.load_or_tokenize(tokenizer, spec.seed), resume_from

        self.tokenizer, self.data, resume_from = rank_zero_first(fabric, load, "loading the tokenizer and data")
        self.sees_images = samples_see_images(self.data)
        check_images_fit(self.config, self.sees_images, self.data)
        if self.sees_images and spec.eval.score_samples:
            raise LitftError("--eval.score_samples scores answers generated from text prompts, and image records are not scored by "
                             "generation yet; set it to 0 (val_loss is computed as usual)")
        for note in self.data.notes:
            fabric.print(note)
        streamed = isinstance(self.data.train, StreamSource)
        num_train = 0 if streamed else len(self.data.train)  # a stream's length is not known
        if not streamed and num_train < spec.train.global_batch_size:
            raise LitftError(f"the training data has {num_train} samples, fewer than one global batch ({spec.train.global_batch_size}); "
                             "add data or lower --train.global_batch_size")
        if resume_from is not None:  # all but the trained shapes, which need the model: checked again once it is built
            on_every_rank(fabric, lambda: CheckpointMeta.read(resume_from).check_fits(resume_from, self._meta(num_train)),
                          "checking the checkpoint to resume from")
        iterations = spec.objective.iterations if spec.objective.rl else 1
        self.total_steps = spec.train.max_steps if streamed else plan_steps(spec.train, num_train, mean_length(self.data.train), iterations)
        warmup = spec.train.warmup_steps
        if warmup >= self.total_steps > 0 and warmup > 0:
            fabric.print(f"warmup: --train.warmup_steps {warmup} is at least the run's {self.total_steps} steps, so the learning rate peaks at "
                         f"{self.total_steps / warmup:.0%} of --train.learning_rate and never decays; lower --train.warmup_steps")
        return resume_from, num_train

    def claim_out_dir(self) -> None:
        """out_dir claimed once every input passed (litft.run.outdir), the run's config logged, the folder seen by every rank."""
        on_rank_zero(self.fabric, lambda: self.out.claim(self.spec.recorded), "writing the run's config")
        log_config(self.fabric, self.spec.recorded)
        check_shared_out_dir(self.fabric, self.spec.out_dir)

    def build(self) -> None:
        """The model as the plan says, built on the meta device, filled and wrapped by the strategy; the first screen's lines."""
        spec, fabric, plan = self.spec, self.fabric, self.plan
        self.watch.at(0, "building the model")
        fabric.seed_everything(spec.seed, verbose=False)
        for line in plan.lines(self.config):
            fabric.print(line)
        self.lm, fill, on_device = build_module(
            resolve_model(spec.model), plan, spec.lora, spec.train, self.total_steps, self.objective, random_init=spec.random_init,
            seed=spec.seed, device=fabric.device, strategy=self.strategy, config=self.config,
        )
        if plan.fp8 is not None:
            fabric.print(describe_fp8(plan.fp8, self.lm.model.fp8_layers, self.lm.hf_model))
        if self.sees_images:
            processor = load_processor(resolve_model(spec.tokenizer or spec.model))
            self.lm.images = ImageInputs(processor, self.lm.hf_model)
            # Every rank runs the sharded encoder in every forward (where every record has an image, it always has one).
            if self.strategy.gathers_weights and fabric.world_size > 1 and self.config.model_type not in IMAGE_IN_EVERY_RECORD:
                self.lm.stand_in = EncoderStandIn(processor, self.lm.hf_model)
        vision = (describe_vision(self.lm.hf_model, spec.train.vision_encoder, spec.lora is not None) if self.lm.sees_images
                  else describe_text_model(self.config))
        if vision:
            fabric.print(vision)
        self.module, self.optimizer, self.scheduler = self.strategy.setup(fabric, self.lm, fill, on_device)
        keep_rotary_fp32(self.lm)
        self.lm.keep_samples_apart_in_kernels(plan.rows == PACKED_WITH_BOUNDARIES)
        self.padding_free = plan.padding_free
        # Evaluation's answers and RL's rollouts, the weights gathered once per generate call where the strategy shards them.
        self.generation = Generation(fabric, self.module, self.tokenizer, self.context,
                                     weights=lambda: self.strategy.generation_weights(self.module))
        experts = describe_experts(self.lm.hf_model, fabric.device.type, plan.compute_dtype)
        if experts:
            fabric.print(experts)
        self.expert_load = ExpertLoad.of(self.lm.hf_model)  # tokens per expert, logged as the router's balance
        model, data = self.lm.model, self.data
        streamed = isinstance(data.train, StreamSource)
        fabric.print(
            f"{spec.job}: {sum(self.strategy.numel(p) for p in model.parameters()):,} parameters, "
            f"{sum(self.strategy.numel(p) for p in model.parameters() if p.requires_grad):,} trained; "
            f"{'streamed' if streamed else len(data.train)} train / {len(data.val)} val {self.objective.unit}; world size {fabric.world_size}; "
            f"precision {self.precision}"
        )
        if self.objective.summary():
            fabric.print(self.objective.summary())

    def restore(self, resume_from: Optional[Path], num_train: int) -> Optional[dict]:
        """The checkpointer, and the checkpoint resumed into the model, optimizer, scheduler and loop state, where there is one."""
        fabric, spec = self.fabric, self.spec
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
        return position

    def make_batches(self, num_train: int, resumed: Optional[Path]):
        """The loop's source of step batches: the objective's own (RL's rollouts), a stream's, or the data's in seeded order."""
        spec, data, train = self.spec, self.data, self.spec.train
        # The ranks of a context group take the same samples: between them they are one data-parallel rank.
        rank, world, pad, pin = self.context.data_rank, self.context.data_world, self.tokenizer.pad_token_id, self.fabric.device.type == "cuda"
        split = self.context.split
        if self.lm.images is not None:  # a batch's image tensors made on the collate thread, a step ahead (litft.model.vision)
            split = lambda batch, cut=split: self.lm.images.ahead(cut(batch))  # noqa: E731
        if isinstance(data.train, StreamSource):
            return data.train.step_batches(train.global_batch_size, train.micro_batch_size, rank, world, pad, pin, self.padding_free, split)
        own = self.objective.step_batches(self, resumed)
        if own is not None:
            return own
        order = SampleOrder(num_train, train.global_batch_size, train.micro_batch_size, rank, world, spec.seed)
        return StepBatches(data.train, order, pad, self.padding_free, pin=pin, split=split)

    def make_meters(self) -> None:
        spec, fabric, train = self.spec, self.fabric, self.spec.train
        self.cadence = Cadence(self.total_steps, spec.eval, train.save_interval, train.max_tokens)
        self.flops = StepFlops.for_run(self.lm.hf_model.config, spec.lora, self.precision, fabric.device, train.peak_tflops, say=fabric.print,
                                       reference_forwards=self.objective.reference_forwards)
        self.meter = StepMeter(fabric, self.strategy, train, self.flops, self.total_steps, self.start_step,
                               compiled=CompileStats(self.lm.compiled_kinds) if self.plan.compile.enabled else None, objective=self.objective,
                               phases=self.phases)
        samples = spec.out_dir / "logs" / "samples" / f"rank-{fabric.global_rank:05d}.jsonl"
        self.sample_log = SampleLog(samples if train.record_sample_ids else None)
        profiles = spec.out_dir / "logs" / "profile"
        self.profiler = StepProfiler(spec.profile, profiles, fabric.global_rank, fabric.device, self.start_step, self.total_steps,
                                     self.meter.progress.message)
        self.profiler.after(self.start_step)

    def write_plot(self) -> None:
        """out_dir/logs/loss.png from the CSV log (rank 0): at every checkpoint and at the end."""
        if self.fabric.is_global_zero:
            logs = self.spec.out_dir / "logs"
            plot_losses(logs / "csv" / "metrics.csv", logs / "loss.png")

    def _meta(self, num_train: int) -> CheckpointMeta:
        """What this run's checkpoints record about it, and what a checkpoint must match to be resumed here."""
        spec = self.spec
        lm = getattr(self, "lm", None)  # before the build, everything but the trained shapes
        return CheckpointMeta(
            job=spec.job, model=spec.model, quantize=spec.lora.quantize if spec.lora else None, **self.strategy.checkpoint_fields(),
            model_fingerprint=CheckpointMeta.fingerprint(self.config),
            image_text_model=reads_images_instead_of_text(self.config), trained_shapes=None if lm is None else self.strategy.trained_shapes(lm),
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
            fabric.print(f"{spec.job} stopped by {self.stops.said(state.stopped_by, state.step)} after step {state.step}: {saved}; continue with --resume auto")
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
        self.phases.enter("export")
        exports = spec.final_exports()
        on_rank_zero(fabric, lambda: self._export(exports), "exporting the final model")
        peaks = self.phases.by_rank(fabric)
        if peaks:
            fabric.log_dict(peaks, step=state.step)
            fabric.print(describe_phases(peaks, fabric.world_size))
        where = "; ".join(f"{what} in {folder}" for what, folder in exports) or f"checkpoint {self.checkpointer.last_path} (--export none)"
        fabric.print(f"{spec.job} finished {state.step} steps in {time.perf_counter() - started:.0f} s; {where}")
        final_dir = exports[-1][1] if exports else None
        return RunResult(model=model, history=state.history, out_dir=spec.out_dir, final_dir=final_dir)

    def close_engine(self, failed: bool) -> None:
        """A rollout engine of the run's own (vLLM) shut down once every rank is done with the process group it tears down."""
        engine = getattr(getattr(self, "batches", None), "engine", None)
        if engine is None or engine.shares_weights:
            return
        if not failed and self.fabric.world_size > 1:
            torch.distributed.barrier()
        engine.close()

    def _export(self, exports: List[Tuple[str, Path]]) -> None:
        """From the final checkpoint, block by block: no rank gathers the whole model."""
        dtype = DTYPE_NAMES[self.plan.param_dtype]
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
        trainer.close_engine(failed)
        leave_process_group(trainer.fabric, failed)
        if failed and trainer.fabric.global_rank == 0:
            undone = trainer.out.release()  # a start that saved no checkpoint leaves out_dir as it found it
            if undone:
                print(undone, file=sys.stderr, flush=True)
