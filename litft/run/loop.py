"""THE training loop: every job hands ``fit`` a trainer, and ``fit`` reads as what a step does.

Each step takes this rank's micro-batches of one global batch, counts the target
tokens of the whole global batch (one all-reduce), and scales every micro-batch's
summed loss by ``world_size / global_tokens``: after the gradients are averaged
across ranks, the step optimizes the exact token mean of the global batch, as one
process would. The sample order is a pure function of (seed, epoch, step), so a
resumed run continues without replaying or skipping a batch.
"""

import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from litft.errors import LitftError
from litft.run.evaluation import score, validate
from litft.run.metrics import ANOTHER_RANK
from litft.run.tasks import evaluate_tasks, flat_metrics, harness_model


@dataclass
class LoopState:
    """Where the run is; its position (``state_dict``) is what a checkpoint stores to continue it."""

    step: int = 0
    epoch: int = 0
    epoch_step: int = 0
    tokens: int = 0
    samples: int = 0
    history: List[Dict[str, float]] = field(default_factory=list)
    stopped_by: Optional[str] = None  # what ended the run early (a signal, --train.stop_after_steps), if anything did
    # The first step whose loss was not finite (inf where none was), kept on the device: read only where the loop syncs anyway.
    first_nonfinite: Optional[torch.Tensor] = None

    POSITION = ("step", "epoch", "epoch_step", "tokens", "samples")

    def state_dict(self) -> Dict[str, int]:
        return {name: getattr(self, name) for name in self.POSITION}

    def load_state_dict(self, position: Dict[str, int]) -> None:
        for name in self.POSITION:
            setattr(self, name, int(position[name]))



@dataclass
class StepBatch:
    """One optimizer step's micro-batches on this rank, and the counts every rank agreed on."""

    micro: List[dict]
    targets: int  # loss-carrying tokens of the whole global batch
    tokens: int
    samples: int
    flops: float
    fetch_s: float = 0.0  # the time making the micro-batches took on this rank (RL: sampling and scoring)


def fit(trainer) -> LoopState:
    """Train until the planned step count or token budget, or until any rank is asked to stop."""
    state, cadence = trainer.state, trainer.cadence
    if cadence.validate_first(state.step):
        validate_and_log(trainer, scoring=True)
    trainer.module.train()
    while cadence.more(state.step, state.tokens):
        batch = next_batch(trainer)
        if batch is None:  # a stop was asked for on some rank: every rank ends after the same step
            break
        trainer.phases.enter("first_step" if state.step == trainer.start_step else "steps")
        train_step(trainer, batch)
        validating, saving = cadence.validate_now(state.step), cadence.save_now(state.step)
        if validating or saving:
            stop_if_not_finite(trainer)
        if validating:
            validate_and_log(trainer, scoring=False)
        if saving:
            save(trainer)
    stop_if_not_finite(trainer)
    if trainer.checkpointer.last_saved != state.step and not (state.stopped_by and state.step == trainer.start_step):
        save(trainer)
    complete_save(trainer)
    if trainer.spec.eval.final_validation and not state.stopped_by:
        validate_and_log(trainer, scoring=True)
    trainer.meter.progress.close()
    return state


def next_batch(trainer) -> Optional[StepBatch]:
    """This rank's micro-batches of the next step and the global counts; None when every rank stops instead."""
    state = trainer.state
    trainer.watch.at(state.step + 1, "training")
    state.epoch, state.epoch_step = trainer.batches.position(state.epoch, state.epoch_step)  # the next epoch, past the end of one
    fetching = time.perf_counter()
    micro = trainer.batches.get(state.epoch, state.epoch_step, state.step + 1)  # this rank's slices, under context parallel
    fetch_s = time.perf_counter() - fetching  # sampling and scoring, under RL
    trainer.sample_log.write(state.step + 1, state.epoch, [b["ids"].tolist() for b in micro])
    reason = trainer.stops.reason(state.step)
    flops = sum(trainer.flops.of_row(int(n)) for b in micro for n in b["lengths"]) if trainer.flops else 0.0
    # One all-reduce before the step: loss-carrying tokens (for the scale), input tokens, samples,
    # whether any rank was asked to stop, and the step's model FLOPs. Counted on the CPU from the
    # batches, and reduced there where the process group can (gloo): no accelerator sync.
    # The last element: rank 0's background checkpoint write has ended, so every rank commits it now (--train.async_save).
    counts = torch.tensor(
        [sum(trainer.objective.count(b) for b in micro), sum(int(b["num_tokens"]) for b in micro), sum(len(b["ids"]) for b in micro),
         float(reason is not None), flops, float(trainer.fabric.global_rank == 0 and trainer.checkpointer.written())],
        dtype=torch.float64, device=trainer.strategy.host_device,
    )
    targets, tokens, samples, stopping, flops, written = trainer.strategy.sum_counts(counts).tolist()
    if written:
        complete_save(trainer)
    # Each rank counts the targets of its own slice (all of them in a tensor-parallel group: loss and count alike, which the
    # scale and the logged mean divide out); tokens, samples and FLOPs once for every rank of a group.
    shared = trainer.context.shared
    targets, tokens, samples, stopping, flops = int(targets), int(tokens) // shared, int(samples) // shared, int(stopping), flops / shared
    if stopping:
        state.stopped_by = reason or ANOTHER_RANK
        trainer.stops.agreed()
        return None
    return StepBatch(micro, targets, tokens, samples, flops, fetch_s)


def train_step(trainer, batch: StepBatch) -> None:
    """Forward and backward of every micro-batch, one optimizer step, and the step's metrics."""
    fabric, module, optimizer, state = trainer.fabric, trainer.module, trainer.optimizer, trainer.state
    scale = fabric.world_size / max(batch.targets, 1)  # data ranks / targets under tensor parallel (see litft.parallel.tensor)
    loss_sum = torch.zeros((), dtype=torch.float64, device=fabric.device)
    for i, micro in enumerate(batch.micro):
        micro = fabric.to_device(micro)
        # Fabric only applies autocast inside a wrapped forward; one device has no wrapper.
        with fabric.no_backward_sync(module, enabled=i < len(batch.micro) - 1), fabric.autocast():
            loss = module.training_step(micro)
            fabric.backward(loss * scale)
        loss_sum += loss.detach().double()
    if state.first_nonfinite is None:
        state.first_nonfinite = torch.full((), math.inf, dtype=torch.float64, device=loss_sum.device)
    state.first_nonfinite = torch.where(torch.isfinite(loss_sum), state.first_nonfinite, state.first_nonfinite.clamp(max=state.step + 1))
    lr = optimizer.param_groups[0]["lr"]
    trainer.meter.before_optimizer_step(state.step, module, optimizer)
    grad_norm = trainer.strategy.optimizer_step(module, optimizer, trainer.spec.train.max_norm)
    trainer.scheduler.step()
    state.step, state.epoch_step = state.step + 1, state.epoch_step + 1
    state.tokens, state.samples = state.tokens + batch.tokens, state.samples + batch.samples
    # The loss and the norm stay on the device until a log step reads them.
    metrics = trainer.meter.after_step(state, loss_sum, lr, grad_norm, batch, module, optimizer, router_aux=trainer.lm.take_router_aux(),
                                       expert_load=trainer.expert_load, figures=trainer.objective.take_figures(),
                                       maxima=trainer.objective.take_maxima())
    if "loss" in metrics and not math.isfinite(metrics["loss"]):  # a log step's loss is the global one: every rank stops here
        complete_save(trainer)  # a checkpoint of an earlier, finite step still being written is kept
        raise not_finite(float(state.first_nonfinite) if math.isfinite(float(state.first_nonfinite)) else state.step)
    state.history.append(metrics)
    trainer.profiler.after(state.step)


def stop_if_not_finite(trainer) -> None:
    """End the run with one line at a loss that is not finite: nothing from that step on is validated, saved or exported.

    Before a save or a validation (one small all-reduce: every rank decides alike) and at the end; log steps read the
    global loss anyway (``train_step``) and stop there without another collective.
    """
    flag = trainer.state.first_nonfinite
    if flag is None:
        return
    if trainer.fabric.world_size > 1:  # every rank decides alike: the earliest step any rank saw
        flag = trainer.fabric.all_reduce(flag.clone(), reduce_op=torch.distributed.ReduceOp.MIN)
    first = float(flag)
    if math.isfinite(first):
        complete_save(trainer)
        raise not_finite(first)


def not_finite(step: float) -> LitftError:
    return LitftError(
        f"the training loss was not finite (nan or inf) at step {int(step)}; the run stops and nothing from that step on is "
        "saved or exported: lower --train.learning_rate, check the data, or try another --precision"
    )


def validate_and_log(trainer, scoring: bool) -> None:
    fabric, data, spec, state = trainer.fabric, trainer.data, trainer.spec, trainer.state
    trainer.watch.at(state.step, "validating")
    trainer.phases.enter("validation")
    metrics = {}
    objective = trainer.objective
    measured = objective.validation(trainer)  # an objective that measures validation itself (RL: the held-out reward)
    if measured is not None:
        metrics.update(measured)
    elif data.val:
        metrics["val_loss"] = validate(
            fabric, trainer.module, data, spec.train.micro_batch_size, spec.eval.max_batches, trainer.tokenizer.pad_token_id, trainer.padding_free,
            trainer.context, objective.count,
        )
        figures = objective.take_figures()  # every rank has some or none alike (the same objective)
        metrics.update(objective.validation_figures(metrics["val_loss"], None if figures is None else fabric.all_reduce(figures, reduce_op="sum")))
    if spec.eval.tasks:
        metrics.update(harness_metrics(trainer))
    if scoring and spec.eval.score_samples and not objective.generates:
        prompts = data.scoring[: spec.eval.score_samples]
        metrics["val_score"] = score(trainer.generation, prompts, trainer.tokenizer, spec.eval.max_new_tokens)
    trainer.module.train()
    if metrics:
        fabric.log_dict(metrics, step=state.step)
        trainer.meter.progress.message(f"step {state.step}: " + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        state.history.append({"step": state.step, **metrics})


def harness_metrics(trainer) -> Dict[str, float]:
    """--eval.tasks on the weights being trained, every data-parallel rank its share of the documents (rank 0's figures)."""
    spec, place = trainer.spec, trainer.context
    tasks = [t.strip() for t in spec.eval.tasks.split(",") if t.strip()]
    model = trainer.lm.model
    model.eval()
    try:
        lm = harness_model(model, trainer.tokenizer, spec.train.micro_batch_size, place.data_rank, place.data_world, trainer.generation)
        results = evaluate_tasks(lm, tasks, spec.eval.include_path, limit=spec.eval.task_limit)
    finally:
        model.train()
    return flat_metrics(results) if results is not None else {}


def save(trainer) -> None:
    """A checkpoint, and ``save_blocked_s`` in the metrics: the seconds training stood still for it (with --train.async_save,
    the wait for the write before, the copy to host memory and the rank's random state)."""
    trainer.watch.at(trainer.state.step, "saving a checkpoint")
    trainer.phases.enter("save")
    started = time.perf_counter()
    complete_save(trainer)
    path = trainer.checkpointer.save(trainer.state.state_dict())
    trainer.fabric.log_dict({"save_blocked_s": time.perf_counter() - started}, step=trainer.state.step)
    if path is None:
        trainer.meter.progress.message(f"step {trainer.state.step}: writing a checkpoint in the background")
    else:
        saved(trainer, path)


def complete_save(trainer) -> None:
    """The checkpoint written in the background (--train.async_save), committed on every rank, if one was pending."""
    path = trainer.checkpointer.complete()
    if path is not None:
        saved(trainer, path)


def saved(trainer, path) -> None:
    if trainer.fabric.global_rank == 0:
        trainer.out.settle()  # the run --overwrite set aside is gone for good once this run has a checkpoint
    trainer.meter.progress.message(f"step {trainer.state.step}: checkpoint {path}")
    trainer.write_plot()
