"""What a checkpoint is on disk, how to find one, and how to read it without arbitrary pickle.

A checkpoint is ``out_dir/checkpoints/step-00000042/``:

- ``model/``: parameters and optimizer states that train, as torch.distributed.checkpoint
  (DCP) writes them, one file per rank, in the layout of a plain AdamW run's
  ``get_state_dict`` whatever the strategy (DeepSpeed's fp32 masters and AdamW states
  are written per parameter in that layout, see ``strategies/deepspeed_state.py``).
  DCP stores every tensor by name and global shape, so it reads back on any number
  of ranks, any sharding and any strategy (FSDP, DDP, DeepSpeed at any ZeRO stage, one process).
- ``rng/rank-N.pt``: every rank's random generators.
- ``run_config.yaml``: the flags that made the run.
- ``meta.json``: a :class:`CheckpointMeta`. It is written last, by rank 0, after every
  rank finished its files; then the folder is renamed from ``.step-N.partial``. A
  folder without it was never finished and is never resumed from.

Frozen weights (the base model under LoRA) are not stored: they come from the
model they were loaded from, which ``run_config.yaml`` names.
"""

import json
import os
import pickle
import random
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from litft.errors import LitftError

FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
META = "meta.json"
RUN_CONFIG = "run_config.yaml"
STEP_DIR = re.compile(r"^step-(\d{8})$")
FINGERPRINT_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def complete_checkpoints(out_dir: Path) -> List[Path]:
    """Finished checkpoints in ``out_dir``, oldest first."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / META).is_file()), key=lambda p: p.name)


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


@dataclass
class CheckpointMeta:
    """The run a checkpoint belongs to (what a resume must match) and where its loop stood.

    Built from the run by the trainer, written by the checkpointer, read back by a
    resume and by ``litft convert``: one schema, one reader.
    """

    job: str
    model: str
    quantize: Optional[str]
    format: str
    strategy: str
    zero_stage: Optional[int]
    model_fingerprint: Dict[str, object]
    trained_shapes: Optional[Dict[str, List[int]]]
    global_batch_size: int
    num_train_samples: int
    seed: int
    world_size: int = 1
    image_text_model: bool = False  # a composite folder (Qwen3.5) trained as its image-text model, not as its text model
    scheduler: dict = field(default_factory=dict)
    position: Dict[str, int] = field(default_factory=dict)  # the loop's state_dict: step, epoch, tokens, ...
    format_version: int = FORMAT_VERSION

    @property
    def step(self) -> int:
        return self.position["step"]

    @staticmethod
    def fingerprint(config) -> Dict[str, object]:
        """The shape-defining fields of a model config: a checkpoint fits only a model with the same ones."""
        return {k: getattr(config, k, None) for k in FINGERPRINT_KEYS}

    def to_json(self) -> str:
        data = asdict(self)
        data.update(data.pop("position"))  # flat, as every litft checkpoint has been
        return json.dumps(data, indent=1)

    @classmethod
    def read(cls, path: Path) -> "CheckpointMeta":
        try:
            data = json.loads((Path(path) / META).read_text())
        except (OSError, ValueError) as err:
            raise LitftError(f"checkpoint {path}: {META} cannot be read ({err}); resume from another checkpoint") from None
        if data.get("format_version") != FORMAT_VERSION:
            raise LitftError(f"checkpoint {path} has format version {data.get('format_version')}, this litft reads {FORMAT_VERSION}")
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        return cls(**known, position={k: v for k, v in data.items() if k not in names})

    def check_fits(self, path: Path, current: "CheckpointMeta") -> None:
        """One clear line when the checkpoint at ``path`` was made by another job, model, batch or format than ``current``
        (its trained shapes too, once ``current`` has them)."""
        where = f"checkpoint {path}"
        if self.job != current.job:
            raise LitftError(f"{where} was written by {self.job}, not {current.job}; resume it with litft {self.job}")
        if self.image_text_model != current.image_text_model:
            had = "image records (its image-text model)" if self.image_text_model else "text records (its text model)"
            raise LitftError(f"{where} was trained on {had}; resume it with data of the same kind")
        if bool(self.quantize) != bool(current.quantize):
            raise LitftError(f"{where} was trained with --quantize {self.quantize}; resume with the same --quantize")
        if self.model_fingerprint != current.model_fingerprint:
            theirs, ours = self.model_fingerprint, current.model_fingerprint
            diff = ", ".join(f"{k} {theirs.get(k)} there, {v} here" for k, v in ours.items() if theirs.get(k) != v)
            raise LitftError(f"{where} belongs to another model ({diff}); pass the model it was trained from ({self.model})")
        if current.trained_shapes is not None and self.trained_shapes != current.trained_shapes:  # None: the model is not built yet
            theirs, ours = self.trained_shapes, current.trained_shapes
            differ = sorted(set(theirs) ^ set(ours)) or sorted(k for k in ours if ours[k] != theirs[k])
            raise LitftError(f"{where} trained other parameters than this run ({len(differ)} differ, e.g. {differ[0]}); use the LoRA flags of the run that wrote it")
        if self.global_batch_size != current.global_batch_size:
            raise LitftError(
                f"{where} was trained with --train.global_batch_size {self.global_batch_size}; resume with the same global batch (micro batch and devices may change)"
            )
        if self.num_train_samples != current.num_train_samples:
            raise LitftError(f"{where} was trained on {self.num_train_samples} samples, this data has {current.num_train_samples}; resume with the same data")
        if self.format != current.format:
            raise LitftError(f"{where} {self.unreadable_format()}; resume from a checkpoint of this litft or start again")

    def unreadable_format(self) -> str:
        return f"holds {self.format} files (an earlier litft's DeepSpeed format), this litft reads only its DCP layout"


# ---------------------------------------------------------------- random generators


def rng_state() -> dict:
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
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------- files written so that a crash cannot half-write them


def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- DCP metadata without arbitrary pickle


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: only DCP's own record classes, torch sizes and dtypes, and paths."""

    ALLOWED = {
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module, name):
        if module == "torch.distributed.checkpoint.metadata" and hasattr(dcp_metadata, name):
            return getattr(dcp_metadata, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format, torch.layout)):
            return getattr(torch, name)
        if name in self.ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, reading the metadata through the restricted unpickler (tensors it reads with weights_only)."""

    def read_metadata(self, *args, **kwargs):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            try:
                metadata = MetadataUnpickler(f).load()
            except pickle.UnpicklingError as err:
                raise LitftError(f"checkpoint {self.path}: refusing to read its metadata ({err})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def safe_reader(path: Path) -> SafeFileSystemReader:
    return SafeFileSystemReader(str(path))


# ---------------------------------------------------------------- the trained tensors, by name


class TrainedTensors:
    """The tensors a checkpoint trained, named as in the training model (peft names under LoRA)."""

    def __init__(self, shapes: Dict[str, Tuple[tuple, torch.dtype]], read: Callable[[List[str]], Dict[str, torch.Tensor]]):
        self.shapes = shapes
        self._read = read

    @classmethod
    def whole(cls, tensors: Dict[str, torch.Tensor]) -> "TrainedTensors":
        return cls({k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}, lambda names: {n: tensors[n] for n in names})

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def read(self, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        names = [n for n in names if n in self.shapes]
        return self._read(names) if names else {}


def dcp_trained_tensors(checkpoint: Path) -> TrainedTensors:
    """A DCP checkpoint's trained tensors, each read on its own when asked for."""
    reader_path = checkpoint / "model"
    stored = safe_reader(reader_path).read_metadata().state_dict_metadata
    shapes = {
        k.removeprefix("model."): (tuple(v.size), v.properties.dtype)
        for k, v in stored.items()
        if k.startswith("model.") and hasattr(v, "properties")
    }

    def read(names: List[str]) -> Dict[str, torch.Tensor]:
        wanted = {n: torch.empty(shapes[n][0], dtype=shapes[n][1]) for n in names}
        dcp.load({"model": wanted}, storage_reader=safe_reader(reader_path), no_dist=True)
        return wanted

    return TrainedTensors(shapes, read)
