"""DeepSpeed's training state in litft's checkpoint layout: the one a plain AdamW run has.

DeepSpeed keeps the fp32 master of every trained weight and AdamW's two states in
flat buffers split over the ranks, laid out by the ZeRO stage and the world size.
litft writes them per parameter instead, named and shaped as ``get_state_dict``
names a plain AdamW run's state (``model.<name>``,
``optimizer.state.<name>.{step,exp_avg,exp_avg_sq}``, ``optimizer.param_groups``),
each tensor split by rows over the ranks. The checkpoint then resumes on any world
size, at any stage and under any other strategy (and they resume here), and
``litft convert`` reads it as any other.

A parameter is whole on a rank only while it is moved: DeepSpeed's getters gather
it (collectives: every rank walks the parameters in the same order), each rank
keeps its rows of it and drops the rest.
"""

from itertools import chain
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from litft.errors import LitftError

STATES = ("exp_avg", "exp_avg_sq")
Whole = Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]  # fp32 master, exp_avg, exp_avg_sq
Named = Tuple[List[str], torch.nn.Parameter]  # a trained parameter and its names, the optimizer's first


def row_range(rows: int, rank: int, world: int) -> Tuple[int, int]:
    """The rows a rank holds of a tensor split as DTensor's Shard(0) splits it: chunks of ceil(rows / world)."""
    size = -(-rows // world)
    start = min(rank * size, rows)
    return start, min(start + size, rows)


class RowShards:
    """Tensors split by rows over every rank, as DTensors on a 1-D CPU mesh: what DCP stores by name and global shape.

    The rows stay in CPU memory whatever the accelerator, so a save adds nothing to
    the GPU; gathering them back runs on ``device``, where the backend communicates.
    """

    def __init__(self, device: torch.device, mesh):
        self.device, self.mesh = device, mesh  # mesh: every rank, on the CPU (litft.parallel.mesh.Mesh.rows_mesh)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def _wrap(self, local: torch.Tensor, shape: torch.Size) -> DTensor:
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)

    def split(self, whole: torch.Tensor) -> DTensor:
        start, stop = row_range(whole.shape[0], self.rank, self.world)
        return self._wrap(whole[start:stop].to("cpu", copy=True), whole.shape)

    def empty(self, shape: torch.Size) -> DTensor:
        start, stop = row_range(shape[0], self.rank, self.world)
        return self._wrap(torch.empty((stop - start, *shape[1:])), shape)

    def whole(self, rows: DTensor) -> torch.Tensor:
        """The whole tensor on every rank, from every rank's rows (a collective)."""
        shape, local = rows.shape, rows.to_local()
        size = -(-shape[0] // self.world)
        padded = torch.zeros((size, *shape[1:]), dtype=local.dtype, device=self.device)
        padded[: local.shape[0]].copy_(local)
        pieces = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(pieces, padded)
        return torch.cat(pieces)[: shape[0]]


def _step_tensor(step: float, group: dict, device: torch.device) -> torch.Tensor:
    """AdamW's step count as torch keeps it: on the parameters' device for the fused and capturable kernels."""
    on_device = group.get("fused") or group.get("capturable")
    return torch.tensor(float(step), dtype=torch.float32, device=device if on_device else "cpu")


class ZeroMasters:
    """ZeRO stages 1-3 and DeepSpeed's bf16 optimizer: a parameter's master and states are fragments of flat partitions."""

    FLATS = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition")

    def __init__(self, zero):
        self.zero, self.inner = zero, zero.optimizer
        self.flats = next(getattr(zero, name) for name in self.FLATS if hasattr(zero, name))
        self.stage3 = hasattr(zero, "fp32_partitioned_groups_flat")

    def step(self) -> float:
        return float(self.inner.state.get(self.flats[0], {}).get("step", 0))

    def whole(self, param) -> Whole:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        master = safe_get_full_fp32_param(param)
        exp_avg, exp_avg_sq = (safe_get_full_optimizer_state(param, key) if self.inner.state else None for key in STATES)
        return master, exp_avg, exp_avg_sq

    def begin_restore(self, step: float) -> None:
        """AdamW's state for every flat partition, as its first step would create it, then linked to each parameter."""
        for group, flat in zip(self.inner.param_groups, self.flats):
            self.inner.state[flat] = {"step": _step_tensor(step, group, flat.device), **{key: torch.zeros_like(flat) for key in STATES}}
        if self.stage3:
            self.zero.checkpoint_event_prologue()  # every parameter partitioned: its partition is its only copy
        else:
            self.zero._lazy_init_hp_params_optimizer_state()

    def restore(self, param, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        from deepspeed import comm
        from deepspeed.utils import (
            safe_set_full_fp32_param, safe_set_full_optimizer_state, safe_set_local_fp32_param, safe_set_local_optimizer_state,
        )

        if not self.stage3:
            # Each rank writes its own fragment of the whole value; the model's copy is whole at stages 1 and 2.
            safe_set_full_fp32_param(param, master)
            for key, value in zip(STATES, (exp_avg, exp_avg_sq)):
                safe_set_full_optimizer_state(param, value, key)
            param.data.copy_(master.view_as(param.data))
            return
        # The last rank's partition is padded past the end; the local setters take the padded slice.
        size = param.ds_tensor.numel()
        start = size * comm.get_rank(group=param.ds_process_group)

        def local(value: torch.Tensor) -> torch.Tensor:
            piece = torch.zeros(size, dtype=value.dtype, device=value.device)
            flat = value.reshape(-1)[start : start + size]
            piece[: flat.numel()] = flat
            return piece

        safe_set_local_fp32_param(param, local(master))
        for key, value in zip(STATES, (exp_avg, exp_avg_sq)):
            safe_set_local_optimizer_state(param, local(value), key)
        param.ds_tensor.data.copy_(local(master).view_as(param.ds_tensor))

    def end_restore(self) -> None:
        if self.stage3:
            self.zero.checkpoint_event_epilogue()  # the parameters kept whole (persistent ones) are gathered again


class WholeMasters:
    """Stage 0: a torch optimizer on the whole parameters, or DeepSpeed's bf16/fp16 wrapper keeping a whole fp32 copy of each."""

    def __init__(self, optimizer):
        if hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups"):
            self.inner = optimizer.optimizer
            pairs = zip(chain(*optimizer.fp16_groups), chain(*optimizer.fp32_groups))
        elif isinstance(optimizer, torch.optim.Optimizer):
            self.inner = optimizer
            pairs = ((p, p) for group in optimizer.param_groups for p in group["params"])
        else:
            raise LitftError(
                f"litft cannot checkpoint DeepSpeed's {type(optimizer).__name__}; train with --deepspeed.stage 1, 2 or 3 "
                "(or leave the optimizer out of --deepspeed.config)"
            )
        self.masters: Dict[int, torch.Tensor] = {id(p): master for p, master in pairs}
        self._step = 0.0

    def step(self) -> float:
        found = next((state["step"] for state in self.inner.state.values() if "step" in state), 0)
        return float(found)

    def whole(self, param) -> Whole:
        master = self.masters[id(param)]
        state = self.inner.state.get(master, {})
        return master.detach().float(), state.get("exp_avg"), state.get("exp_avg_sq")

    def begin_restore(self, step: float) -> None:
        self._step = step

    def restore(self, param, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        own = self.masters[id(param)]
        group = next(g for g in self.inner.param_groups if any(p is own for p in g["params"]))
        own.data.copy_(master.view_as(own))
        if own is not param:
            param.data.copy_(master.view_as(param))
        self.inner.state[own] = {
            "step": _step_tensor(self._step, group, own.device),
            **{key: value.to(own.device, own.dtype).view_as(own).clone() for key, value in zip(STATES, (exp_avg, exp_avg_sq))},
        }

    def end_restore(self) -> None:
        pass


def masters_of(optimizer):
    """How to read and write each trained parameter's master and AdamW states in what ``deepspeed.initialize`` made."""
    if any(hasattr(optimizer, name) for name in ZeroMasters.FLATS):
        return ZeroMasters(optimizer)
    return WholeMasters(optimizer)


def param_groups(inner, names: List[str]) -> List[dict]:
    """The optimizer's hyperparameters (learning rate, betas, ...) with the trained parameters' names, as a plain run saves them."""
    if len(inner.param_groups) != 1:
        raise LitftError(f"litft checkpoints DeepSpeed runs with one parameter group; this optimizer has {len(inner.param_groups)}")
    return [{**{k: v for k, v in inner.param_groups[0].items() if k != "params"}, "params": list(names)}]


def trained_parameters(model: torch.nn.Module) -> List[Named]:
    """Every trained parameter once, in the model's order, with all its names (a tied weight has several)."""
    names: Dict[int, List[str]] = {}
    params: Dict[int, torch.nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            names.setdefault(id(param), []).append(name)
            params[id(param)] = param
    return [(names[key], params[key]) for key in names]


def _layout(named: List[Named], inner, model_tensor, states) -> dict:
    """``get_state_dict``'s layout: the model under every name of a parameter, its optimizer state under the first."""
    model = {}
    for names, param in named:
        tensor = model_tensor(names[0], param)
        model.update({name: tensor for name in names})
    first = [names[0] for names, _ in named]
    return {"model": model, "optimizer": {"state": states, "param_groups": param_groups(inner, first)}}


def unsharded_entries(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """What a plain run's model state holds besides parameters: persistent buffers, a 4-bit weight's quantization state.

    They are the same on every rank (DCP writes each once), and come back from the
    model when a run starts, so only other strategies' loads read them.
    """
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {name: value.detach() for name, value in model.state_dict().items() if name not in params and torch.is_tensor(value)}


def training_state(named: List[Named], optimizer, shards: RowShards, extras: Dict[str, torch.Tensor]) -> dict:
    """The state to save: every trained parameter's master and AdamW states, split by rows, one parameter whole at a time."""
    masters = masters_of(optimizer)
    step = masters.step()
    model, states = {}, {}
    for names, param in named:
        master, exp_avg, exp_avg_sq = masters.whole(param)
        model[names[0]] = shards.split(master.float())
        states[names[0]] = {"step": torch.tensor(step, dtype=torch.float32)}
        for key, value in zip(STATES, (exp_avg, exp_avg_sq)):
            states[names[0]][key] = shards.split(value.float() if value is not None else torch.zeros_like(master, dtype=torch.float32))
        del master, exp_avg, exp_avg_sq
    state = _layout(named, masters.inner, lambda name, _: model[name], states)
    state["model"].update(extras)
    return state


def empty_state(named: List[Named], optimizer, shards: RowShards, shapes: Dict[str, torch.Size]) -> dict:
    """What ``dcp.load`` fills: the names and shapes ``training_state`` writes, this rank's rows of each."""
    states = {names[0]: {"step": torch.tensor(0.0), **{key: shards.empty(shapes[names[0]]) for key in STATES}} for names, _ in named}
    return _layout(named, masters_of(optimizer).inner, lambda name, _: shards.empty(shapes[name]), states)


def restore_training_state(named: List[Named], optimizer, shards: RowShards, loaded: dict) -> None:
    """Put what ``dcp.load`` read into DeepSpeed: masters, AdamW states and step, the model's copy, the hyperparameters."""
    masters = masters_of(optimizer)
    states = loaded["optimizer"]["state"]
    masters.begin_restore(float(states[named[0][0][0]]["step"]))
    for names, param in named:
        state = states[names[0]]
        whole = [shards.whole(t) for t in (loaded["model"][names[0]], state["exp_avg"], state["exp_avg_sq"])]
        masters.restore(param, *whole)
        del whole
    masters.end_restore()
    saved = loaded["optimizer"]["param_groups"][0]
    masters.inner.param_groups[0].update({k: v for k, v in saved.items() if k != "params"})
