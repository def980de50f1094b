"""THE training loop: every job hands ``fit`` a module, an optimizer and prepared data."""

import json
import math
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from litft.args import EvalArgs, TrainArgs
from litft.data.base import PreparedData, Prompted, SampleOrder, collate, eval_batches
from litft.model import target_tokens
from litft.strategy import model_state_bytes, optimizer_step


@dataclass
class LoopState:
    """Where the run is; everything needed to continue it lives here."""

    step: int = 0
    epoch: int = 0
    epoch_step: int = 0
    tokens: int = 0
    samples: int = 0
    history: List[Dict[str, float]] = field(default_factory=list)
    stopped_by: Optional[str] = None  # what ended the run early (a signal, --train.stop_after_steps), if anything did


def plan_steps(train: TrainArgs, num_samples: int, mean_tokens: float) -> int:
    """Optimizer steps the run will take: the first of max_steps, epochs and max_tokens to end it."""
    steps_per_epoch = num_samples // train.global_batch_size
    limits = []
    if train.max_steps is not None:
        limits.append(train.max_steps)
    if train.epochs is not None:
        limits.append(train.epochs * steps_per_epoch)
    if train.max_tokens is not None:
        # Only an estimate for variable-length samples; the loop stops on the real count.
        limits.append(math.ceil(train.max_tokens / (train.global_batch_size * mean_tokens)))
    return max(1, min(limits)) if limits else max(1, steps_per_epoch)


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory, or the process's peak resident memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def watch_phase(watch, step: int, doing: str) -> None:
    if watch is not None:
        watch.at(step, doing)


def peak_memory_by_rank(fabric) -> Dict[str, float]:
    """Every rank's peak memory (GB) so far, and the fullest rank: the rank that runs out is rarely rank 0."""
    local = torch.tensor([peak_memory_gb(fabric.device)], dtype=torch.float64, device=fabric.device)
    peaks = fabric.all_gather(local).flatten().tolist() if fabric.world_size > 1 else [local.item()]
    fullest = max(range(len(peaks)), key=peaks.__getitem__)
    metrics = {"peak_memory_gb": peaks[fullest], "peak_memory_rank": fullest}
    if len(peaks) > 1:
        metrics.update({f"peak_memory_gb/rank_{r}": gb for r, gb in enumerate(peaks)})
    return metrics


class Progress:
    """Rank 0's view of the run: a live bar on a terminal, one line per log step otherwise."""

    def __init__(self, enabled: bool, total: int, start: int):
        self.enabled = enabled
        self.total = total
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, step: int, metrics: Dict[str, float], eta_s: float) -> None:
        if not self.enabled:
            return
        text = f"loss {metrics['loss']:.4f} | {metrics['tokens_per_s']:,.0f} tok/s"
        if "mfu" in metrics:
            text += f" | MFU {metrics['mfu']:.1%}"
        elif "tflops_per_s_per_device" in metrics:
            text += f" | {metrics['tflops_per_s_per_device']:.2f} TFLOP/s/device"
        rank = f" (rank {metrics['peak_memory_rank']})" if any(k.startswith("peak_memory_gb/") for k in metrics) else ""
        text += f" | peak mem {metrics['peak_memory_gb']:.2f} GB{rank}"
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(step - self.bar.n)
        else:
            eta = time.strftime("%H:%M:%S", time.gmtime(eta_s))
            print(f"step {step}/{self.total} | {text} | lr {metrics['lr']:.2e} | eta {eta}", file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def fit(
    fabric, module, optimizer, scheduler, data: PreparedData, train: TrainArgs, eval: EvalArgs, seed: int, tokenizer, total_steps: int,
    state: Optional[LoopState] = None, checkpointer=None, sample_log: Optional[Path] = None, stop=None, watch=None, flops=None,
) -> LoopState:
    """Train until the planned step count or the token budget is reached.

    Each step takes the rank's micro-batches of one global batch, counts the target
    tokens of the whole global batch (one all-reduce), and scales every micro-batch's
    summed loss by ``world_size / global_tokens``: after DDP averages the gradients,
    the step optimizes the exact token mean of the global batch, as one process would.

    A resumed ``state`` continues at its (epoch, step): the sample order is a pure
    function of them, so no batch is replayed or skipped. When ``stop`` has noted a
    signal on any rank, every rank ends after the same step with a checkpoint.
    ``watch`` (a cluster.PeerWatch) hears which step this rank is in; ``flops`` (a
    flops.StepFlops) turns the tokens trained into TFLOP/s and MFU.
    """
    state = state or LoopState()
    order = SampleOrder(
        len(data.train), train.global_batch_size, train.micro_batch_size, fabric.global_rank, fabric.world_size, seed
    )
    pad_id = tokenizer.pad_token_id
    progress = Progress(fabric.is_global_zero, total_steps, state.step)

    if eval.initial_validation and state.step == 0:
        _validate_and_log(fabric, module, data, train, eval, tokenizer, state, progress, scoring=True)

    window_start, window_tokens, window_samples, window_flops = time.perf_counter(), 0, 0, 0.0
    run_start = time.perf_counter()
    start_step = state.step
    module.train()
    while state.step < total_steps and (train.max_tokens is None or state.tokens < train.max_tokens):
        watch_phase(watch, state.step + 1, "training")
        if state.epoch_step >= order.steps_per_epoch:
            state.epoch, state.epoch_step = state.epoch + 1, 0
        indices = order.micro_batches(state.epoch, state.epoch_step)
        if sample_log is not None:
            with open(sample_log, "a") as f:
                f.write(json.dumps({"step": state.step + 1, "epoch": state.epoch, "ids": [i for idx in indices for i in idx]}) + "\n")
        micro = [collate([data.train[i] for i in idx], pad_id) for idx in indices]
        # One all-reduce before the step: loss-carrying tokens (for the scale), input tokens, samples,
        # whether any rank was asked to stop, and the step's model FLOPs.
        reason = stop.received if stop is not None else None
        if train.stop_after_steps is not None and state.step - start_step >= train.stop_after_steps:
            reason = f"--train.stop_after_steps {train.stop_after_steps}"
        asked = reason is not None
        step_flops = sum(flops.of_row(len(data.train[i]["input_ids"])) for idx in indices for i in idx) if flops else 0.0
        counts = torch.tensor(
            [sum(target_tokens(b) for b in micro), sum(int(b["num_tokens"]) for b in micro), sum(len(b["ids"]) for b in micro), float(asked), step_flops],
            dtype=torch.float64,
            device=fabric.device,
        )
        *summed, step_flops = fabric.all_reduce(counts, reduce_op="sum").tolist()
        global_targets, step_tokens, step_samples, stopping = (int(c) for c in summed)
        if stopping:
            state.stopped_by = reason if asked else "a signal to another rank"
            break
        scale = fabric.world_size / max(global_targets, 1)

        loss_sum = torch.zeros((), dtype=torch.float64, device=fabric.device)
        for i, batch in enumerate(micro):
            batch = fabric.to_device(batch)
            # Fabric only applies autocast inside a wrapped forward; one device has no wrapper.
            with fabric.no_backward_sync(module, enabled=i < len(micro) - 1), fabric.autocast():
                loss = module.training_step(batch)
                fabric.backward(loss * scale)
            loss_sum += loss.detach().double()
        lr = optimizer.param_groups[0]["lr"]
        if state.step == start_step:
            grad_bytes = model_state_bytes(fabric, module, optimizer)["grads"]
        grad_norm = optimizer_step(fabric, module, optimizer, train.max_norm)
        scheduler.step()

        loss_total = fabric.all_reduce(loss_sum, reduce_op="sum").item()
        state.step += 1
        state.epoch_step += 1
        state.tokens += step_tokens
        state.samples += step_samples
        window_tokens += step_tokens
        window_samples += step_samples
        window_flops += step_flops

        metrics = {"loss": loss_total / max(global_targets, 1), "lr": lr, "epoch": state.epoch, "tokens": state.tokens}
        if state.step == start_step + 1:
            # What sharding saves: bytes of parameters, gradients (as they were before the
            # step) and optimizer states on the fullest rank; logged once, they do not change.
            held = model_state_bytes(fabric, module, optimizer)
            most = torch.tensor([held["params"], grad_bytes, held["optimizer"]], dtype=torch.float64, device=fabric.device)
            if fabric.world_size > 1:  # the rank that holds the most is the one that runs out of memory
                most = fabric.all_reduce(most, reduce_op="max")
            metrics.update(zip(("params_bytes", "grads_bytes", "optimizer_bytes"), (int(v) for v in most.tolist())))
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        if state.step % train.log_interval == 0 or state.step == total_steps:
            elapsed = time.perf_counter() - window_start
            metrics.update(
                tokens_per_s=window_tokens / elapsed,
                tokens_per_s_per_device=window_tokens / elapsed / fabric.world_size,
                samples_per_s=window_samples / elapsed,
            )
            if flops is not None:
                metrics["tflops_per_s_per_device"] = window_flops / elapsed / fabric.world_size / 1e12
                if flops.peak:
                    metrics["mfu"] = window_flops / elapsed / fabric.world_size / flops.peak
            metrics.update(peak_memory_by_rank(fabric))
            fabric.log_dict(metrics, step=state.step)
            per_step = (time.perf_counter() - run_start) / (state.step - start_step)
            progress.update(state.step, metrics, per_step * (total_steps - state.step))
            window_start, window_tokens, window_samples, window_flops = time.perf_counter(), 0, 0, 0.0
        state.history.append(metrics)

        if eval.interval and state.step % eval.interval == 0 and state.step < total_steps:
            watch_phase(watch, state.step, "validating")
            _validate_and_log(fabric, module, data, train, eval, tokenizer, state, progress, scoring=False)
            module.train()
        if checkpointer is not None and checkpointer.due(state.step) and state.step < total_steps:
            watch_phase(watch, state.step, "saving a checkpoint")
            progress.message(f"step {state.step}: checkpoint {checkpointer.save(state)}")

    if checkpointer is not None and checkpointer.last_saved != state.step and not (state.stopped_by and state.step == start_step):
        watch_phase(watch, state.step, "saving a checkpoint")
        progress.message(f"step {state.step}: checkpoint {checkpointer.save(state)}")
    if state.stopped_by:
        progress.close()
        return state
    if eval.final_validation:
        watch_phase(watch, state.step, "validating")
        _validate_and_log(fabric, module, data, train, eval, tokenizer, state, progress, scoring=True)
    progress.close()
    return state


def _validate_and_log(fabric, module, data, train, eval, tokenizer, state, progress, scoring: bool) -> None:
    metrics = {}
    if data.val:
        metrics["val_loss"] = validate(fabric, module, data, train.micro_batch_size, eval.max_batches, tokenizer.pad_token_id)
        metrics["val_ppl"] = math.exp(min(metrics["val_loss"], 50))
    if scoring and eval.score_samples:
        metrics["val_score"] = score(fabric, module, data.scoring[: eval.score_samples], tokenizer, eval.max_new_tokens)
    if metrics:
        fabric.log_dict(metrics, step=state.step)
        progress.message(f"step {state.step}: " + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        state.history.append({"step": state.step, **metrics})


@torch.no_grad()
def validate(fabric, module, data: PreparedData, micro_batch_size: int, max_batches: Optional[int], pad_id: int) -> float:
    """Token-mean loss over the validation set, every sample counted once across ranks."""
    module.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=fabric.device)
    for n, idx in enumerate(eval_batches(len(data.val), micro_batch_size, fabric.global_rank, fabric.world_size)):
        if max_batches is not None and n >= max_batches:
            break
        # Every rank makes the same number of forward passes (wrapped forwards may communicate);
        # a rank out of samples runs sample 0 and does not count it.
        batch = fabric.to_device(collate([data.val[i] for i in (idx or [0])], pad_id))
        with fabric.autocast():
            loss = module.validation_step(batch).double()
        if idx:
            totals[0] += loss
            totals[1] += target_tokens(batch)
    totals = fabric.all_reduce(totals, reduce_op="sum")
    module.train()
    return float(totals[0] / totals[1].clamp(min=1))


def stop_tokens(model, tokenizer) -> List[int]:
    """The tokenizer's EOS and the model's own end-of-turn tokens (chat models often have several)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    return sorted({t for t in [tokenizer.eos_token_id, *configured] if t is not None})


@torch.no_grad()
def score(fabric, module, prompts: List[Prompted], tokenizer, max_new_tokens: int, batch_size: int = 64) -> float:
    """Share of prompts whose greedy answer equals the reference exactly, over all ranks."""
    model = module.module.model if hasattr(module, "module") else module.model
    was_training = model.training
    model.eval()
    mine = prompts[fabric.global_rank :: fabric.world_size]
    correct = 0
    for i in range(0, len(mine), batch_size):
        chunk = mine[i : i + batch_size]
        width = max(len(p.prompt_ids) for p in chunk)
        # Left padding, so that every answer starts at the same column.
        input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, p in enumerate(chunk):
            input_ids[row, width - len(p.prompt_ids) :] = torch.tensor(p.prompt_ids)
            attention[row, width - len(p.prompt_ids) :] = 1
        with fabric.autocast():
            out = model.generate(
                input_ids=input_ids.to(fabric.device),
                attention_mask=attention.to(fabric.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=stop_tokens(model, tokenizer),
            )
        for p, row in zip(chunk, out[:, width:]):
            correct += tokenizer.decode(row, skip_special_tokens=True).strip() == p.reference
    totals = fabric.all_reduce(torch.tensor([correct, len(mine)], dtype=torch.float64, device=fabric.device), reduce_op="sum")
    model.train(was_training)
    return float(totals[0] / totals[1].clamp(min=1))
