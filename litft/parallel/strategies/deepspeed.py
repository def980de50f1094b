"""DeepSpeed ZeRO stages 0-3 through Lightning's DeepSpeed strategy, on GPUs and on CPU processes.

DeepSpeed is an optional dependency: it is imported only once this strategy sets
up a run, so litft works without it installed. Its checkpoints are litft's DCP
layout, the same as every other strategy's (``deepspeed_state``).
"""

import argparse
import importlib.util
import os
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from lightning_fabric.strategies import DDPStrategy, DeepSpeedStrategy
from lightning_fabric.utilities.seed import reset_seed

from litft.launch.cluster import process_group_timeout
from litft.config import Layout, TrainArgs
from litft.device import compute_dtype, param_dtype
from litft.errors import LitftError
from litft.parallel.mesh import Mesh, layout_data_world
from litft.parallel.strategies.base import Fill, TrainingStrategy, local_bytes, optimizer_state_bytes, read_dcp
from litft.parallel.strategies.deepspeed_config import deepspeed_config
from litft.parallel.strategies.deepspeed_state import RowShards, empty_state, restore_training_state, trained_parameters, training_state, unsharded_entries
from litft.model.recurrent import text_config
from litft.model.vision import ready_for_zero3
from litft.model.weights import CheckpointWeights, Materializer

INSTALL = "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed"


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
        gather_by_broadcasts_on_gloo()
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


class _Broadcasts:
    """The handle of one gather made of broadcasts: waits for all of them."""

    def __init__(self, works: list):
        self.works = works

    def wait(self, *args, **kwargs) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def gather_by_broadcasts(output_tensor, input_tensor, group=None, async_op=False):
    """``all_gather_into_tensor`` as one broadcast per rank, each into its part of the output, for gloo: gloo's own gather
    fills a second output-sized buffer and copies it over, so a ZeRO-3 rank held every gathered parameter twice at once
    (a vocabulary-sized embedding put a rank above the whole model's bytes). The same values in the same places."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    parts = output_tensor.view(world, -1)
    mine = parts[dist.get_rank(group)]
    if mine.data_ptr() != input_tensor.data_ptr():  # ZeRO's coalesced gathers hand in their own part of the output
        mine.copy_(input_tensor.reshape(-1))
    works = [dist.broadcast(parts[r], src=dist.get_global_rank(group, r) if group is not None else r, group=group, async_op=True)
             for r in range(world)]
    handle = _Broadcasts(works)
    if async_op:
        return handle
    handle.wait()
    return None


def gather_by_broadcasts_on_gloo() -> None:
    """Route DeepSpeed's parameter gathers through ``gather_by_broadcasts`` where the process group is gloo (CPU ranks);
    NCCL gathers in place already. A DeepSpeed without the hook keeps gloo's gather."""
    import torch.distributed as dist
    from deepspeed.comm import comm as ds_comm

    backend = getattr(ds_comm, "cdb", None)
    if dist.get_backend() == "gloo" and getattr(backend, "all_gather_function", None) is not None:
        backend.all_gather_function = gather_by_broadcasts


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

    def whole_weights(self, lm):
        """ZeRO-3: each partitioned tensor gathered on every rank, one at a time, and partitioned again after its use."""
        if self.stage != 3:
            yield from super().whole_weights(lm)
            return
        import deepspeed

        for name, param in lm.hf_model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                yield name, param.data

    @classmethod
    def gathers_weights_for(cls, layout: Layout) -> bool:
        return int(cls.zero_section(layout, "32-true").get("stage", 0)) == 3 and layout.world_size > 1

    @contextmanager
    def generation_weights(self, module):
        """ZeRO-3: every partitioned weight gathered once for the whole generate call, with the engine's per-module fetch and
        release hooks lifted meanwhile (they would partition each module's weights again after its forward, and gather them
        again at the next decode step), where the whole model fits beside what the device holds; else as it trains."""
        engine = self.fabric.strategy.model
        offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
        # The hooks' registration: _register_deepspeed_module since DeepSpeed 0.16.4, _register_hooks_recursively before.
        register = getattr(offload, "_register_deepspeed_module", None) or getattr(offload, "_register_hooks_recursively", None)
        if self.stage != 3 or register is None or not whole_model_fits(engine.module, self.fabric.device):
            yield
            return
        import deepspeed

        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            for hook in offload.forward_hooks + offload.backward_hooks:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            for param in params:
                param.ds_active_sub_modules.clear()
            try:
                yield
            finally:
                register(offload.module, count=[0])  # the same module ids as the first registration

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
        sized = deepspeed_config(self.layout.deepspeed, self.train, self.layout, self.precision, text_config(lm.hf_model.config).hidden_size)
        fabric.strategy.config["zero_optimization"].update(sized["zero_optimization"])
        fill(lm)
        if self.stage == 3 and lm.sees_images:
            ready_for_zero3(lm.hf_model)  # the encoder's and projector's gathers alike on every rank, whatever its images
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

    def checkpoint_state(self, lm, optimizer) -> dict:
        """Each trained tensor split by rows over the ranks, under the names a plain AdamW run's state has."""
        ds_optimizer = self.fabric.strategy.model.optimizer
        return training_state(trained_parameters(lm.model), ds_optimizer, self._row_shards(), unsharded_entries(lm.model))

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


def whole_model_fits(model: torch.nn.Module, device: torch.device, share: float = 0.8) -> bool:
    """Whether every parameter gathered whole fits in ``share`` of the device's free memory (always on the CPU, whose
    memory the estimate and the host's limits govern)."""
    if device.type != "cuda":
        return True
    whole = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters())
    free, _ = torch.cuda.mem_get_info(device)
    return whole <= share * free
