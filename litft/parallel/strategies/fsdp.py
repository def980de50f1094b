"""FSDP2 (``fully_shard``): one shard unit per transformer block, then the root, on a (replicate, shard) mesh.

Lightning's own FSDPStrategy wraps FSDP1, which needs a GPU; FSDP2 runs on the CPU
with gloo too, so every sharding strategy is tested in CI.
"""

import functools
import importlib
import inspect
from contextlib import contextmanager
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from lightning_fabric.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from litft.launch.cluster import process_group_timeout
from litft.config import Layout
from litft.device import compute_dtype, release_freed_host_memory
from litft.errors import LitftError
from litft.model.experts import experts_modules
from litft.parallel.expert import deal_out_experts, expert_data_mesh, expert_tensors
from litft.parallel.mesh import Mesh
from litft.parallel.strategies.base import Fill, TrainingStrategy
from litft.parallel.tensor import clip_by_global_norm, parallelize_block, split_parts, splits_local_data, sum_partial_gradients
from litft.model.weights import Materializer, transformer_blocks


CHECKSUM_CHUNK = 2**20  # elements summed at a time by the replica check


def _init_mp_dtypes_of_this_torch() -> Optional[Callable]:
    for module in ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "torch.distributed._composable.fsdp._fsdp_param_group"):
        try:
            return importlib.import_module(module).FSDPParamGroup._init_mp_dtypes
        except (ImportError, AttributeError):
            continue
    return None


@functools.lru_cache(maxsize=None)
def frozen_dtype_may_differ(init_mp_dtypes: Optional[Callable] = None) -> bool:
    """Whether this torch's FSDP2 lets a unit's frozen parameters have another dtype than its trained ones.

    Newer releases ask one dtype of the trained parameters only; older ones (2.7 among
    them) of every parameter of a unit, which a bf16 base under fp32 adapters breaks.
    Read once from the check itself (``FSDPParamGroup._init_mp_dtypes``).
    """
    check = init_mp_dtypes or _init_mp_dtypes_of_this_torch()
    try:
        return check is not None and "requires_grad" in inspect.getsource(check)
    except (OSError, TypeError):  # no source shipped: keep every parameter in one dtype
        return False


def shard_units(hf_model) -> List[torch.nn.Module]:
    """The modules sharded on their own, in order: every block, then untied embeddings and output head."""
    units = transformer_blocks(hf_model)
    embeddings, head = hf_model.get_input_embeddings(), hf_model.get_output_embeddings()
    if head is not None and head.weight is not embeddings.weight:
        # Untied vocabulary matrices are the largest pieces; as units of their own they are never full at the same time.
        units += [embeddings, head]
    return units


def param_groups_of(unit) -> List:
    """An FSDP2 unit's parameter groups, whose ``post_forward_mesh_info`` says whether they reshard after forward: a list in
    torch 2.6 on, one group (or None) in 2.5; empty where this torch keeps them another way."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return [group for group in groups if hasattr(group, "post_forward_mesh_info")]


def chunk_rows(rows: int, size: int, rank: int) -> Tuple[int, int]:
    """The rows of dim 0 that ``torch.chunk`` gives ``rank`` of ``size``: FSDP2's shard, and the expert group's deal."""
    step = -(-rows // size)
    first = min(rank * step, rows)
    return first, min(first + step, rows)


def kept_rows(unit: torch.nn.Module, shard_mesh, expert_mesh=None) -> dict:
    """For each parameter of ``unit`` still to be filled, the rows this rank keeps once the unit is sharded (its experts'
    share first, under expert parallel): the fill reads and converts only those."""
    kept = {}
    experts = {id(module) for module in experts_modules(unit)} if expert_mesh is not None else set()
    if experts:
        group, data = expert_mesh["expert"], expert_data_mesh(expert_mesh)
    for module in unit.modules():
        dealt = set(expert_tensors(module)) if id(module) in experts else set()
        for attr, param in module._parameters.items():
            if param is None or not param.is_meta or not param.dim():
                continue
            if attr in dealt:
                first, last = chunk_rows(param.shape[0], group.size(), group.get_local_rank())
                start, stop = chunk_rows(last - first, data.size(-1), data.get_local_rank(-1))
                kept[(id(module), attr)] = (first + start, first + stop)
            else:
                kept[(id(module), attr)] = chunk_rows(param.shape[0], shard_mesh.size(-1), shard_mesh.get_local_rank(-1))
    return kept


def kept_slices(block: torch.nn.Module, shard_mesh, tensor_mesh, config) -> dict:
    """Under tensor parallel, the part of each of ``block``'s parameters this rank keeps: its tensor group's slice (rows of a
    column split, columns of a row split, as the model's plan says), then FSDP2's chunk of dim 0 of that slice. A region is
    (first, last) rows, or (first, last, first column, last column)."""
    kept = kept_rows(block, shard_mesh)
    size, rank = tensor_mesh.size(), tensor_mesh.get_local_rank()
    shards, shard = shard_mesh.size(-1), shard_mesh.get_local_rank(-1)
    params = {(id(m), a): p for m in block.modules() for a, p in m._parameters.items() if p is not None and p.is_meta}
    for place, (kind, dim) in split_parts(block, config).items():
        param = params.get(place)
        if param is None:
            continue
        first, last = chunk_rows(param.shape[dim], size, rank)
        if kind == "column":
            start, stop = chunk_rows(last - first, shards, shard)
            kept[place] = (first + start, first + stop)
        else:
            kept[place] = (*chunk_rows(param.shape[0], shards, shard), first, last)
    return kept


class ReplicaSync:
    """Fabric's no_backward_sync for FSDP2: gradients are reduce-scattered after every micro-batch.

    Lightning turns all gradient sync off during accumulation, and FSDP2 then keeps
    every parameter's whole gradient (in the reduce dtype) on every rank until the
    last micro-batch: 4 bytes per parameter that sharding was meant to save. Here
    each micro-batch's gradients are reduce-scattered into the shards; under
    HYBRID_SHARD only the all-reduce across replicas waits for the last micro-batch.
    """

    def no_backward_sync(self, module, enabled: bool):
        return _replica_all_reduce(module, not enabled)


@contextmanager
def _replica_all_reduce(module, on: bool):
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_requires_all_reduce(on, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_all_reduce(True, recurse=False)


class FSDP2FabricStrategy(ModelParallelStrategy):
    """Fabric's model-parallel strategy with litft's (replicate, shard) mesh and per-unit fill-then-shard."""

    def __init__(self, layout: Layout, mesh: Mesh, precision: str, backend: str, offload_pinned: bool):
        super().__init__(parallelize_fn=self._shard, process_group_backend=backend, timeout=process_group_timeout())
        self.mesh = mesh
        self._backward_sync_control = ReplicaSync()
        self.offload_pinned = offload_pinned
        self.layout = layout
        self.mixed = precision.endswith("-mixed")
        self.compute_dtype = compute_dtype(precision)
        self.fill: Fill = lambda part: None

    @property
    def expert_mesh(self):
        """The experts' own mesh under --expert_parallel (litft.parallel.expert), else None."""
        return self.mesh.expert_mesh

    def setup_environment(self) -> None:
        # Skips ModelParallelStrategy's (data, tensor) mesh; ours is (replicate, shard), built with every other group of the run.
        super(ModelParallelStrategy, self).setup_environment()
        self._setup_distributed()
        mesh = self.mesh
        if self.global_rank == 0 and self.layout.fsdp.sharding_strategy == "HYBRID_SHARD" and mesh.replicas == 1 and mesh.shard > 1:
            print(f"HYBRID_SHARD with one shard group of {mesh.shard} ranks: sharding as FULL_SHARD", flush=True)
        self._device_mesh = mesh.build(self.root_device.type, process_group_timeout()).dense_mesh

    def _shard(self, module, mesh):
        # FSDP2 shards over a 1-D mesh and does HSDP (replicate x shard) over a 2-D one.
        tensor = self.layout.tensor_parallel > 1
        data = mesh["replicate", "shard"] if tensor else mesh
        options = {
            "mesh": data["shard"] if data.shape[0] == 1 else data,
            "reshard_after_forward": self.layout.fsdp.sharding_strategy != "SHARD_GRAD_OP",
        }
        if self.mixed:
            # Low-precision compute, full-precision gradient reduction and sharded master weights.
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        if self.layout.fsdp.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=self.offload_pinned)
        # 4-bit base weights (QLoRA) are frozen and packed with their quantization state;
        # they stay whole on every rank, everything else (adapters, norms, embeddings) is sharded.
        options["ignored_params"] = {p for p in module.parameters() if type(p).__name__ == "Params4bit"} or None
        blocks = set(map(id, transformer_blocks(module.hf_model)))
        # Each rank keeps its group's share of the experts, sharded by FSDP over the ranks that hold the same ones.
        expert_options = {**options, "mesh": expert_data_mesh(self.expert_mesh)} if self.expert_mesh is not None else None
        # Each rank reads and converts only what it keeps: FSDP's rows, and under tensor parallel its group's slice of each
        # split tensor, which the parallel styles then take from the rank's own copy (where parallelize_module takes
        # src_data_rank; before, it scatters rank 0's whole tensor, so every rank fills whole blocks).
        by_rows = isinstance(self.fill, Materializer) and (not tensor or splits_local_data())
        config = module.hf_model.config
        for unit in shard_units(module.hf_model):
            split = tensor and id(unit) in blocks
            if by_rows:
                self.fill(unit, kept_slices(unit, options["mesh"], mesh["tensor"], config) if split
                          else kept_rows(unit, options["mesh"], self.expert_mesh))
            else:
                self.fill(unit)  # one full unit at a time, sharded right away
            if split:
                parallelize_block(unit, mesh["tensor"], config, local=by_rows)
            for experts in experts_modules(unit) if expert_options is not None else ():
                deal_out_experts(experts, self.expert_mesh["expert"])
                fully_shard(experts, **expert_options)
            fully_shard(unit, **options)
            release_freed_host_memory()  # the unit's whole tensors and conversions, freed between shards that stay: see litft.device
        self.fill(module)
        fully_shard(module.hf_model, **options)
        return module


class FSDP(TrainingStrategy):
    """Parameters, gradients and optimizer states sharded inside a shard group; replicated across groups (HSDP)."""

    name = "FSDP"
    options = "fsdp"
    splits_blocks = True
    gathers_weights = True
    gathers_fp8 = True

    @classmethod
    def check(cls, layout: Layout, accelerator: str, precision: str) -> None:
        fsdp = layout.fsdp
        if precision == "16-mixed":
            raise LitftError("--strategy fsdp trains in 32-true, bf16-mixed or bf16-true; fp16 needs loss scaling that FSDP2 lacks")
        if fsdp.shard_size is not None and fsdp.sharding_strategy != "HYBRID_SHARD":
            raise LitftError(f"--fsdp.shard_size only applies to HYBRID_SHARD (this run uses {fsdp.sharding_strategy})")
        if fsdp.sharding_strategy == "HYBRID_SHARD":
            tp = layout.tensor_parallel
            shard, world = fsdp.shard_size or layout.devices // tp, layout.world_size // tp
            if shard < 1 or world % shard:
                ranks = f"{layout.devices} devices x {layout.num_nodes} nodes" + (f" / --tensor_parallel {tp}" if tp > 1 else "")
                raise LitftError(
                    f"HYBRID_SHARD needs the {'world size' if tp == 1 else 'data-parallel world'} ({ranks} = {world}) "
                    f"to be a multiple of the shard group size ({shard}); change --fsdp.shard_size or the process count"
                )
        if layout.expert_parallel > 1 and fsdp.cpu_offload:
            raise LitftError("--fsdp.cpu_offload with --expert_parallel is not supported yet (untested); drop one of them")
        if layout.tensor_parallel > 1 and fsdp.cpu_offload:
            raise LitftError("--fsdp.cpu_offload with --tensor_parallel is not supported yet (untested); drop one of them")
        if fsdp.cpu_offload and accelerator != "cuda":
            raise LitftError("--fsdp.cpu_offload moves GPU memory to the CPU; on --accelerator cpu there is nothing to offload, drop it")

    @classmethod
    def data_groups(cls, layout: Layout) -> Tuple[int, int]:
        """(replicas, shard group size) of FSDP's mesh, over the ranks a tensor-parallel group counts as one."""
        kind, world = layout.fsdp.sharding_strategy, layout.world_size // layout.tensor_parallel
        if kind in ("FULL_SHARD", "SHARD_GRAD_OP"):
            return 1, world
        if kind == "NO_SHARD":
            return world, 1
        shard = layout.fsdp.shard_size or layout.devices // layout.tensor_parallel
        return max(world // shard, 1), shard

    @classmethod
    def frozen_base_dtype(cls, precision: str) -> Optional[torch.dtype]:
        """The compute dtype under autocast where this torch's FSDP2 takes a unit of two dtypes; else the trained weights'."""
        return super().frozen_base_dtype(precision) if frozen_dtype_may_differ() else None

    @classmethod
    def facts(cls, layout: Layout, precision: str) -> dict:
        return {"strategy": f"FSDP {layout.fsdp.sharding_strategy}", "shard_group": cls.data_groups(layout)[1], "zero_stage": None}

    def fabric_strategy(self):
        self._fabric_strategy = FSDP2FabricStrategy(self.layout, self.mesh, self.precision, self.backend, offload_pinned=self.accelerator == "cuda")
        return self._fabric_strategy

    def setup(self, fabric, lm, fill: Fill, on_device: bool):
        """FSDP replaces parameters with shards while it fills them, so the optimizer is made afterwards."""
        self.fabric = fabric
        self._fabric_strategy.fill = fill
        module = fabric.setup_module(lm, move_to_device=not on_device)
        made = lm.configure_optimizers()
        return module, fabric.setup_optimizers(made["optimizer"]), made["lr_scheduler"]

    def optimizer_step(self, module, optimizer, max_norm: Optional[float]):
        if self.layout.tensor_parallel > 1:
            sum_partial_gradients(module, self.mesh.tensor_group)
        return super().optimizer_step(module, optimizer, max_norm)

    @classmethod
    def gathers_weights_for(cls, layout: Layout) -> bool:
        return cls.data_groups(layout)[1] > 1

    @contextmanager
    def generation_weights(self, module):
        """Every unit gathered once for the whole generate call and resharded after, where FSDP2 gathered each one again at
        every decode step: for the shipped 7B GRPO config on 8 ranks, about 15 GB gathered per generated token. They are
        gathered up front, in one order on every rank, so nothing generate does inside gathers: transformers runs a
        vision-language model's image encoder before the model's forward (outside the root unit's gather), and a rank
        whose prompts have no image runs none."""
        units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        # FSDP2 takes the first unit to run forward as its root: where generation comes before any training forward (GRPO's
        # first rollouts) and transformers runs the image encoder ahead of the model's forward (Llama 4), an encoder block
        # would claim it. The outermost unit is made the root first.
        lazy_init = getattr(units[0]._get_fsdp_state(), "_lazy_init", None) if units else None
        if lazy_init is not None:
            lazy_init()
        groups = [group for unit in units for group in param_groups_of(unit)]
        if not groups:  # a torch whose FSDP2 keeps its groups elsewhere: the units gather per decode step, as they train
            yield
            return
        kept = [group.post_forward_mesh_info for group in groups]
        for group in groups:
            group.post_forward_mesh_info = None  # what reshard_after_forward=False sets: the unit stays whole after its forward
        try:
            for unit in units:
                unit.unshard()
            yield
        finally:
            for group, info in zip(groups, kept):
                group.post_forward_mesh_info = info
            for unit in units:
                unit.reshard()

    def clip_gradients(self, module, optimizer, max_norm: float):
        if self.layout.tensor_parallel == 1 and self.layout.expert_parallel == 1:
            return super().clip_gradients(module, optimizer, max_norm)
        return clip_by_global_norm([p for p in module.parameters() if p.requires_grad], max_norm)  # DTensors on two meshes

    def replicas_in_step(self, lm) -> Optional[float]:
        """The largest difference of shard checksums between replica groups (0.0 when the replicas are equal).

        Each shard is summed in chunks (sum and 2-norm, accumulated in fp64 one chunk at a
        time), so the check holds no copy of the shard; parameters FSDP does not shard
        (4-bit bases) are whole and equal on every rank by construction and are skipped.
        """
        if self.mesh.replicas == 1:
            return None
        sums = []
        for p in lm.parameters():
            if isinstance(p, DTensor):
                for chunk in p.to_local().detach().reshape(-1).split(CHECKSUM_CHUNK):
                    sums += [chunk.sum(dtype=torch.float64), torch.linalg.vector_norm(chunk, dtype=torch.float64)]
        local = torch.stack(sums) if sums else torch.zeros(1, dtype=torch.float64, device=self.fabric.device)
        group = self.mesh.replicate_group
        high, low = local.clone(), local.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        spread = (high - low).abs().max()
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        return float(spread)

    @classmethod
    def compute_view(cls, layout: Layout, precision: str) -> Tuple[Callable, Optional[torch.dtype]]:
        if precision.endswith("-mixed"):
            low = compute_dtype(precision)
            return (lambda p: low), None  # MixedPrecisionPolicy gathers parameters in the compute dtype
        return super().compute_view(layout, precision)
