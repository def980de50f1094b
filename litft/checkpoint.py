"""Sharded training checkpoints that a crash cannot half-write, and resuming from them on any topology.

A checkpoint is ``out_dir/checkpoints/step-00000042/``:

- ``model/``: parameters and optimizer states that train, as torch.distributed.checkpoint
  (DCP) writes them, one file per rank. DCP stores every tensor by name and global
  shape, so it reads back on any number of ranks and any sharding (FSDP, DDP, one process).
- ``deepspeed/``: DeepSpeed's own files instead, under ``--strategy deepspeed``; ZeRO
  partitions are per rank, so these resume on the same world size and stage.
- ``rng/rank-N.pt``: every rank's random generators.
- ``run_config.yaml``: the flags that made the run.
- ``meta.json``: step, tokens, data position, LR scheduler, world size and what the
  checkpoint fits (job, model shape, batch). It is written last, by rank 0, after
  every rank finished its files; then the folder is renamed from ``.step-N.partial``.
  A folder without it was never finished and is never resumed from.

Frozen weights (the base model under LoRA) are not stored: they come from the
model they were loaded from, which ``run_config.yaml`` names.
"""

import json
import os
import pickle
import random
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Optional

import torch

from litft.errors import LitftError
from litft.ranks import on_every_rank, on_rank_zero

# DCP warns on every single-process save and load that it is running without a process group.
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")

FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
META = "meta.json"
STEP_DIR = re.compile(r"^step-(\d{8})$")


# ---------------------------------------------------------------- finding checkpoints


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def complete_checkpoints(out_dir: Path) -> List[Path]:
    """Finished checkpoints in ``out_dir``, oldest first."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / META).is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve_resume(resume: Optional[str], out_dir: Path) -> Optional[Path]:
    """The checkpoint ``--resume`` names: ``auto`` is the newest finished one in out_dir (None if there is none)."""
    if resume is None:
        return None
    if resume == "auto":
        found = complete_checkpoints(out_dir)
        return found[-1] if found else None
    path = Path(resume).expanduser()
    if not path.exists():
        raise LitftError(f"--resume {resume}: no such checkpoint; pass a folder under <out_dir>/{CHECKPOINTS}/ or --resume auto")
    if (path / CHECKPOINTS).is_dir() and not (path / META).exists():  # a run's out_dir: its newest checkpoint
        found = complete_checkpoints(path)
        if not found:
            raise LitftError(f"--resume {resume}: this run has no finished checkpoint to resume from")
        return found[-1]
    if not (path / META).is_file():
        earlier = complete_checkpoints(path.parent.parent) if path.parent.name == CHECKPOINTS else []
        hint = f"; the newest finished one is {earlier[-1]}" if earlier else ""
        raise LitftError(f"--resume {resume} is not a finished litft checkpoint (no {META}: its save was interrupted or it is another folder){hint}")
    return path


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((Path(path) / META).read_text())
    except (OSError, ValueError) as err:
        raise LitftError(f"checkpoint {path}: {META} cannot be read ({err}); resume from another checkpoint") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise LitftError(f"checkpoint {path} has format version {meta.get('format_version')}, this litft reads {FORMAT_VERSION}")
    return meta


# ---------------------------------------------------------------- what a checkpoint must agree with


def model_fingerprint(config) -> Dict[str, object]:
    """The shape-defining fields of a model config: a checkpoint fits only a model with the same ones."""
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    return {k: getattr(config, k, None) for k in keys}


def trained_shapes(lm) -> Dict[str, List[int]]:
    from litft.strategy import full_shape

    return {name: full_shape(p) for name, p in lm.model.named_parameters() if p.requires_grad}


def check_fits(path: Path, stored: dict, current: dict, world_size: int) -> None:
    """One clear line when the checkpoint was made by another job, model, batch or strategy than this run."""
    where = f"checkpoint {path}"
    if stored["job"] != current["job"]:
        raise LitftError(f"{where} was written by {stored['job']}, not {current['job']}; resume it with litft {stored['job']}")
    if bool(stored["quantize"]) != bool(current["quantize"]):
        raise LitftError(f"{where} was trained with --quantize {stored['quantize']}; resume with the same --quantize")
    theirs, ours = stored["model_fingerprint"], current["model_fingerprint"]
    if theirs != ours:
        diff = ", ".join(f"{k} {theirs.get(k)} there, {v} here" for k, v in ours.items() if theirs.get(k) != v)
        raise LitftError(f"{where} belongs to another model ({diff}); pass the model it was trained from ({stored['model']})")
    theirs, ours = stored["trained_shapes"], current["trained_shapes"]
    if theirs != ours:
        differ = sorted(set(theirs) ^ set(ours)) or sorted(k for k in ours if ours[k] != theirs[k])
        raise LitftError(f"{where} trained other parameters than this run ({len(differ)} differ, e.g. {differ[0]}); use the LoRA flags of the run that wrote it")
    if stored["global_batch_size"] != current["global_batch_size"]:
        raise LitftError(
            f"{where} was trained with --train.global_batch_size {stored['global_batch_size']}; resume with the same global batch (micro batch and devices may change)"
        )
    if stored["num_train_samples"] != current["num_train_samples"]:
        raise LitftError(f"{where} was trained on {stored['num_train_samples']} samples, this data has {current['num_train_samples']}; resume with the same data")
    if (stored["format"] == "deepspeed") != (current["format"] == "deepspeed"):
        raise LitftError(f"{where} was written under --strategy {stored['strategy']}; resume it with --strategy {stored['strategy']}")
    if stored["format"] == "deepspeed" and (stored["world_size"] != world_size or stored["zero_stage"] != current["zero_stage"]):
        raise LitftError(
            f"{where} holds DeepSpeed ZeRO-{stored['zero_stage']} partitions of {stored['world_size']} ranks; resume on "
            f"{stored['world_size']} ranks with --deepspeed.stage {stored['zero_stage']} (this run: {world_size} ranks, stage {current['zero_stage']})"
        )


# ---------------------------------------------------------------- random generators


def rng_state() -> dict:
    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------- DCP metadata without arbitrary pickle


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: only DCP's own record classes, torch sizes and dtypes, and paths."""

    ALLOWED = {
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module, name):
        import torch.distributed.checkpoint.metadata as dcp_metadata

        if module == "torch.distributed.checkpoint.metadata" and hasattr(dcp_metadata, name):
            return getattr(dcp_metadata, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format, torch.layout)):
            return getattr(torch, name)
        if name in self.ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")


def safe_reader(path: Path):
    """DCP's file reader, reading the metadata through the restricted unpickler (tensors it reads with weights_only)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                try:
                    metadata = _MetadataUnpickler(f).load()
                except pickle.UnpicklingError as err:
                    raise LitftError(f"checkpoint {path}: refusing to read its metadata ({err})") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(path))


# ---------------------------------------------------------------- DeepSpeed's files, read without arbitrary pickle


@contextmanager
def deepspeed_safe_loading():
    """DeepSpeed reads its files with full pickle; inside this block every ``torch.load`` is ``weights_only=True``.

    Its files hold tensors, plain containers and a few DeepSpeed records (the ZeRO
    stage enum, the fp16 loss scalers, the address of a parameter's fragment in a
    flat partition), which are the only globals allowed.
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    allowed = [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]
    original = torch.load

    def safe_load(*args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(allowed):
            return original(*args, **kwargs)

    torch.load = safe_load
    try:
        yield
    finally:
        torch.load = original


# ---------------------------------------------------------------- saving and loading


def _model_and_optimizer_state(lm, optimizer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    inner = getattr(optimizer, "optimizer", optimizer)  # under Fabric's wrapper
    model_state, optimizer_state = get_state_dict(lm.model, inner, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": model_state, "optimizer": optimizer_state}, inner


class Checkpointer:
    """Saves the run every ``interval`` steps and at the end, keeping the newest ``keep``; loads one to resume."""

    def __init__(self, fabric, lm, optimizer, scheduler, out_dir: Path, interval: Optional[int], keep: int, meta: dict, run_config: dict):
        self.fabric, self.lm, self.optimizer, self.scheduler = fabric, lm, optimizer, scheduler
        self.out_dir = Path(out_dir)
        self.interval = interval
        self.keep = keep
        self.meta = meta
        self.run_config = run_config
        self.last_saved: Optional[int] = None
        self.last_path: Optional[Path] = None  # the newest finished checkpoint of this run

    @property
    def deepspeed(self) -> bool:
        from litft.strategy import is_deepspeed

        return is_deepspeed(self.fabric)

    def check_fits(self, path: Path) -> None:
        check_fits(path, read_meta(path), self.meta, self.fabric.world_size)

    def due(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    def save(self, state) -> Path:
        """Every rank writes its part into ``.step-N.partial``; rank 0 then writes meta.json and renames it."""
        fabric = self.fabric
        root = self.out_dir / CHECKPOINTS
        final, partial = root / step_name(state.step), root / f".{step_name(state.step)}.partial"

        def prepare():
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
            partial.mkdir(parents=True)

        on_rank_zero(fabric, prepare, "preparing a checkpoint folder")
        fabric.barrier()

        def write_own_part():
            if self.deepspeed:
                exclude_frozen = any(not p.requires_grad for p in self.lm.parameters())
                fabric.strategy.model.save_checkpoint(
                    str(partial), tag="deepspeed", client_state={}, save_latest=False, exclude_frozen_parameters=exclude_frozen
                )
            else:
                import torch.distributed.checkpoint as dcp

                state_dict, _ = _model_and_optimizer_state(self.lm, self.optimizer)
                dcp.save(state_dict, checkpoint_id=str(partial / "model"))
            (partial / "rng").mkdir(exist_ok=True)
            torch.save(rng_state(), partial / "rng" / f"rank-{fabric.global_rank:05d}.pt")

        on_every_rank(fabric, write_own_part, f"writing checkpoint {final}")
        fabric.barrier()

        def commit():
            import yaml

            meta = dict(
                self.meta,
                step=state.step, epoch=state.epoch, epoch_step=state.epoch_step, tokens=state.tokens, samples=state.samples,
                world_size=fabric.world_size, scheduler=self.scheduler.state_dict(),
            )
            (partial / "run_config.yaml").write_text(yaml.safe_dump(self.run_config, sort_keys=False))
            _write_synced(partial / META, json.dumps(meta, indent=1))
            if final.exists():  # the same step saved before (a resumed run ending where it started)
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_dir(root)
            for old in complete_checkpoints(self.out_dir)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)

        on_rank_zero(fabric, commit, f"finishing checkpoint {final}")
        fabric.barrier()
        self.last_saved, self.last_path = state.step, final
        return final

    def load(self, path: Path):
        """Restore weights, optimizer, scheduler and RNG from ``path``; the LoopState to continue from."""
        from litft.loop import LoopState

        meta = read_meta(path)
        fabric = self.fabric
        if self.deepspeed:
            try:
                with deepspeed_safe_loading():
                    loaded, _ = fabric.strategy.model.load_checkpoint(
                        str(path), tag="deepspeed", load_module_strict=False, load_optimizer_states=True, load_lr_scheduler_states=False
                    )
            except pickle.UnpicklingError as err:
                unsafe = re.search(r"GLOBAL (\S+)", str(err))
                raise LitftError(
                    f"checkpoint {path}: refusing to unpickle {unsafe.group(1) if unsafe else 'an object'} from DeepSpeed's files; "
                    "only tensors and DeepSpeed's own records are read"
                ) from None
            if loaded is None:
                raise LitftError(f"checkpoint {path}: DeepSpeed found no state to load in {path / 'deepspeed'}")
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            state_dict, inner = _model_and_optimizer_state(self.lm, self.optimizer)
            try:
                dcp.load(state_dict, storage_reader=safe_reader(path / "model"))
            except Exception as err:  # noqa: BLE001 - DCP's messages run to many lines
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise LitftError(f"checkpoint {path} could not be read ({first[:300]}); resume from another checkpoint") from None
            set_state_dict(
                self.lm.model, inner, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optimizer"],
                # Frozen weights are not in the checkpoint (they came from the model); dcp.load
                # above already failed on any trained tensor that was missing.
                options=StateDictOptions(ignore_frozen_params=True, strict=False),
            )
        self.scheduler.load_state_dict(meta["scheduler"])
        rng_file = path / "rng" / f"rank-{fabric.global_rank:05d}.pt"
        if rng_file.is_file():  # a rank that did not exist when it was written keeps its seeded generators
            set_rng_state(torch.load(rng_file, weights_only=True))
        self.last_saved, self.last_path = meta["step"], Path(path)
        return LoopState(step=meta["step"], epoch=meta["epoch"], epoch_step=meta["epoch_step"], tokens=meta["tokens"], samples=meta["samples"])


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
