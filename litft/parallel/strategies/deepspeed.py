"""DeepSpeed ZeRO stages 0-3 through Lightning's DeepSpeed strategy, on GPUs and on CPU processes.

DeepSpeed is an optional dependency: it is imported only once this strategy sets
up a run, so litft works without it installed. Its checkpoints are litft's DCP
layout, the same as every other strategy's (``deepspeed_state``).
"""

import argparse
import importlib.util
import json
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from lightning_fabric.strategies import DDPStrategy, DeepSpeedStrategy
from lightning_fabric.utilities.seed import reset_seed

from litft.cluster import process_group_timeout
from litft.config import DeepSpeedArgs, Layout, TrainArgs
from litft.device import compute_dtype, param_dtype
from litft.errors import LitftError
from litft.memory import Param, Row, States
from litft.parallel.mesh import Mesh, layout_data_world
from litft.parallel.strategies.base import Fill, TrainingStrategy, local_bytes, optimizer_state_bytes, read_dcp
from litft.parallel.strategies.ddp import whole_model_states
from litft.parallel.strategies.deepspeed_state import RowShards, empty_state, restore_training_state, trained_parameters, training_state, unsharded_entries
from litft.weights import CheckpointWeights, Materializer

INSTALL = "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed"
# DeepSpeed's own defaults (deepspeed.runtime.zero.config), used when the config leaves them out.
DS_DEFAULTS = {"reduce_bucket_size": 5e8, "prefetch_bucket_size": 5e7, "param_persistence_threshold": 1e5, "max_live_parameters": 1e9}


def zero_buckets(stage: int, hidden_size: int) -> dict:
    """Communication that overlaps the backward, in buckets sized to the model's width.

    DeepSpeed turns overlap_comm on by itself only for stage 3, and its 5e8-element
    default buckets are 1 GB in bf16 whatever the model. These are the sizes HF's
    "auto" values give (h^2 for reductions, 0.9 h^2 for stage 3's prefetch, 10 h for
    the parameters stage 3 keeps whole).
    """
    if stage == 0:
        return {}
    square = hidden_size * hidden_size
    buckets = {"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": square}
    if stage == 3:
        buckets.update(stage3_prefetch_bucket_size=int(0.9 * square), stage3_param_persistence_threshold=10 * hidden_size)
    else:
        buckets["allgather_bucket_size"] = square
    return buckets


def deepspeed_config(args: DeepSpeedArgs, train: TrainArgs, layout: Layout, precision: str, hidden_size: Optional[int] = None) -> dict:
    """DeepSpeed's config from litft's flags, or the user's file with its "auto" values filled in.

    The loop owns accumulation: it marks the last micro-batch as the boundary (see
    ``AccumulationBoundary``), then steps once, as under every other strategy. With
    the model's ``hidden_size``, communication overlaps the backward in sized buckets
    wherever the config leaves them out or says "auto" (``zero_buckets``).
    """
    accumulation = train.global_batch_size // (train.micro_batch_size * layout_data_world(layout))
    ours = {
        # DeepSpeed counts a batch per rank; the ranks of a context-parallel group share theirs.
        "train_batch_size": train.micro_batch_size * accumulation * layout.world_size,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": train.max_norm or 0.0,
    }
    if args.config is not None:
        try:
            config = json.loads(Path(args.config).read_text())
        except json.JSONDecodeError as err:
            raise LitftError(f"--deepspeed.config {args.config} is not valid JSON (line {err.lineno}: {err.msg})") from None
        for key, value in ours.items():
            given = config.get(key, "auto")
            if given != "auto" and given != value:
                why = ""
                if key == "train_batch_size" and layout.context_parallel > 1:
                    why = " (DeepSpeed counts each sample once per rank of a --context_parallel group)"
                raise LitftError(
                    f"--deepspeed.config sets {key} to {given} but litft's flags give {value}{why}; set it to \"auto\" or change the flags"
                )
            config[key] = value
    else:
        zero = {"stage": args.stage}
        for key, where in (("offload_optimizer", args.offload_optimizer), ("offload_param", args.offload_parameters)):
            if where is not None:
                zero[key] = {"device": where, **({"nvme_path": str(args.nvme_path)} if where == "nvme" else {})}
        config = {**ours, "zero_optimization": zero}
    for section, enabled in (("bf16", precision.startswith("bf16")), ("fp16", precision.startswith("16"))):
        given = config.get(section, {}).get("enabled", "auto")
        if given not in ("auto", enabled):
            raise LitftError(
                f"--deepspeed.config sets {section}.enabled to {str(given).lower()} but --precision is {precision}; "
                f'set it to "auto" or change --precision'
            )
        config[section] = {**config.get(section, {}), "enabled": enabled}
    config.setdefault("zero_optimization", {"stage": 0})
    zero = config["zero_optimization"]
    if hidden_size is not None:
        for key, value in zero_buckets(int(zero.get("stage", 0)), hidden_size).items():
            if zero.get(key, "auto") == "auto":
                zero[key] = value
    if zero.get("stage", 0) == 0:
        config["gradient_clipping"] = 0.0  # litft clips stage 0 itself (see DeepSpeed.optimizer_step)
    # litft's AdamW keeps the math identical across strategies; DeepSpeed warns about client optimizers otherwise.
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("zero_force_ds_cpu_optimizer", False)
    config.setdefault("steps_per_print", 10**9)
    config.setdefault("wall_clock_breakdown", False)
    return config


class AccumulationBoundary:
    """Fabric's no_backward_sync for DeepSpeed: only the last micro-batch's backward reduces gradients.

    DeepSpeed's engine otherwise counts micro-batches itself and expects ``step()``
    after each; telling it where the boundary is lets the loop step once per global batch.
    """

    def no_backward_sync(self, module, enabled: bool):
        module.set_gradient_accumulation_boundary(not enabled)
        return nullcontext()


class DeepSpeedAnyDevice(DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy, also on CPU processes (DeepSpeed's CPU accelerator, gloo).

    Lightning refuses the CPU and checks CUDA device indices; DeepSpeed itself trains
    every ZeRO stage on the CPU, which is how CI tests it.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._backward_sync_control = AccumulationBoundary()

    def setup_environment(self) -> None:
        if self.root_device.type == "cuda":
            return super().setup_environment()
        DDPStrategy.setup_environment(self)

    def _setup_distributed(self) -> None:
        if self.root_device.type == "cuda":
            return super()._setup_distributed()
        reset_seed()
        self._set_world_ranks()
        self._init_deepspeed_distributed()
        if not self._config_initialized:
            self._format_config()
            self._config_initialized = True

    def _initialize_engine(self, model, optimizer=None, scheduler=None):
        import deepspeed

        # DeepSpeed wants a device index; a CPU device has none, the local rank stands in.
        index = self.root_device.index if self.root_device.type == "cuda" else self.local_rank
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            args=argparse.Namespace(device_rank=index), config=self.config, model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad], optimizer=optimizer,
            lr_scheduler=scheduler, dist_init_required=False,
        )
        return engine, ds_optimizer, ds_scheduler

    def backward(self, tensor, module, *args, **kwargs):
        # The loop already divides by the global batch's token count.
        return super().backward(tensor, module, *args, scale_wrt_gas=False, **kwargs)


class DeepSpeed(TrainingStrategy):
    """ZeRO: optimizer states (stage 1), gradients (2) and parameters (3) partitioned over every rank."""

    name = "DeepSpeed"
    options = "deepspeed"
    compiles = False  # ZeRO's parameter hooks inside compiled blocks are not tested here

    def __init__(self, layout: Layout, accelerator: str, precision: str, train: TrainArgs, mesh: Optional[Mesh] = None):
        super().__init__(layout, accelerator, precision, train, mesh)
        self.backend = "nccl" if accelerator == "cuda" else "gloo"  # DeepSpeed's communication layer takes one backend
        self.config = deepspeed_config(layout.deepspeed, train, layout, precision)
        self.stage = int(self.config["zero_optimization"].get("stage", 0))
        self._dtype = param_dtype(precision)  # what the other strategies fill the weights in
        self._shards: Optional[RowShards] = None

    @property
    def gathers_weights(self) -> bool:
        return self.stage == 3

    @classmethod
    def check(cls, layout: Layout, accelerator: str, precision: str) -> None:
        ds = layout.deepspeed
        if importlib.util.find_spec("deepspeed") is None:
            raise LitftError(f"--strategy deepspeed needs DeepSpeed: {INSTALL}")
        if ds.offload_parameters is not None and ds.stage != 3:
            raise LitftError(f"--deepspeed.offload_parameters needs --deepspeed.stage 3 (got stage {ds.stage}); parameters are only partitioned in stage 3")
        if ds.offload_optimizer is not None and ds.stage == 0:
            raise LitftError("--deepspeed.offload_optimizer needs --deepspeed.stage 1, 2 or 3; stage 0 keeps no partitioned optimizer to offload")
        if ds.config is not None and (ds.stage, ds.offload_optimizer, ds.offload_parameters) != (2, None, None):
            raise LitftError("--deepspeed.config already says the stage and offload; drop --deepspeed.stage/offload_* or the config file")
        if ds.config is not None and not Path(ds.config).is_file():
            raise LitftError(f"--deepspeed.config {ds.config} does not exist; pass a DeepSpeed JSON file (examples in config_hub/deepspeed/)")

    @classmethod
    def data_groups(cls, layout: Layout) -> Tuple[int, int]:
        """ZeRO partitions over every rank (stage 0 replicates, as DDP)."""
        return (layout.world_size, 1) if layout.deepspeed.config is None and layout.deepspeed.stage == 0 else (1, layout.world_size)

    @classmethod
    def facts(cls, layout: Layout, precision: str) -> dict:
        stage = int(cls.zero_section(layout, precision).get("stage", 0))
        return {"strategy": f"DeepSpeed ZeRO-{stage}", "shard_group": None, "zero_stage": stage}

    @staticmethod
    def zero_section(layout: Layout, precision: str, train: Optional[TrainArgs] = None, hidden_size: Optional[int] = None) -> dict:
        one_step = train or TrainArgs(global_batch_size=layout_data_world(layout), micro_batch_size=1)
        return deepspeed_config(layout.deepspeed, one_step, layout, precision, hidden_size)["zero_optimization"]

    def fabric_strategy(self):
        if self.accelerator == "cpu":
            # Read when deepspeed is first imported; without it DeepSpeed looks for CUDA.
            os.environ["DS_ACCELERATOR"] = "cpu"
        return DeepSpeedAnyDevice(config=self.config, process_group_backend=self.backend, timeout=process_group_timeout())

    def structure(self, config, dtype: torch.dtype) -> torch.nn.Module:
        """ZeRO-3 partitions every module's parameters as soon as the module is built: no rank ever holds the whole model.

        Every rank builds the same modules in the same order (each partition is a
        broadcast). The dtype follows the config's bf16/fp16 sections, as DeepSpeed
        casts the module at ``deepspeed.initialize`` anyway. transformers' init is
        skipped (the filler gives every value), so tied weights are tied here.
        """
        if self.stage != 3:
            return super().structure(config, dtype)
        from litft.parallel.strategies.zero3_build import build_partitioned

        self._dtype = dtype
        return build_partitioned(config, dtype, self.config)

    @classmethod
    def frozen_base_dtype(cls, precision: str) -> Optional[torch.dtype]:
        """None: the whole module, base and adapters, is already in the compute dtype (``model_dtype``)."""
        return None

    @classmethod
    def frozen_dtype(cls, precision: str) -> torch.dtype:
        return compute_dtype(precision)  # the whole module is in the compute dtype (model_dtype)

    @classmethod
    def saved_dtype(cls, precision: str) -> torch.dtype:
        return torch.float32  # ZeRO's fp32 masters, whatever the module's dtype

    @property
    def model_dtype(self) -> torch.dtype:
        """bf16/fp16 under both bf16 (or fp16) precisions: ZeRO runs a low-precision module and keeps fp32 masters itself.

        Its engine casts the module at ``deepspeed.initialize``, but no cast reaches ZeRO-3
        partitions made before it, so the model is built in that dtype from the start.
        """
        return compute_dtype(self.precision)

    @property
    def fills_4bit(self) -> bool:
        return self.stage == 3  # so the 4-bit base is partitioned as it is made, never whole on a rank

    def filler(self, lm, weights: Optional[CheckpointWeights], seed: int) -> Fill:
        if self.stage != 3:
            return super().filler(lm, weights, seed)
        from litft.parallel.strategies.zero3_build import PartitionedFill, QuantizedPartitionedFill

        materializer = Materializer(lm.model, lm.hf_model, weights, seed)
        if getattr(lm.hf_model, "is_loaded_in_4bit", False):
            return QuantizedPartitionedFill(materializer, lm.hf_model, self.config)
        return PartitionedFill(materializer, self._dtype)

    def setup(self, fabric, lm, fill: Fill, on_device: bool):
        """DeepSpeed takes model and optimizer together; its buckets are sized to the model now that it is known."""
        self.fabric = fabric
        sized = deepspeed_config(self.layout.deepspeed, self.train, self.layout, self.precision, lm.hf_model.config.hidden_size)
        fabric.strategy.config["zero_optimization"].update(sized["zero_optimization"])
        fill(lm)
        made = lm.configure_optimizers()
        module, optimizer = fabric.setup(lm, made["optimizer"])
        return module, optimizer, made["lr_scheduler"]

    def optimizer_step(self, module, optimizer, max_norm: Optional[float]):
        if self.stage > 0:
            optimizer.step()  # ZeRO clips inside its step, from gradient_clipping in its config
            engine = self.fabric.strategy.model
            # The engine copies its ZeRO optimizer's norm only in its own step(), which Fabric's optimizer step bypasses.
            norm = engine.get_global_grad_norm()
            norm = getattr(engine.optimizer, "_global_grad_norm", None) if norm is None else norm
        else:
            # Stage 0 holds whole, already averaged gradients; its own clipping did not take
            # effect in our runs (losses equalled unclipped ones), so clip them here.
            norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm) if max_norm else None
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    def state_bytes(self, lm, optimizer) -> Dict[str, int]:
        params = list(lm.parameters())
        counts = {"params": sum(local_bytes(p) for p in params)}
        zero = self.fabric.strategy.model.optimizer
        masters = getattr(zero, "fp32_partitioned_groups_flat", None) or getattr(zero, "single_partition_of_fp32_groups", None)
        if masters is None:  # stage 0: a plain optimizer on whole gradients
            counts["grads"] = sum(local_bytes(p.grad) for p in params)
            counts["optimizer"] = optimizer_state_bytes(zero)
            return counts
        # ZeRO keeps an fp32 master copy of its partition, and gradients only for that partition.
        grads = getattr(zero, "grad_partitions_flat_buffer", None)  # stage 3
        if grads is None:
            grads = [g for group in getattr(zero, "averaged_gradients", {}).values() for g in (group or [])]  # stages 1 and 2
        counts["grads"] = local_bytes(grads) if torch.is_tensor(grads) else sum(local_bytes(g) for g in grads)
        counts["optimizer"] = optimizer_state_bytes(zero.optimizer) + sum(local_bytes(m) for m in masters)
        return counts

    def numel(self, param) -> int:
        return getattr(param, "ds_numel", None) or param.numel()

    def trained_shapes(self, lm) -> Dict[str, List[int]]:
        return {name: list(getattr(p, "ds_shape", None) or p.shape) for name, p in lm.model.named_parameters() if p.requires_grad}

    # ------------------------------------------------------------ checkpoints: litft's layout (deepspeed_state)

    def checkpoint_fields(self) -> dict:
        return {**super().checkpoint_fields(), "zero_stage": self.stage}

    def _row_shards(self) -> RowShards:
        if self._shards is None:
            self._shards = RowShards(torch.device("cpu") if self.backend == "gloo" else self.fabric.device, self.mesh.rows_mesh())
        return self._shards

    def save(self, folder: Path, lm, optimizer) -> None:
        """Each trained tensor split by rows over the ranks, under the names a plain AdamW run's state has."""
        ds_optimizer = self.fabric.strategy.model.optimizer
        state = training_state(trained_parameters(lm.model), ds_optimizer, self._row_shards(), unsharded_entries(lm.model))
        dcp.save(state, checkpoint_id=str(folder / "model"))

    def load(self, folder: Path, lm, optimizer) -> None:
        """Whatever strategy, stage and world size wrote it: read this rank's rows, then each parameter whole, one at a time."""
        named, shards = trained_parameters(lm.model), self._row_shards()
        ds_optimizer = self.fabric.strategy.model.optimizer
        shapes = {name: torch.Size(shape) for name, shape in self.trained_shapes(lm).items()}
        state = empty_state(named, ds_optimizer, shards, shapes)
        read_dcp(folder, state)
        restore_training_state(named, ds_optimizer, shards, state)
        self.fabric.strategy.model.global_steps = int(state["optimizer"]["state"][named[0][0][0]]["step"])

    # ------------------------------------------------------------ for litft estimate

    @classmethod
    def compute_view(cls, layout: Layout, precision: str) -> Tuple[Callable, Optional[torch.dtype]]:
        if precision.startswith(("bf16", "16")):
            low = compute_dtype(precision)
            return (lambda p: low), None  # DeepSpeed casts the module; Fabric adds no autocast
        return super().compute_view(layout, precision)

    @classmethod
    def memory_layout(cls, tensors: List[Param], layout: Layout, precision: str, train: TrainArgs, hidden_size: Optional[int] = None) -> States:
        return zero_states(tensors, cls.zero_section(layout, precision, train, hidden_size), layout.world_size, precision)


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
