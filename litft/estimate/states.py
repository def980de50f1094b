"""What each rank holds, by strategy: parameters, gradients, optimizer states and the strategy's own buffers, in bytes.

The memory model of ``litft estimate``, kept apart from the strategies that train: each
strategy class says how it shards (``facts``: its shard group or ZeRO stage, and
``zero_section`` for DeepSpeed's config), and this module turns the model's tensors
into the fullest rank's bytes the way that strategy lays them out in a real run.
"""

import math
from typing import Dict, List, Optional, Tuple

from litft.config import Layout, TrainArgs
from litft.device import compute_dtype, element_size
from litft.estimate.memory import Param, Row, States
from litft.parallel.expert import local_share
from litft.parallel.tensor import split_over_tensor_parallel

# DeepSpeed's own defaults (deepspeed.runtime.zero.config), used when the config leaves them out.
DS_DEFAULTS = {"reduce_bucket_size": 5e8, "prefetch_bucket_size": 5e7, "param_persistence_threshold": 1e5, "max_live_parameters": 1e9}


def memory_layout(strategy, tensors: List[Param], layout: Layout, precision: str, train: TrainArgs, hidden_size: Optional[int] = None,
                  planned: Optional[dict] = None) -> States:
    """The fullest rank's states under ``strategy`` (a strategy class), from what it says of its sharding; ``planned``: the
    model's tensor-parallel block plan (``litft.parallel.tensor.block_plan``), None for Llama's layer names."""
    facts = strategy.facts(layout, precision)
    if facts["zero_stage"] is not None:
        return zero_states(tensors, strategy.zero_section(layout, precision, train, hidden_size), layout.world_size, precision)
    if facts["shard_group"] is not None:
        return fsdp_states(tensors, layout, precision, facts["shard_group"], planned)
    states = whole_model_states(tensors)
    if layout.world_size > 1:
        # DDP copies gradients into flat buckets for the all-reduce (gradient_as_bucket_view is off).
        states.buffers.append(("DDP gradient buckets", Row(states.grads.gpu)))
    return states


def whole_model_states(tensors: List[Param]) -> States:
    """Everything on one rank: parameters (4-bit ones packed), gradients and AdamW's two states of what trains."""
    trained = [t for t in tensors if t.trainable]
    grads = sum(t.nbytes for t in trained)
    return States(
        params=Row(sum(t.nbytes + t.quant_state for t in tensors)),
        grads=Row(grads),
        # torch's AdamW keeps exp_avg and exp_avg_sq in each parameter's dtype, and a 4-byte step per tensor.
        optimizer=Row(2 * grads + 4 * len(trained), note="AdamW exp_avg + exp_avg_sq"),
        step=Row(0, note="fused AdamW updates in place"),
    )


def fsdp_states(tensors: List[Param], layout: Layout, precision: str, shard: int, planned: Optional[dict] = None) -> States:
    """FSDP2's layout: shards of every unit, the units gathered in turn (two at a time, prefetched), a reduce-scatter buffer."""
    fsdp = layout.fsdp
    mixed = precision.endswith("-mixed")
    low = element_size(compute_dtype(precision))
    trained = [t for t in tensors if t.trainable]
    tp = layout.tensor_parallel
    # A tensor-parallel split comes first (whole heads per rank), FSDP shards what a rank keeps.
    kept = {t.name: 1 / tp if tp > 1 and split_over_tensor_parallel(t.name, planned) else 1.0 for t in tensors}
    local = {t.name: local_elements(t, shard) * kept[t.name] for t in tensors}
    # An expert group's experts are sharded over the ranks holding the same ones: 1/N of them over 1/N as many
    # ranks, the same share of each tensor, but FSDP gathers (and reduces) only this rank's experts.
    gathered_share = {name: share * local_share(name, layout.expert_parallel) for name, share in kept.items()}
    grads = sum(local[t.name] * t.itemsize for t in trained)
    ep = layout.expert_parallel
    params = Row(sum(local[t.name] * t.itemsize + t.quant_state for t in tensors), note=", ".join(filter(None, [
        f"blocks split 1/{tp}" if tp > 1 else "", f"experts dealt out 1/{ep}" if ep > 1 else "", f"shards of 1/{shard}" if shard > 1 else ""])))
    optimizer = Row(2 * grads + 4 * len(trained), note="AdamW exp_avg + exp_avg_sq of the shards")
    states = States(params=params, grads=Row(grads), optimizer=optimizer, step=Row(0, note="fused AdamW updates in place"))
    if fsdp.cpu_offload:
        states.params = params.moved_to_cpu("sharded, offloaded to CPU")
        states.grads = states.grads.moved_to_cpu("sharded, offloaded to CPU")
        states.optimizer = optimizer.moved_to_cpu("AdamW steps on the CPU")
        states.step = states.step.moved_to_cpu("")
    units, trained_units = _unit_sizes(tensors, low if mixed else None, gathered_share)
    root = units.pop("root", 0)
    if fsdp.sharding_strategy == "SHARD_GRAD_OP":
        gathered, how = root + sum(units.values()), "every unit stays gathered from forward to backward"
    else:
        # Units run in order (embeddings, blocks, head); the one in use and the next, prefetched, are
        # gathered together. The root is never resharded between forward and backward.
        blocks = sorted((u for u in units if u.startswith("block.")), key=lambda u: int(u.split(".")[1]))
        order = [units[u] for u in ("embeddings", *blocks, "head") if u in units]
        pairs = [a + b for a, b in zip(order, order[1:])] or order
        gathered, how = root + max(pairs, default=0), "root + the unit in use + the next, prefetched"
    states.buffers.append(("FSDP all-gathered parameters", Row(gathered, note=how)))
    reduce_bytes = 4 if mixed else low
    biggest = max(trained_units.values(), default=0)
    # Under accumulation the reduced shard is a buffer of its own until it is added to the earlier micro-batches' sum.
    reduced = biggest * (low + reduce_bytes + reduce_bytes / shard)
    states.buffers.append(("FSDP reduce-scatter", Row(reduced, note="one unit's unsharded gradients and their reduced shard")))
    return states


def local_elements(t: Param, shard: int) -> int:
    """Elements of ``t`` on rank 0 of its shard group: FSDP2 chunks dim 0 and rank 0 gets the first (largest) chunk."""
    if shard == 1 or t.quantized:  # 4-bit weights are ignored by FSDP and stay whole
        return t.numel
    rows = t.shape[0] if t.shape else 1
    return min(rows, math.ceil(rows / shard)) * (t.numel // max(rows, 1))


def _unit_sizes(tensors: List[Param], gathered_itemsize: Optional[int], kept: Dict[str, float]) -> Tuple[Dict[str, float], Dict[str, float]]:
    """Bytes of every unit when gathered (in the compute dtype under mixed precision), and trained elements per unit.

    ``kept``: the share of each tensor a rank's FSDP gathers (less than all of it where tensor parallel split it).
    """
    units: Dict[str, float] = {}
    trained: Dict[str, float] = {}
    for t in tensors:
        if t.quantized:
            continue
        units[t.unit] = units.get(t.unit, 0) + t.numel * kept[t.name] * (gathered_itemsize or t.itemsize)
        if t.trainable:
            trained[t.unit] = trained.get(t.unit, 0) + t.numel * kept[t.name]
    return units, trained


def _zero_setting(zero: dict, name: str) -> float:
    """A ZeRO size from the config, under its name or its stage3_ alias; DeepSpeed's default when absent or "auto"."""
    for key in (name, f"stage3_{name}"):
        if zero.get(key, "auto") != "auto":
            return float(zero[key])
    return DS_DEFAULTS[name]


def zero_states(tensors: List[Param], zero: dict, world: int, precision: str) -> States:
    """ZeRO's layout: bit16 (or fp32) parameters, an fp32 master partition, Adam on the master, flat buckets."""
    stage = int(zero.get("stage", 0))
    half = precision.startswith(("bf16", "16"))  # DeepSpeed then casts the whole module
    model_bytes = 2 if half else 4

    def stored(t: Param) -> float:
        return t.itemsize if t.quantized else model_bytes

    def part(numel: int) -> int:
        return -(-numel // world)

    trained = [t for t in tensors if t.trainable]
    total_trained = sum(t.numel for t in trained)
    if stage == 3:  # every parameter is partitioned on its own
        params = sum(part(t.numel) * stored(t) + t.quant_state for t in tensors)
        partition = sum(part(t.numel) for t in trained)
    else:
        params = sum(t.numel * stored(t) + t.quant_state for t in tensors)
        partition = part(total_trained)
    states = States(params=Row(params, note=f"partitions of 1/{world}" if stage == 3 else ""), grads=Row(), optimizer=Row())
    if stage == 0:
        states.grads = Row(total_trained * model_bytes)
        if half:  # DeepSpeed's FP16_Optimizer: an fp32 master copy of the whole model, Adam on it
            states.optimizer = Row(12 * total_trained + 4, note="fp32 master + AdamW exp_avg + exp_avg_sq")
            states.step = Row(4 * total_trained, note="fp32 copy of the gradients")
        else:
            states.optimizer = whole_model_states(tensors).optimizer
            states.step = Row(0, note="fused AdamW updates in place")
    else:
        # Stage 1 keeps every gradient until the boundary's reduction; 2 and 3 keep their partition.
        states.grads = Row((total_trained if stage == 1 else partition) * model_bytes, note="" if stage == 1 else f"partition of 1/{world}")
        states.optimizer = Row(12 * partition + 4, note=f"fp32 master + AdamW exp_avg + exp_avg_sq, 1/{world}")
        states.step = Row(4 * partition * (2 if half else 1), note="AdamW temporaries on the fp32 partition")
    _offload(states, zero, params, partition)
    if stage >= 1:
        bucket = _zero_setting(zero, "reduce_bucket_size")
        double = stage < 3 and zero.get("overlap_comm") is True
        if zero.get("contiguous_gradients", True):
            note = f"{bucket:.0e} elements" + (" x 2 (overlap_comm)" if double else "")
            states.buffers.append(("DeepSpeed reduce bucket", Row(bucket * model_bytes * (2 if double else 1), note=note)))
    if stage == 3:
        blocks: Dict[str, int] = {}
        for t in tensors:
            blocks[t.unit] = blocks.get(t.unit, 0) + t.numel
        prefetch, live = _zero_setting(zero, "prefetch_bucket_size"), _zero_setting(zero, "max_live_parameters")
        gathered = min(live, 2 * max(blocks.values(), default=0) + prefetch) * model_bytes
        threshold = _zero_setting(zero, "param_persistence_threshold")
        persistent = sum(t.numel * stored(t) for t in tensors if t.numel < threshold)
        note = "2 blocks + prefetch bucket + small persistent ones"
        states.buffers.append(("ZeRO-3 gathered parameters", Row(gathered + persistent, note=note)))
    return states


def _offload(states: States, zero: dict, params: float, partition: int) -> None:
    """Move what ZeRO's offload settings keep off the GPU into the CPU column (NVMe holds it on disk)."""
    offload_optimizer = (zero.get("offload_optimizer") or {}).get("device")
    offload_param = (zero.get("offload_param") or {}).get("device")
    if offload_optimizer in ("cpu", "nvme"):
        where = "CPU" if offload_optimizer == "cpu" else "NVMe"
        states.optimizer = Row(0, states.optimizer.gpu if offload_optimizer == "cpu" else 0, f"offloaded to {where}")
        # The reduced fp32 partition of the gradients lives beside it; the step runs on the CPU.
        states.grads = Row(0, 4 * partition if offload_optimizer == "cpu" else 0, f"fp32 partition, on {where}")
        states.step = Row(0, states.step.gpu if offload_optimizer == "cpu" else 0)
    if offload_param in ("cpu", "nvme"):
        where = "CPU" if offload_param == "cpu" else "NVMe"
        states.params = Row(0, params if offload_param == "cpu" else 0, f"partitions offloaded to {where}")
