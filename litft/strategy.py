"""The one place where flags become a Fabric: accelerator, strategy, precision, loggers.

Model and loop code never look at ranks or meshes; they get a Fabric from here,
and ask this module to wrap the model, step the optimizer and gather weights,
which is where DDP, FSDP2 and DeepSpeed differ.
"""

import json
import os
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Literal, Optional, Tuple

import torch
from lightning.fabric.strategies import ModelParallelStrategy

from litft.args import DeepSpeedArgs, FSDPArgs, TrainArgs
from litft.errors import LitftError

Strategy = Literal["auto", "ddp", "fsdp", "deepspeed"]
Precision = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed"]
Accelerator = Literal["auto", "cpu", "cuda", "gpu"]
STRATEGIES = ("auto", "ddp", "fsdp", "deepspeed")


def resolve_accelerator(accelerator: str) -> str:
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator in ("cuda", "gpu") and not torch.cuda.is_available():
        raise LitftError(f"--accelerator {accelerator} was asked for but no CUDA device is visible; use --accelerator cpu")
    return "cuda" if accelerator == "gpu" else accelerator


def resolve_precision(precision: Optional[str], accelerator: str) -> str:
    """bf16-mixed where the GPU supports it, full fp32 elsewhere, unless the user chose."""
    if precision is None:
        if accelerator == "cuda" and torch.cuda.is_bf16_supported():
            return "bf16-mixed"
        return "32-true"
    if precision == "16-mixed" and accelerator == "cpu":
        raise LitftError("--precision 16-mixed needs a GPU (fp16 autocast is not supported on the CPU); use bf16-mixed or 32-true")
    return precision


def param_dtype(precision: str) -> torch.dtype:
    """The dtype weights are stored in: the low-precision one for *-true, fp32 under autocast."""
    return {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision, torch.float32)


def compute_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") else torch.float32


@dataclass
class Parallelism:
    """The parallel layout a run asked for, checked before any process starts."""

    strategy: str
    devices: int
    num_nodes: int
    fsdp: FSDPArgs
    deepspeed: DeepSpeedArgs

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    def fsdp_mesh_shape(self) -> Tuple[int, int]:
        """(replicas, shard group size) of the FSDP2 device mesh."""
        kind = self.fsdp.sharding_strategy
        if kind in ("FULL_SHARD", "SHARD_GRAD_OP"):
            return 1, self.world_size
        if kind == "NO_SHARD":
            return self.world_size, 1
        shard = self.fsdp.shard_size or self.devices
        return self.world_size // shard, shard

    def check(self, accelerator: str, precision: str) -> None:
        if self.strategy not in STRATEGIES:
            raise LitftError(f"--strategy {self.strategy} is unknown; choose one of {', '.join(STRATEGIES)}")
        if self.strategy != "fsdp" and self.fsdp != FSDPArgs():
            raise LitftError(f"--fsdp.* options only apply to --strategy fsdp (this run uses --strategy {self.strategy})")
        if self.strategy != "deepspeed" and self.deepspeed != DeepSpeedArgs():
            raise LitftError(f"--deepspeed.* options only apply to --strategy deepspeed (this run uses --strategy {self.strategy})")
        if self.strategy == "fsdp":
            self._check_fsdp(accelerator, precision)
        if self.strategy == "deepspeed":
            self._check_deepspeed()

    def _check_fsdp(self, accelerator: str, precision: str) -> None:
        fsdp = self.fsdp
        if precision == "16-mixed":
            raise LitftError("--strategy fsdp trains in 32-true, bf16-mixed or bf16-true; fp16 needs loss scaling that FSDP2 lacks")
        if fsdp.shard_size is not None and fsdp.sharding_strategy != "HYBRID_SHARD":
            raise LitftError(f"--fsdp.shard_size only applies to HYBRID_SHARD (this run uses {fsdp.sharding_strategy})")
        if fsdp.sharding_strategy == "HYBRID_SHARD":
            shard = fsdp.shard_size or self.devices
            if shard < 1 or self.world_size % shard:
                raise LitftError(
                    f"HYBRID_SHARD needs the world size ({self.devices} devices x {self.num_nodes} nodes = {self.world_size}) "
                    f"to be a multiple of the shard group size ({shard}); change --fsdp.shard_size or the process count"
                )
        if fsdp.cpu_offload and accelerator != "cuda":
            raise LitftError("--fsdp.cpu_offload moves GPU memory to the CPU; on --accelerator cpu there is nothing to offload, drop it")

    def _check_deepspeed(self) -> None:
        import importlib.util

        ds = self.deepspeed
        if importlib.util.find_spec("deepspeed") is None:
            raise LitftError("--strategy deepspeed needs DeepSpeed: DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed")
        if ds.offload_parameters is not None and ds.stage != 3:
            raise LitftError(f"--deepspeed.offload_parameters needs --deepspeed.stage 3 (got stage {ds.stage}); parameters are only partitioned in stage 3")
        if ds.offload_optimizer is not None and ds.stage == 0:
            raise LitftError("--deepspeed.offload_optimizer needs --deepspeed.stage 1, 2 or 3; stage 0 keeps no partitioned optimizer to offload")
        if ds.config is not None and (ds.stage, ds.offload_optimizer, ds.offload_parameters) != (2, None, None):
            raise LitftError("--deepspeed.config already says the stage and offload; drop --deepspeed.stage/offload_* or the config file")
        if ds.config is not None and not Path(ds.config).is_file():
            raise LitftError(f"--deepspeed.config {ds.config} does not exist; pass a DeepSpeed JSON file (examples in config_hub/deepspeed/)")


def make_strategy(layout: Parallelism, accelerator: str, precision: str, train: TrainArgs):
    backend = "nccl" if accelerator == "cuda" else "gloo"  # gloo is the only backend that works on the CPU
    if layout.strategy == "fsdp":
        return FSDP2Strategy(layout, precision, backend)
    if layout.strategy == "deepspeed":
        if accelerator == "cpu":
            # Read when deepspeed is first imported; without it DeepSpeed looks for CUDA.
            os.environ["DS_ACCELERATOR"] = "cpu"
        return _deepspeed_strategy_class()(
            config=deepspeed_config(layout.deepspeed, train, layout.world_size, precision), process_group_backend=backend
        )
    if layout.strategy == "auto" and layout.world_size == 1:
        return "auto"
    from lightning.fabric.strategies import DDPStrategy

    return DDPStrategy(process_group_backend=backend)


# Said by Lightning's CSV logger whenever logs/ has files; ours keeps them (see below).
warnings.filterwarnings("ignore", message=".*Experiment logs directory .* exists and is not empty.*")


def _continuing_csv_logger():
    from lightning.fabric.loggers import CSVLogger

    class ContinuingCSVLogger(CSVLogger):
        """Lightning's CSV logger, except that a resumed run continues the earlier run's metrics.csv.

        Lightning deletes an existing file; here its rows up to the resumed step are kept
        (later ones were logged by the run that died after its last checkpoint).
        """

        resumed_step: Optional[int] = None

        @property
        def experiment(self):
            if self._experiment is not None:
                return self._experiment
            import csv

            previous = Path(self.log_dir) / "metrics.csv"
            rows, keys = [], []
            if self.resumed_step is not None and previous.is_file():
                with open(previous, newline="") as f:
                    reader = csv.DictReader(f)
                    keys = list(reader.fieldnames or [])
                    rows = [r for r in reader if r.get("step") and int(float(r["step"])) <= self.resumed_step]
            writer = super().experiment
            if rows and hasattr(writer, "metrics_keys"):
                with open(previous, "w", newline="") as f:
                    out = csv.DictWriter(f, fieldnames=keys)
                    out.writeheader()
                    out.writerows(rows)
                writer.metrics_keys = keys
            return writer

    return ContinuingCSVLogger


def continue_logs(fabric, step: int) -> None:
    """Tell the CSV logger that this run resumes after ``step`` (before anything is logged)."""
    for logger in fabric.loggers:
        if hasattr(logger, "resumed_step"):
            logger.resumed_step = step


def build_fabric(*, accelerator: str, layout: Parallelism, precision: str, train: TrainArgs, out_dir: Optional[Path]):
    """A Fabric with CSV and TensorBoard loggers under ``out_dir/logs``."""
    import lightning as L
    from lightning.fabric.loggers import TensorBoardLogger

    loggers = []
    if out_dir is not None:
        loggers = [
            _continuing_csv_logger()(root_dir=str(out_dir), name="logs", version="csv", flush_logs_every_n_steps=1),
            TensorBoardLogger(root_dir=str(out_dir), name="logs", version="tensorboard"),
        ]
    return L.Fabric(
        accelerator=accelerator,
        devices=layout.devices,
        num_nodes=layout.num_nodes,
        strategy=make_strategy(layout, accelerator, precision, train),
        precision=precision,
        loggers=loggers,
    )


# ---------------------------------------------------------------- FSDP2


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 (``fully_shard``) on a (replicate, shard) device mesh, through Fabric.

    Lightning's own FSDPStrategy wraps FSDP1, which needs a GPU; FSDP2 runs on
    the CPU with gloo too, so every sharding strategy is tested in CI.
    """

    def __init__(self, layout: Parallelism, precision: str, backend: str):
        super().__init__(parallelize_fn=self._shard, process_group_backend=backend)
        self.layout = layout
        self.mixed = precision.endswith("-mixed")
        self.compute_dtype = compute_dtype(precision)

    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        # Skips ModelParallelStrategy's (data, tensor) mesh; ours is (replicate, shard).
        super(ModelParallelStrategy, self).setup_environment()
        self._setup_distributed()
        replicas, shard = self.layout.fsdp_mesh_shape()
        if self.global_rank == 0 and self.layout.fsdp.sharding_strategy == "HYBRID_SHARD" and replicas == 1:
            print(f"HYBRID_SHARD with one shard group of {shard} ranks: sharding as FULL_SHARD", flush=True)
        self._device_mesh = init_device_mesh(self.root_device.type, (replicas, shard), mesh_dim_names=("replicate", "shard"))

    def _shard(self, module, mesh):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        from litft.weights import transformer_blocks

        # FSDP2 shards over a 1-D mesh and does HSDP (replicate x shard) over a 2-D one.
        options = {
            "mesh": mesh["shard"] if mesh.shape[0] == 1 else mesh,
            "reshard_after_forward": self.layout.fsdp.sharding_strategy != "SHARD_GRAD_OP",
        }
        if self.mixed:
            # Low-precision compute, full-precision gradient reduction and sharded master weights.
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        if self.layout.fsdp.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy()
        # 4-bit base weights (QLoRA) are frozen and packed with their quantization state;
        # they stay whole on every rank, everything else (adapters, norms, embeddings) is sharded.
        options["ignored_params"] = {p for p in module.parameters() if type(p).__name__ == "Params4bit"} or None
        hf_model = module.hf_model
        units = transformer_blocks(hf_model)
        embeddings, head = hf_model.get_input_embeddings(), hf_model.get_output_embeddings()
        if head is not None and head.weight is not embeddings.weight:
            # Untied vocabulary matrices are the largest pieces; as units of their own
            # they are never full at the same time.
            units += [embeddings, head]
        for unit in units:
            module.materialize(unit)  # one full unit at a time, sharded right away
            fully_shard(unit, **options)
        module.materialize(module)
        fully_shard(hf_model, **options)
        return module


# ---------------------------------------------------------------- DeepSpeed


def deepspeed_config(args: DeepSpeedArgs, train: TrainArgs, world_size: int, precision: str) -> dict:
    """DeepSpeed's config from litft's flags, or the user's file with its "auto" values filled in.

    The loop owns accumulation: it marks the last micro-batch as the boundary (see
    ``_AccumulationBoundary``), then steps once, as under every other strategy.
    """
    accumulation = train.global_batch_size // (train.micro_batch_size * world_size)
    ours = {
        "train_batch_size": train.global_batch_size,
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
                raise LitftError(
                    f"--deepspeed.config sets {key} to {given} but litft's flags give {value}; set it to \"auto\" or change the flags"
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
    if config["zero_optimization"].get("stage", 0) == 0:
        config["gradient_clipping"] = 0.0  # litft clips stage 0 itself (see optimizer_step)
    # litft's AdamW keeps the math identical across strategies; DeepSpeed warns about client optimizers otherwise.
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("zero_force_ds_cpu_optimizer", False)
    config.setdefault("steps_per_print", 10**9)
    config.setdefault("wall_clock_breakdown", False)
    return config


class _AccumulationBoundary:
    """Fabric's no_backward_sync for DeepSpeed: only the last micro-batch's backward reduces gradients.

    DeepSpeed's engine otherwise counts micro-batches itself and expects ``step()``
    after each; telling it where the boundary is lets the loop step once per global batch.
    """

    def no_backward_sync(self, module, enabled: bool):
        module.set_gradient_accumulation_boundary(not enabled)
        return nullcontext()


def _deepspeed_strategy_class():
    from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy
    from lightning.fabric.utilities.seed import reset_seed

    class DeepSpeedAnyDevice(DeepSpeedStrategy):
        """Lightning's DeepSpeed strategy, also on CPU processes (DeepSpeed's CPU accelerator, gloo).

        Lightning refuses the CPU and checks CUDA device indices; DeepSpeed itself
        trains every ZeRO stage on the CPU, which is how CI tests it.
        """

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self._backward_sync_control = _AccumulationBoundary()

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
            import argparse

            import deepspeed

            # DeepSpeed wants a device index; a CPU device has none, the local rank stands in.
            index = self.root_device.index if self.root_device.type == "cuda" else self.local_rank
            engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
                args=argparse.Namespace(device_rank=index),
                config=self.config,
                model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad],
                optimizer=optimizer,
                lr_scheduler=scheduler,
                dist_init_required=False,
            )
            return engine, ds_optimizer, ds_scheduler

        def backward(self, tensor, module, *args, **kwargs):
            # The loop already divides by the global batch's token count.
            return super().backward(tensor, module, *args, scale_wrt_gas=False, **kwargs)

    return DeepSpeedAnyDevice


def is_deepspeed(fabric) -> bool:
    from lightning.fabric.strategies import DeepSpeedStrategy

    return isinstance(fabric.strategy, DeepSpeedStrategy)


def is_fsdp(fabric) -> bool:
    return isinstance(fabric.strategy, FSDP2Strategy)


# ---------------------------------------------------------------- what the loop and the jobs ask of a strategy


def setup_training(fabric, lm, move_to_device: bool = True):
    """The wrapped module, optimizer and LR scheduler, in the order each strategy needs.

    FSDP replaces parameters with shards, so the optimizer is made afterwards;
    DeepSpeed takes model and optimizer together.
    """
    if is_deepspeed(fabric):
        made = lm.configure_optimizers()
        module, optimizer = fabric.setup(lm, made["optimizer"])
        return module, optimizer, made["lr_scheduler"]
    module = fabric.setup_module(lm, move_to_device=move_to_device)
    made = lm.configure_optimizers()
    return module, fabric.setup_optimizers(made["optimizer"]), made["lr_scheduler"]


def optimizer_step(fabric, module, optimizer, max_norm: Optional[float]) -> Optional[float]:
    """Clip, step, zero the gradients; the global gradient norm before clipping (None when not computed)."""
    if is_deepspeed(fabric) and fabric.strategy.config["zero_optimization"].get("stage", 0) > 0:
        optimizer.step()  # ZeRO clips inside its step, from gradient_clipping in its config
        norm = fabric.strategy.model.get_global_grad_norm()
    elif is_deepspeed(fabric):
        # Stage 0 holds whole, already averaged gradients; its own clipping did not take
        # effect in our runs (losses equalled unclipped ones), so clip them here.
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm) if max_norm else None
        optimizer.step()
    else:
        norm = fabric.clip_gradients(module, optimizer, max_norm=max_norm) if max_norm else None
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if norm is None:
        return None
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def numel(param) -> int:
    """Elements of the whole parameter, also for a ZeRO-3 partitioned one."""
    return getattr(param, "ds_numel", None) or param.numel()


def full_shape(param) -> list:
    """The whole parameter's shape, also for a DTensor shard or a ZeRO-3 partition."""
    return list(getattr(param, "ds_shape", None) or param.shape)


def replica_divergence(fabric, lm) -> Optional[float]:
    """Largest difference of any parameter between FSDP replica groups (HYBRID_SHARD, NO_SHARD); None without replicas."""
    if not is_fsdp(fabric) or fabric.strategy.device_mesh.shape[0] == 1:
        return None
    import torch.distributed as dist

    group = fabric.strategy.device_mesh.get_group("replicate")
    local = torch.cat([p.to_local().detach().reshape(-1).double() for p in lm.parameters()])
    high, low = local.clone(), local.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    spread = (high - low).abs().max()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return float(spread)


def _local_bytes(tensor) -> int:
    if tensor is None:
        return 0
    if hasattr(tensor, "ds_tensor"):  # a ZeRO-3 parameter: only its partition lives here
        tensor = tensor.ds_tensor
    if hasattr(tensor, "to_local"):  # a DTensor: only this rank's shard
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def _optimizer_state_bytes(optimizer) -> int:
    return sum(_local_bytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def model_state_bytes(fabric, lm, optimizer) -> Dict[str, int]:
    """Bytes of parameters, gradients and optimizer states that this rank holds (measure before zero_grad)."""
    params = list(lm.parameters())
    counts = {"params": sum(_local_bytes(p) for p in params)}
    if not is_deepspeed(fabric):
        counts["grads"] = sum(_local_bytes(p.grad) for p in params)
        counts["optimizer"] = _optimizer_state_bytes(optimizer)
        return counts
    zero = fabric.strategy.model.optimizer
    masters = getattr(zero, "fp32_partitioned_groups_flat", None) or getattr(zero, "single_partition_of_fp32_groups", None)
    if masters is None:  # stage 0: a plain optimizer on whole gradients
        counts["grads"] = sum(_local_bytes(p.grad) for p in params)
        counts["optimizer"] = _optimizer_state_bytes(zero)
        return counts
    # ZeRO keeps an fp32 master copy of its partition, and gradients only for that partition.
    grads = getattr(zero, "grad_partitions_flat_buffer", None)  # stage 3
    if grads is None:
        grads = [g for group in getattr(zero, "averaged_gradients", {}).values() for g in (group or [])]  # stages 1 and 2
    counts["grads"] = _local_bytes(grads) if torch.is_tensor(grads) else sum(_local_bytes(g) for g in grads)
    counts["optimizer"] = _optimizer_state_bytes(zero.optimizer) + sum(_local_bytes(m) for m in masters)
    return counts
