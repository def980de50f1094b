"""The estimate itself: the job's model and checks, the strategy's layout, the traced activations, and the table."""

import functools
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import List, Optional, Tuple

from litft.run.build import build_model
from litft.config import DEFAULT_GLOBAL_BATCH_SIZE, Layout, LoraArgs, TrainArgs
from litft.objectives.args import ObjectiveArgs
from litft.device import compute_dtype, element_size
from litft.errors import LitftError
from litft.estimate.inventory import model_tensors
from litft.estimate.states import memory_layout
from litft.estimate.trace import trace_activations, trace_image_encoder
from litft.model.flops import expert_count, experts_per_token, flops_per_token
from litft.model.recurrent import carries_state, text_config
from litft.data.images import load_processor
from litft.model.vision import reading_images, sees_images, tokens_per_image
from litft.run.plan import DATA_KINDS, Facts, installed_packages, refuse, rollout_engine, split_refusal
from litft.run.logs import quiet_libraries
from litft.estimate.memory import GiB, Row
from litft.model.loading import check_architecture, load_config, resolve_model
from litft.objectives import build_objective
from litft.parallel.mesh import layout_data_world
from litft.parallel.expert import is_expert_tensor
from litft.parallel.strategies import checked_strategy_class
from litft.parallel.tensor import block_plan, one_rank_of

# Memory as torch.cuda reports total_memory, in GiB (a little under the marketed size).
GPUS = {
    "H100": 79.2, "H100-80GB": 79.2, "H100-94GB": 93.1, "H200": 139.8, "GH200": 94.5, "B200": 178.4,
    "A100": 79.3, "A100-80GB": 79.3, "A100-40GB": 39.6, "L40S": 44.5, "L40": 44.5, "L4": 22.0, "A10G": 22.0, "A10": 22.0,
    "V100": 31.7, "V100-32GB": 31.7, "V100-16GB": 15.8, "T4": 14.6, "RTX4090": 23.6, "RTX3090": 23.6, "MI300X": 191.5,
}
NO_BF16 = ("V100", "T4")
# The CUDA context with cuBLAS workspaces (about 0.5 GiB with lazy module loading),
# and NCCL's communicators and channel buffers once there is more than one rank.
CUDA_CONTEXT = 0.5 * GiB
NCCL_BUFFERS = 0.5 * GiB


def device_memory(gpu: str, memory_gb: Optional[float]) -> Tuple[str, float]:
    if memory_gb is not None:
        if memory_gb <= 0:
            raise LitftError(f"--device_memory_gb must be positive, got {memory_gb}")
        return f"{memory_gb:g} GiB device", memory_gb * GiB
    names = {name.upper().replace(" ", "").replace("_", "-"): name for name in GPUS}
    key = gpu.upper().replace(" ", "").replace("_", "-")
    if key not in names:
        raise LitftError(f"--gpu {gpu} is unknown; choose one of {', '.join(GPUS)} or give --device_memory_gb")
    return names[key], GPUS[names[key]] * GiB


def checked_run(flags: dict, precision: str):
    """The job's flag groups, checked with the jobs' own checks: the layout, its strategy, LoRA and a one-step train."""
    if flags["seq_len"] is not None and flags["seq_len"] < 1:
        raise LitftError("--seq_len must be at least 1")
    if not 0 <= flags["headroom"] < 1:
        raise LitftError(f"--headroom is a share of device memory between 0 and 1, got {flags['headroom']}")
    if flags["quantize"] is not None and flags["job"] != "finetune_lora":
        raise LitftError("--quantize trains 4-bit weights only through LoRA adapters; use finetune_lora")
    layout = Layout.of(flags)
    lora = None
    if flags["job"] == "finetune_lora":
        lora = LoraArgs(flags["lora_r"], flags["lora_alpha"], flags["lora_dropout"], flags["lora_target_modules"], flags["quantize"])
        lora.check()
    train: TrainArgs = flags["train"]
    # Accumulation does not change memory: one micro-batch per rank and step stands for any global batch.
    one_step = replace(train, global_batch_size=max(train.micro_batch_size, 1) * max(layout_data_world(layout), 1))
    one_step.check(max(layout_data_world(layout), 1))
    strategy = checked_strategy_class(layout, flags.get("accelerator", "cuda"), precision)
    return layout, lora, one_step, strategy


def objective_of(flags: dict) -> ObjectiveArgs:
    objective = ObjectiveArgs.of(flags.get("objective"))
    objective.check()
    return objective


def refuse_combinations(flags: dict, precision: str, layout, strategy, objective: ObjectiveArgs, config) -> None:
    """The run plan's refusals that the estimate can judge (litft.run.plan): the objective with the job, the splits with
    the model; the data and the machine it does not see."""
    lora = flags["job"] == "finetune_lora"
    refuse(Facts(job=flags["job"], accelerator=flags.get("accelerator", "cuda"), precision=precision, strategy=strategy.name, strategy_compiles=strategy.compiles,
                 context=layout.context_parallel, tensor=layout.tensor_parallel, expert=layout.expert_parallel, lora=lora,
                 quantize=flags["quantize"] if lora else None, objective=objective.name, beta=objective.effective_beta,
                 precompute_reference=objective.precompute_reference, data_kind=DATA_KINDS[objective.name][-1],
                 model_type=text_config(config).model_type, split_refusal=split_refusal(config, layout, flags["quantize"])))


def experts_facts(config, tensors, size: int, tokens: int, itemsize: int, seq_len: int) -> Optional[dict]:
    """A MoE model's experts as the estimate shows them: a rank's share, the tokens' dispatch buffers, the active FLOPs."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    router = expert_count(text)
    if router <= 1:
        return None
    top_k = int(experts_per_token(text) or 1)
    every = sum(t.numel for t in tensors)
    experts = sum(t.numel for t in tensors if is_expert_tensor(t.name))
    return {
        "per_layer": router, "per_rank": router // size, "top_k": top_k,
        # Sent and received: every (token, expert) row of the layer leaves and arrives (balanced routing), then returns.
        "dispatch_bytes": 2 * tokens * top_k * text.hidden_size * itemsize,
        # Layers that carry state have no FLOPs count yet (litft.model.flops): no figure rather than attention's in every layer.
        "flops_per_token": None if carries_state(config) else flops_per_token(config, seq_len),
        "active_parameters": int(every - experts * (1 - top_k / router)),
    }


def tokens_of_images(flags: dict, config, folder: str) -> Tuple[int, Optional[str]]:
    """Tokens each image of ``--image_size`` becomes, by the model's processor, and the size as WIDTHxHEIGHT; 0 without the flag."""
    size = flags.get("image_size")
    if size is None:
        return 0, None
    if not sees_images(config):
        raise LitftError(f"--image_size is for vision-language models; litft trains {config.model_type} on text only")
    if flags.get("images", 1) < 1:
        raise LitftError("--images is the number of images in each sample, at least 1")
    try:
        width, height = (int(side) for side in (size.lower().split("x") if "x" in size.lower() else (size, size)))
    except ValueError:
        raise LitftError(f"--image_size {size}: give WIDTHxHEIGHT in pixels (448x448) or one side (448)") from None
    if min(width, height) < 1:
        raise LitftError(f"--image_size {size}: both sides must be at least 1 pixel")
    return _tokens_per_image(folder, width, height), f"{width}x{height}"


@functools.lru_cache(maxsize=8)
def _tokens_per_image(folder: str, width: int, height: int) -> int:  # --longest estimates again at each length
    return tokens_per_image(load_processor(folder), width, height)


def plan_memory(flags: dict) -> dict:
    """Everything ``litft estimate`` prints, as a dict of bytes."""
    on_cpu = flags.get("accelerator", "cuda") == "cpu"
    gpu_name, capacity = host_memory(flags["device_memory_gb"]) if on_cpu else device_memory(flags["gpu"], flags["device_memory_gb"])
    precision = flags["precision"] or ("32-true" if on_cpu else "16-mixed" if gpu_name.upper().startswith(NO_BF16) else "bf16-mixed")
    objective = objective_of(flags)
    flags = {**flags, "seq_len": flags.get("seq_len") or (GRPO_PROMPT if objective.rl else 2048)}
    layout, lora, train, strategy = checked_run(flags, precision)
    quiet_libraries()
    source = flags["model"]
    if source.endswith(".json") and Path(source).is_file():
        source = str(Path(source).parent)
    # A run on image records builds a composite folder's image-text model (Qwen3.5), where a text run builds its text model.
    config = reading_images(load_config(resolve_model(source))) if flags.get("image_size") else load_config(resolve_model(source))
    check_architecture(config)
    refuse_combinations(flags, precision, layout, strategy, objective, config)
    if flags["attention"] is not None:
        config._attn_implementation = flags["attention"]
    built = build_objective(objective, lora is not None)
    frozen_dtype = strategy.frozen_base_dtype(precision)
    model = build_model(config, precision, lora, False, frozen_dtype=frozen_dtype)
    attention = model.config._attn_implementation  # as built: a composite folder's own config names none for its text model
    tensors = model_tensors(model, flags["quantize"])
    del model
    states = memory_layout(strategy, tensors, layout, precision, train, hidden_size=text_config(config).hidden_size, planned=block_plan(config))
    # A context group splits every row: a rank holds its slice's activations, and around attention whole rows of
    # heads / N heads, the same size.
    image_tokens, image_size = tokens_of_images(flags, config, resolve_model(source))
    # RL trains on each prompt and its completion; a vision-language model's sample holds its images' tokens too.
    row_len = flags["seq_len"] + (objective.max_new_tokens if objective.rl else 0) + flags.get("images", 1) * image_tokens
    tokens_per_rank = -(-row_len // layout.context_parallel)
    # Offloading saves nothing where the device is the host: the CPU's estimate traces the run without it.
    traced = trace_both(config, strategy, layout, precision, lora, replace(train, activation_offload=train.activation_offload and not on_cpu),
                        tokens_per_rank, frozen_dtype, objective, flags.get("one_mode", False))
    encoder = trace_encoder(config, strategy, layout, precision, lora, train, frozen_dtype, resolve_model(source), flags.get("images", 1),
                            built.rows_per_sample, image_size)
    traced = {k: with_encoder(a, encoder) for k, a in traced.items()}
    itemsize = element_size(compute_dtype(precision))
    experts = experts_facts(config, tensors, layout.expert_parallel, train.micro_batch_size * tokens_per_rank * built.rows_per_sample,
                            itemsize, flags["seq_len"])
    buffers = buffers_of(states, tensors, flags["quantize"], itemsize, experts if layout.expert_parallel > 1 else None)
    engine = rollout_engine(objective.rl, objective.engine, "cpu" if on_cpu else "cuda", installed_packages(), flags["quantize"],
                            expert_count(text_config(config)) > 1 or sees_images(config))
    generation = sampling_row(engine, flags, objective, built, config, tensors, states, strategy, layout, itemsize, capacity)
    report = {
        "model": flags["model"], "job": flags["job"], **strategy.facts(layout, precision), "world_size": layout.world_size,
        "precision": precision, "quantize": flags["quantize"], "micro_batch_size": train.micro_batch_size, "objective": objective.name,
        "reference": built.describe() or "", "seq_len": flags["seq_len"], "context_parallel": layout.context_parallel,
        "tensor_parallel": layout.tensor_parallel, "expert_parallel": layout.expert_parallel, "experts": experts,
        "gradient_checkpointing": train.gradient_checkpointing, "attention": attention,
        "activation_offload": train.activation_offload, "tiled_mlp": train.tiled_mlp, "vision": sees_images(config),
        "image_size": image_size, "images": flags.get("images", 1), "tokens_per_image": image_tokens,
        "image_encoder": {"peak": encoder.peak, "kept": encoder.saved} if encoder else None,
        "parameters": {"total": sum(t.numel for t in tensors), "trained": sum(t.numel for t in tensors if t.trainable),
                       "quantized": sum(t.numel for t in tensors if t.quantized)},
        "quant_state_bytes": sum(t.quant_state for t in tensors),
    }
    report.update(accelerator="cpu" if on_cpu else "cuda", engine=engine, prompts_per_call=prompts_per_call(flags, objective, layout), row_len=row_len)
    return {**report, **totals(states, buffers, traced, train.gradient_checkpointing, generation, layout, gpu_name, capacity, flags["headroom"],
                               context=0 if on_cpu else CUDA_CONTEXT + (NCCL_BUFFERS if layout.world_size > 1 else 0))}


def longest_sequence(flags: dict) -> dict:
    """The estimate at the longest ``--seq_len`` that fits the device with these flags, its ``longest_seq_len`` set: the
    search (``search_longest``) traces the run's checkpointing only (a trace's time grows with its length, about 25 s at
    256k tokens for an 8B); the answer is then estimated in full."""
    if objective_of(flags).rl:
        raise LitftError("--longest searches a training sequence's length; under grpo give --seq_len and --objective.max_new_tokens")

    def over(seq: int) -> Tuple[float, float]:
        plan = plan_memory({**flags, "seq_len": seq, "longest": False, "one_mode": True})
        return plan["total"]["gpu"] - plan["device"]["usable"], plan["device"]["usable"]

    start = flags.get("seq_len") or 2048
    fits = search_longest(over, start)
    if not fits:
        raise LitftError(f"not even {start} tokens fit {flags['gpu']} with these flags; lower --seq_len, or see litft estimate without --longest")
    return {**plan_memory({**flags, "seq_len": fits, "longest": False}), "longest_seq_len": fits}


def search_longest(over, start: int, probes: int = 12) -> int:
    """The longest length (a multiple of 64 above ``start``) whose ``over(length)`` (bytes past the usable memory, and that
    memory) is not positive, within 1% or 64 tokens; 0 if ``start`` does not fit.

    Memory grows about linearly with the sequence (quadratically only under eager attention): a secant step from two
    points lands near the answer, a length that fits with under 1% to spare is checked one step (1%) further, and a
    guess outside the bracket (longest fitting, shortest not) halves it instead.
    """
    fits, fails, points = 0, math.inf, []

    def measure(seq: int) -> None:
        nonlocal fits, fails
        excess, usable = over(seq)
        points.append((seq, excess, usable))
        if excess <= 0:
            fits = max(fits, seq)
        else:
            fails = min(fails, seq)

    measure(start)
    measure(min(16 * start, start + 65536))  # far enough from the short sequence's fixed costs for the line through both to point well
    while fails - fits > max(64, fits // 100) and len(points) < probes:
        (s0, f0, _), (s1, f1, usable) = points[-2], points[-1]
        if -0.01 * usable < f1 <= 0:  # the latest fits with under 1% to spare: is one step more already too long?
            guess = max(fits + 64, (fits + fits // 100) // 64 * 64)
        else:
            guess = s1 - f1 * (s1 - s0) / (f1 - f0) if f1 != f0 else 4 * s1
            guess = int(guess) // 64 * 64
        if not fits < guess < fails:  # outside the bracket: halve it (or keep growing while nothing has failed)
            guess = 4 * fits if fails == math.inf else (fits + fails) // 2 // 64 * 64
        if guess <= fits:  # the bracket is narrower than the rounding
            break
        measure(guess)
    return fits


def sampling_row(engine, flags, objective, built, config, tensors, states, strategy, layout, itemsize: int, capacity: float) -> Row:
    """What RL's sampling holds between steps, while the step's activations are freed (counted as their max): vLLM's share of
    the device, its weights on the host while it sleeps through the step; or a generate call's KV cache and sampler rows,
    with the rest of a sharded model gathered once for the call."""
    whole = int(sum(t.numel * (t.itemsize if t.quantized else itemsize) for t in tensors))
    if engine == "vllm":  # it is served the base with the adapters merged in
        served = int(sum(t.numel * itemsize for t in tensors if ".lora_" not in t.name))
        return Row(objective.vllm_memory * capacity, served, note=f"vLLM's share (--objective.vllm_memory {objective.vllm_memory:g}: its "
                   "weights and KV cache) while sampling; asleep through the step, its weights on the host")
    generation = built.generation_bytes(config, flags["seq_len"], itemsize, prompts_per_call(flags, objective, layout))
    if generation and strategy.gathers_weights_for(layout):  # FSDP and ZeRO-3 gather the whole model once for each generate call
        generation += whole - int(states.params.gpu)
    return Row(generation, 0, note="a generate call's KV cache, sampler rows and (sharded) the rest of the model gathered, while "
               "activations are freed: counted as their max")


GRPO_PROMPT = 512  # tokens of a prompt where --seq_len is left out under grpo (GSM8K's chat prompts are about 150)


def prompts_per_call(flags: dict, objective: ObjectiveArgs, layout) -> int:
    """Prompts whose groups one generate call samples together: --objective.generation_batch, or the run's default."""
    if not objective.rl:
        return 1
    if objective.generation_batch is not None:
        return objective.generation_batch
    train = flags["train"]
    data_world = max(layout_data_world(layout), 1)
    per_rank = max((train.global_batch_size or DEFAULT_GLOBAL_BATCH_SIZE) // data_world, 1)
    return next(n for n in (16, 8, 4, 2, 1) if per_rank % n == 0)


def host_memory(memory_gb: Optional[float]) -> Tuple[str, float]:
    """A CPU run's memory: the machine's, or --device_memory_gb."""
    if memory_gb is not None:
        return device_memory("", memory_gb)
    return "CPU (host memory)", float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def trace_both(config, strategy, layout, precision: str, lora, train, tokens_per_rank: int, frozen_dtype, objective,
               one_mode: bool = False) -> dict:
    """The activations of one micro-batch on one rank, traced with activation checkpointing on and off (``one_mode``: the
    run's own only, standing for both: ``longest_sequence``'s probes read only the run's total)."""
    params_dtype, autocast = strategy.compute_view(layout, precision)
    traced = {}
    for checkpointing in (train.gradient_checkpointing,) if one_mode else (train.gradient_checkpointing, not train.gradient_checkpointing):
        build = {"precision": precision, "lora": lora, "gradient_checkpointing": checkpointing, "frozen_dtype": frozen_dtype,
                 "tiled_mlp": train.tiled_mlp}
        traced[checkpointing] = trace_activations(
            one_rank_of(config, layout.tensor_parallel), build, params_dtype, autocast, train.micro_batch_size, tokens_per_rank,
            objective=objective, offload=train.activation_offload,
        )
    traced.setdefault(not train.gradient_checkpointing, traced[train.gradient_checkpointing])
    return traced


def trace_encoder(config, strategy, layout, precision: str, lora, train, frozen_dtype, folder: str, per_sample: int, rows_per_sample: int,
                  image_size: Optional[str]):
    """The image encoder's activations for one micro-batch's images of ``image_size`` (WIDTHxHEIGHT), or None without
    images or where litft cannot run the encoder alone (litft.estimate.trace.trace_image_encoder)."""
    if image_size is None:
        return None
    params_dtype, autocast = strategy.compute_view(layout, precision)
    build = {"precision": precision, "lora": lora, "gradient_checkpointing": train.gradient_checkpointing, "frozen_dtype": frozen_dtype}
    width, height = (int(side) for side in image_size.split("x"))
    return trace_image_encoder(config, build, params_dtype, autocast, load_processor(folder), width, height, per_sample,
                               train.micro_batch_size * rows_per_sample)


def with_encoder(activations, encoder):
    """The step's activations with the images' run through the encoder before the language model: what that leaves stays
    live through the step."""
    if encoder is None:
        return activations
    return replace(activations, peak=max(encoder.peak, activations.peak + encoder.saved), saved=activations.saved + encoder.saved)


def buffers_of(states, tensors, quantize: Optional[str], itemsize: int, experts: Optional[dict]) -> list:
    """What a rank holds beside the states and activations: the strategy's buffers, a 4-bit layer dequantized, the dispatch."""
    buffers = list(states.buffers)
    if quantize is not None:
        biggest = max((t.numel for t in tensors if t.quantized), default=0)
        buffers.append(("bnb dequantized weight", Row(biggest * itemsize, note="the largest 4-bit layer, during its matmul")))
    if experts:
        buffers.append(("expert dispatch (all-to-all)", Row(experts["dispatch_bytes"], note="one MoE layer's (token, expert) rows, sent and received")))
    return buffers


def totals(states, buffers, traced: dict, checkpointing: bool, generation: Row, layout, gpu_name: str, capacity: float, headroom: float,
           context: int) -> dict:
    """Each rank's rows and what they add up to, against the device's usable memory (``context``: CUDA's and NCCL's own)."""
    acts, other = traced[checkpointing], traced[not checkpointing]
    gpu_fixed = states.params.gpu + states.grads.gpu + states.optimizer.gpu + context
    gpu_buffers = sum(row.gpu for _, row in buffers)
    gpu_total = gpu_fixed + max(acts.peak + gpu_buffers, states.step.gpu, generation.gpu + gpu_buffers)
    gpu_total_other = gpu_fixed + max(other.peak + gpu_buffers, states.step.gpu, generation.gpu + gpu_buffers)
    cpu_total = (states.params.cpu + states.grads.cpu + states.optimizer.cpu + sum(row.cpu for _, row in buffers) + states.step.cpu
                 + generation.cpu + acts.offloaded)
    usable = capacity * (1 - headroom)

    def row(r: Row) -> dict:
        return {"gpu": int(r.gpu), "cpu": int(r.cpu), "note": r.note}

    return {
        "per_rank": {
            "params": row(states.params), "grads": row(states.grads), "optimizer": row(states.optimizer),
            "activations": {"gpu": acts.peak, "cpu": acts.offloaded, "note": ""}, "buffers": {name: row(r) for name, r in buffers},
            "cuda_context": {"gpu": int(context), "cpu": 0, "note": "CUDA context" + (" + NCCL" if layout.world_size > 1 and context else "")},
            "optimizer_step": row(states.step), "generation": row(generation),
        },
        "activations": {"peak": acts.peak, "saved": acts.saved, "per_layer": acts.per_layer, "outside_layers": acts.outside_layers,
                        "with_checkpointing": traced[True].peak, "without_checkpointing": traced[False].peak},
        "total": {"gpu": int(gpu_total), "cpu": int(cpu_total)},
        # The same run with activation checkpointing switched the other way.
        "total_other_checkpointing": {"gradient_checkpointing": not checkpointing, "gpu": int(gpu_total_other)},
        "device": {"name": gpu_name, "memory": int(capacity), "usable": int(usable), "headroom": headroom},
        "fits": gpu_total <= usable,
    }


def _gib(n: float) -> str:
    return f"{n / GiB:8.2f}"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def vision_line(plan: dict) -> str:
    counted = "vision: the image encoder's and projector's parameters are counted (the encoder frozen); "
    if not plan.get("image_size"):
        return counted + ("the trace runs the language model on text: give --image_size to trace the images through the encoder "
                          "and count their tokens")
    encoder = plan.get("image_encoder")
    traced = ("the encoder runs alone only inside this model's forward, so its activations are not traced" if encoder is None else
              f"the micro-batch's images through the encoder peak at {encoder['peak'] / GiB:.2f} GiB and leave "
              f"{encoder['kept'] / GiB:.2f} GiB live through the step (in the activations row)")
    return (counted + f"each {plan['image_size']} image is {plan['tokens_per_image']:,} tokens by the model's processor, and a sample holds "
            f"{plan['images']} beside its {plan['seq_len']:,} text tokens; {traced}")


def render(plan: dict) -> str:
    """The estimate as a table, in GiB per rank."""
    device = "GPU" if plan.get("accelerator", "cuda") == "cuda" else "device"
    lines = heading(plan) + ["", f"{'per rank (the fullest), GiB':<34}{device:>8}  {'CPU':>8}"]
    return "\n".join(lines + rows(plan))


def heading(plan: dict) -> List[str]:
    """What is estimated: the model, job, layout, batch and what the objective adds."""
    p = plan["parameters"]
    what = {"finetune_lora": "LoRA", "finetune_full": "full finetune", "pretrain": "pretrain"}[plan["job"]]
    if plan["quantize"]:
        what += f" on a {plan['quantize']} base"
    layout = plan["strategy"]
    if plan["shard_group"] is not None:
        one_group = plan["strategy"].endswith("HYBRID_SHARD") and plan["shard_group"] == plan["world_size"]
        layout += f" (one shard group of {plan['shard_group']}: FULL_SHARD)" if one_group else f" (shard group {plan['shard_group']})"
    lines = [
        f"litft estimate: {plan['model']}, {what}, {layout}, world size {plan['world_size']}, {plan['precision']}",
        f"{_count(p['total'])} parameters, {_count(p['trained'])} trained; "
        f"micro batch {plan['micro_batch_size']} x {plan.get('row_len', plan['seq_len'])} tokens"
        + (f" split over {plan['context_parallel']} ranks (context parallel)" if plan["context_parallel"] > 1 else "")
        + (f", blocks split over {plan['tensor_parallel']} ranks (tensor parallel)" if plan["tensor_parallel"] > 1 else "") + ", "
        f"activation checkpointing {'on' if plan['gradient_checkpointing'] else 'off'}, {plan['attention']} attention"
        + (", activations offloaded to host memory" if plan.get("activation_offload") else "")
        + (", tiled MLP" if plan.get("tiled_mlp") else ""),
        *([f"experts: {e['per_rank']} of {e['per_layer']} per MoE layer on each rank"
           + (f" (dealt out over {plan['expert_parallel']} ranks)" if plan["expert_parallel"] > 1 else "")
           + f", {e['top_k']} per token; {_count(e['active_parameters'])} active parameters per token"
           + ("" if e["flops_per_token"] is None else f", {e['flops_per_token'] / 1e9:.2f} GFLOPs per token trained (forward and backward)")
           for e in [plan.get("experts")] if e]),
        *([vision_line(plan)] if plan.get("vision") else []),
        *([f"objective {plan['objective']}: {plan['micro_batch_size']} pairs per micro-batch (two sequences each); reference: {plan['reference']}"]
          if plan.get("objective", "sft") not in ("sft", "grpo") else []),
        *([f"objective grpo: {plan['micro_batch_size']} completions per micro-batch, each a prompt of up to {plan['seq_len']} tokens and "
           f"its completion; sampling {plan['prompts_per_call']} prompts' groups per generate call with {plan['engine']}; "
           f"KL reference: {plan['reference']}"]
          if plan.get("objective") == "grpo" else []),
    ]
    return lines


def rows(plan: dict) -> List[str]:
    """The table's rows, its total, and whether it fits."""
    rank, acts, lines = plan["per_rank"], plan["activations"], []

    def line(label: str, item: dict, note: str = "") -> None:
        note = note or item.get("note", "")
        lines.append(f"{label:<34}{_gib(item['gpu'])}  {_gib(item['cpu'])}  {note}".rstrip())

    line("parameters", rank["params"])
    line("gradients", rank["grads"])
    line("optimizer states", rank["optimizer"])
    other = acts["without_checkpointing"] if plan["gradient_checkpointing"] else acts["with_checkpointing"]
    line(
        "activations (peak)", rank["activations"],
        f"{acts['per_layer'] / GiB:.2f} per layer + {acts['outside_layers'] / GiB:.2f} the rest (a block's backward, head, "
        "embeddings, loss); "
        f"{other / GiB:.2f} {'without' if plan['gradient_checkpointing'] else 'with'} checkpointing",
    )
    for name, item in rank["buffers"].items():
        line(name, item)
    if rank["cuda_context"]["gpu"]:
        line("CUDA context", rank["cuda_context"])
    step = rank["optimizer_step"]
    if step["gpu"] or step["cpu"]:
        line("optimizer step (temporary)", step, "while activations are freed: counted as max(step, activations + buffers)")
    if rank.get("generation", {}).get("gpu"):
        line("sampling (between steps)", rank["generation"], rank["generation"]["note"])
    total = plan["total"]
    lines.append("-" * 54)
    lines.append(f"{'peak':<34}{_gib(total['gpu'])}  {_gib(total['cpu'])}")
    device = plan["device"]
    spare = device["usable"] - total["gpu"]
    verdict = f"fits, {spare / GiB:.1f} GiB to spare" if plan["fits"] else f"does NOT fit, {-spare / GiB:.1f} GiB short"
    lines.append(
        f"{device['name']}: {device['memory'] / GiB:.1f} GiB, {device['usable'] / GiB:.1f} usable with "
        f"{device['headroom']:.0%} headroom -> {verdict}"
    )
    if plan.get("longest_seq_len"):
        lines.append(f"longest sequence that fits: {plan['longest_seq_len']:,} tokens per sample at micro batch {plan['micro_batch_size']} "
                     "(within 1%; the table is that run)")
    other = plan["total_other_checkpointing"]
    if not plan["fits"] and other["gpu"] < total["gpu"]:
        fits = "fits" if other["gpu"] <= device["usable"] else "still does not fit"
        flag = str(other["gradient_checkpointing"]).lower()
        lines.append(f"with --train.gradient_checkpointing {flag}: {other['gpu'] / GiB:.2f} GiB, {fits}")
    return lines


# ---------------------------------------------------------------- measuring a real step, to check the estimate

