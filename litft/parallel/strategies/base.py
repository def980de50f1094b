"""What every strategy does for a run, and the parts that one process, DDP and FSDP share.

A strategy is chosen once from the layout (``litft.parallel.strategies.strategy_for``). From
then on the trainer, the checkpointer, ``litft convert`` and ``litft estimate`` ask
it, never which strategy it is: it checks the layout, makes the Fabric strategy,
wraps and fills the model, steps the optimizer, counts what a rank holds, saves
and loads the training state, and describes its per-rank memory to the estimate.
"""

import contextlib
from pathlib import Path
from typing import Callable, ClassVar, Dict, Iterator, List, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from litft.checkpoint.format import safe_reader
from litft.config import Layout, TrainArgs
from litft.device import compute_dtype, param_dtype
from litft.errors import LitftError
from litft.model.fp8 import precompute_scales as precompute_fp8_scales
from litft.parallel.mesh import Mesh
from litft.model.weights import CheckpointWeights, Materializer, skeleton

Fill = Callable[[torch.nn.Module], None]  # gives real values to the meta tensors of a part of the model


def local_bytes(tensor) -> int:
    """Bytes of ``tensor`` on this rank: a DTensor's shard, a ZeRO-3 parameter's partition."""
    if tensor is None:
        return 0
    if hasattr(tensor, "ds_tensor"):
        tensor = tensor.ds_tensor
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def optimizer_state_bytes(optimizer) -> int:
    return sum(local_bytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def _model_and_optimizer_state(lm, optimizer):
    inner = getattr(optimizer, "optimizer", optimizer)  # under Fabric's wrapper
    model_state, optimizer_state = get_state_dict(lm.model, inner, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": model_state, "optimizer": optimizer_state}, inner


def read_dcp(folder: Path, state_dict: dict) -> None:
    """Fill ``state_dict`` in place from the checkpoint's DCP files; one line when they cannot be read."""
    try:
        dcp.load(state_dict, storage_reader=safe_reader(folder / "model"))
    except LitftError:
        raise
    except Exception as err:  # noqa: BLE001 - DCP's messages run to many lines
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise LitftError(f"checkpoint {folder} could not be read ({first[:300]}); resume from another checkpoint") from None


class TrainingStrategy:
    """The interface, with what one process and DDP do; FSDP and DeepSpeed override what differs."""

    name: ClassVar[str]
    compiles: ClassVar[bool] = True  # torch.compile of each block works under this strategy
    splits_blocks: ClassVar[bool] = False  # holds blocks split by --tensor_parallel or --expert_parallel (DTensors on a mesh)
    options: ClassVar[Optional[str]] = None  # the flag group only this strategy reads (--fsdp.*, --deepspeed.*)
    checkpoint_format: ClassVar[str] = "dcp"
    gathers_fp8: ClassVar[bool] = False  # all-gathers weights in FP8 under --fp8 tensorwise (FSDP), scales computed after each step

    def __init__(self, layout: Layout, accelerator: str, precision: str, train: TrainArgs, mesh: Optional[Mesh] = None):
        self.layout, self.accelerator, self.precision, self.train = layout, accelerator, precision, train
        self.mesh = mesh or Mesh.of(layout, type(self))  # every group the run uses comes from it, built once the processes join
        # NCCL for GPU tensors, and gloo beside it for CPU tensors (offloaded gradients, the loop's counts,
        # which then need no GPU sync); gloo alone on the CPU.
        self.backend = "cuda:nccl,cpu:gloo" if accelerator == "cuda" else "gloo"
        self.fabric = None
        self.idle_parameters = False  # some trained parameters may get no gradient in a step (a VLM's projector, a step without images)

    @property
    def fills_4bit(self) -> bool:
        """This strategy quantizes a 4-bit base itself, a unit at a time as it fills, instead of transformers loading it whole."""
        return False

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype the model's weights are built in: the precision's (fp32 under autocast, whose masters they are)."""
        return param_dtype(self.precision)

    @classmethod
    def frozen_base_dtype(cls, precision: str) -> Optional[torch.dtype]:
        """A LoRA base's dtype where it differs from the trained weights': the compute dtype under autocast.

        Weights that never change need no fp32 master: in bf16 they take half the
        memory, and autocast no longer casts each one before its matmul. The adapters
        keep fp32 masters.
        """
        return compute_dtype(precision) if precision.endswith("-mixed") else None

    @classmethod
    def frozen_dtype(cls, precision: str) -> torch.dtype:
        """Where a LoRA base lives under ``precision``: its own dtype where it differs, else the trained weights'."""
        return cls.frozen_base_dtype(precision) or param_dtype(precision)

    @classmethod
    def saved_dtype(cls, precision: str) -> torch.dtype:
        """The dtype a checkpoint stores the trained weights in: the weights' own (bf16 under bf16-true, fp32 masters else)."""
        return param_dtype(precision)

    @property
    def gathers_weights(self) -> bool:
        """Whether each rank gathers whole weights for a use and drops them after (FSDP, ZeRO-3): the transients that
        decide a sharded run's peak, which on the CPU must leave resident memory when freed (litft.device)."""
        return False

    def whole_weights(self, lm) -> Iterator[Tuple[str, torch.Tensor]]:
        """The model's weights whole, one tensor at a time, by their names in the transformers model (every rank takes part:
        a sharded tensor is gathered, its dropped copy freed before the next one)."""
        for name, param in lm.hf_model.named_parameters():
            yield name, param.full_tensor() if isinstance(param, DTensor) else param

    @classmethod
    def gathers_weights_for(cls, layout: Layout) -> bool:
        """Whether this layout's ranks hold a share of the weights that generation gathers whole (the estimate's count)."""
        return False

    def generation_weights(self, module):
        """A context held around a whole generate call (or a cycle's calls) in which the weights are whole for its every
        decode step; here (one device, DDP) they always are."""
        return contextlib.nullcontext()

    @property
    def host_device(self) -> str:
        """Where small collectives (counts, flags) can run without synchronizing the accelerator."""
        return "cpu" if "gloo" in self.backend or self.mesh.host_group is not None else self.accelerator

    def sum_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """The loop's counts (on ``host_device``) summed over every rank, in place."""
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(counts, group=self.mesh.host_group)
        return counts

    # ------------------------------------------------------------ before any process starts

    @classmethod
    def check(cls, layout: Layout, accelerator: str, precision: str) -> None:
        """Refuse a layout this strategy cannot run, in one line."""

    @classmethod
    def data_groups(cls, layout: Layout) -> Tuple[int, int]:
        """(replicas, shard group size) over the ranks a tensor-parallel group counts as one: every rank a replica here."""
        return layout.world_size // layout.tensor_parallel, 1

    @classmethod
    def facts(cls, layout: Layout, precision: str) -> dict:
        """How ``litft estimate`` names this layout: the strategy, and its shard group or ZeRO stage where it has one."""
        return {"strategy": cls.name, "shard_group": None, "zero_stage": None}

    def fabric_strategy(self):
        """What ``lightning.Fabric(strategy=...)`` takes."""
        raise NotImplementedError

    # ------------------------------------------------------------ building and training

    def structure(self, config, dtype: torch.dtype) -> torch.nn.Module:
        """The model's structure before it has values: on the meta device, filled unit by unit later."""
        return skeleton(config, dtype)

    def filler(self, lm, weights: Optional[CheckpointWeights], seed: int) -> Fill:
        """What gives the structure's tensors their first values: the checkpoint's, or a seeded init (``weights`` None)."""
        return Materializer(lm.model, lm.hf_model, weights, seed)

    def setup(self, fabric, lm, fill: Fill, on_device: bool):
        """Fill the model, wrap it, and make its optimizer and LR scheduler: ``(module, optimizer, scheduler)``.

        ``on_device``: the model was loaded onto its device already (a 4-bit base).
        """
        self.fabric = fabric
        fill(lm)
        module = fabric.setup_module(lm, move_to_device=not on_device)
        made = lm.configure_optimizers()
        return module, fabric.setup_optimizers(made["optimizer"]), made["lr_scheduler"]

    def optimizer_step(self, module, optimizer, max_norm: Optional[float]):
        """Clip, step, zero the gradients; the global gradient norm before clipping, as a tensor (None when not computed).

        Non-finite norms are not checked here: that check reads the norm back from the
        device every step; the logged norm shows them.
        """
        norm = self.clip_gradients(module, optimizer, max_norm) if max_norm else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.gathers_fp8 and getattr(module, "fp8_all_gather", False):
            precompute_fp8_scales(module)  # one reduction for every weight's scale, before the next all-gather
        return norm

    def clip_gradients(self, module, optimizer, max_norm: float):
        """Clip to ``max_norm``; the global norm before clipping."""
        return self.fabric.clip_gradients(module, optimizer, max_norm=max_norm, error_if_nonfinite=False)

    def state_bytes(self, lm, optimizer) -> Dict[str, int]:
        """Bytes of parameters, gradients and optimizer states this rank holds (measure before zero_grad)."""
        params = list(lm.parameters())
        return {
            "params": sum(local_bytes(p) for p in params),
            "grads": sum(local_bytes(p.grad) for p in params),
            "optimizer": optimizer_state_bytes(optimizer),
        }

    def numel(self, param) -> int:
        """Elements of the whole parameter, however it is split across ranks."""
        return param.numel()

    def trained_shapes(self, lm) -> Dict[str, List[int]]:
        """Whole shapes of the trained tensors, by name: what a checkpoint must match to be resumed."""
        return {name: list(p.shape) for name, p in lm.model.named_parameters() if p.requires_grad}

    def replicas_in_step(self, lm) -> Optional[float]:
        """Largest parameter difference between replica groups that should be equal; None without such groups."""
        return None

    # ------------------------------------------------------------ checkpoints

    def checkpoint_fields(self) -> dict:
        """What the checkpoint's meta records about how it was written."""
        return {"format": self.checkpoint_format, "strategy": self.layout.strategy, "zero_stage": None}

    def checkpoint_state(self, lm, optimizer) -> dict:
        """This rank's part of the training state (trained tensors and optimizer states), as DCP writes it.

        DCP stores every tensor by name and global shape, so what one process, DDP,
        FSDP or DeepSpeed wrote reads back on any number of ranks and any sharding.
        """
        state_dict, _ = _model_and_optimizer_state(lm, optimizer)
        return state_dict

    def load(self, folder: Path, lm, optimizer) -> None:
        state_dict, inner = _model_and_optimizer_state(lm, optimizer)
        read_dcp(folder, state_dict)
        set_state_dict(
            lm.model, inner, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optimizer"],
            # Frozen weights are not in the checkpoint (they come from the model); dcp.load
            # above already failed on any trained tensor that was missing.
            options=StateDictOptions(ignore_frozen_params=True, strict=False),
        )

    # ------------------------------------------------------------ for litft estimate

    @classmethod
    def compute_view(cls, layout: Layout, precision: str) -> Tuple[Callable, Optional[torch.dtype]]:
        """The dtype each parameter has during the forward, and autocast's dtype (None: no autocast)."""
        autocast = compute_dtype(precision) if precision.endswith("-mixed") else None
        return (lambda p: p.dtype), autocast
