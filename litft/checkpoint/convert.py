"""``litft convert``: a training checkpoint becomes a Hugging Face folder, one transformer block at a time.

A checkpoint stores every trained tensor by name, so each block's tensors can be
read on their own, merged with their LoRA adapters, written to their own place in
a safetensors file and dropped before the next block is read: the export never
holds more than one block, however large the model and however many ranks wrote
the checkpoint. Frozen base weights (LoRA) are read tensor by tensor from the model
the run started from.
"""

import copy
import errno
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Dict, List, Literal, Optional

import torch
import yaml
from safetensors.torch import save_file

from litft.checkpoint.format import RUN_CONFIG, CheckpointMeta, TrainedTensors, dcp_trained_tensors, resolve_resume
from litft.errors import LitftError
from litft.config import LoraArgs
from litft.model.lora import expert_lora_config
from litft.model.loading import load_config, load_tokenizer, resolve_model
from litft.model.hub_layout import model_layout_weights
from litft.data.images import load_processor
from litft.model.vision import auto_model_class, reading_images, sees_images
from litft.model.weights import PEFT_PREFIX, locate_checkpoint, skeleton, transformer_blocks

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ADAPTER_KEY = re.compile(r"\.(lora_[AB])\.default\.weight$")


def block_groups(hf_model) -> List[List[str]]:
    """The model's parameter names, one list per transformer block, then one per other module (embeddings, norm, head)."""
    module_names = {id(m): n for n, m in hf_model.named_modules()}
    prefixes = [module_names[id(b)] + "." for b in transformer_blocks(hf_model)]
    groups: Dict[str, List[str]] = {p: [] for p in prefixes}
    for name, _ in hf_model.named_parameters():  # a tied weight once, under its first name
        owner = next((p for p in prefixes if name.startswith(p)), name.rsplit(".", 1)[0])
        groups.setdefault(owner, []).append(name)
    return [g for g in groups.values() if g]


def convert(
    checkpoint: Path,
    out_dir: Optional[Path] = None,
    merge_lora: bool = True,
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None,
    max_shard_gb: float = 5.0,
) -> Path:
    """Write a training checkpoint as a Hugging Face model folder (safetensors, config, tokenizer).

    Args:
        checkpoint: A checkpoint folder (<out_dir>/checkpoints/step-N) or a run's out_dir (its newest checkpoint).
        out_dir: Where the Hugging Face folder goes (default: <checkpoint>-hf); it must not exist yet or be empty.
        merge_lora: LoRA runs: fold the adapters into the base weights (true), or write only the adapter as a peft folder (false).
        dtype: float32, bfloat16 or float16 (default: the dtype the weights were trained in).
        max_shard_gb: Largest safetensors file; bigger models get several and an index, as on the hub.
    """
    path = resolve_resume(str(checkpoint), Path(checkpoint))
    target = Path(out_dir) if out_dir is not None else path.parent / f"{path.name}-hf"
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise LitftError(f"--out_dir {target} already holds files; choose a new folder")
    export(path, target, merge_lora=merge_lora, dtype=dtype, max_shard_bytes=int(max_shard_gb * 2**30))
    print(f"converted {path} to {target}")
    return target


def merge_lora(
    checkpoint: Path,
    out_dir: Optional[Path] = None,
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None,
    max_shard_gb: float = 5.0,
) -> Path:
    """Fold a LoRA run's adapters into its base weights and write a Hugging Face folder (what litft convert does for LoRA).

    Args:
        checkpoint: A LoRA checkpoint folder (<out_dir>/checkpoints/step-N) or a LoRA run's out_dir (its newest checkpoint).
        out_dir: Where the merged model goes (default: <checkpoint>-hf); it must not exist yet or be empty.
        dtype: float32, bfloat16 or float16 (default: the dtype the weights were trained in).
        max_shard_gb: Largest safetensors file; bigger models get several and an index, as on the hub.
    """
    path = Path(checkpoint)
    if (path / "adapter_config.json").is_file():
        raise LitftError(
            f"{checkpoint} is a peft adapter folder; pass the run's folder or checkpoint (its final/ holds the merged model if it ran with --export merged or both)"
        )
    job = CheckpointMeta.read(resolve_resume(str(checkpoint), path)).job
    if job != "finetune_lora":
        raise LitftError(f"{checkpoint} was written by {job}, which trains no adapter; litft convert writes it as a Hugging Face folder")
    return convert(checkpoint, out_dir, merge_lora=True, dtype=dtype, max_shard_gb=max_shard_gb)


def free_bytes(folder: Path) -> int:
    """Free bytes on the filesystem that holds ``folder`` (or its nearest existing parent)."""
    folder = Path(folder).absolute()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def trained_config(meta: CheckpointMeta):
    """The config of the model a checkpoint's run built: a composite folder's image-text model where the run read images."""
    config = load_config(resolve_model(meta.model))
    return reading_images(config) if meta.image_text_model else config


def export_bytes(trained: TrainedTensors, meta: CheckpointMeta, adapter_only: bool, dtype: Optional[str]) -> int:
    """What an export writes, tokenizer aside: the adapter's tensors, or every weight of the model (a tied one once)."""
    size = (lambda stored: DTYPES[dtype].itemsize) if dtype else (lambda stored: stored.itemsize)
    if adapter_only:
        return sum(math.prod(shape) * size(stored) for name, (shape, stored) in trained.shapes.items() if ADAPTER_KEY.search(name))
    stored = next(iter(trained.shapes.values()))[1]
    return sum(p.numel() * size(stored) for p in skeleton(trained_config(meta), stored).parameters())


# Room kept beyond the tensors: tokenizer files, config, safetensors headers and the filesystem's own blocks.
EXPORT_MARGIN = 64 * 2**20


def export(path: Path, target: Path, merge_lora: bool = True, dtype: Optional[str] = None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write ``target`` beside itself under a temporary name, then swap it in: a crash leaves any earlier one whole.

    Free space is checked first, and a disk that fills anyway is one line: the
    checkpoint, which holds the training, is never touched.
    """
    meta = CheckpointMeta.read(path)
    run_config = yaml.safe_load((path / RUN_CONFIG).read_text())
    if meta.format != "dcp":
        raise LitftError(f"checkpoint {path} {meta.unreadable_format()}")
    trained = dcp_trained_tensors(path)
    lora = meta.job == "finetune_lora"
    adapter_only = lora and not merge_lora
    what = "the adapter" if adapter_only else "the merged model" if lora else "the model"
    needed, free = export_bytes(trained, meta, adapter_only, dtype) + EXPORT_MARGIN, free_bytes(target.parent)
    later = f"the checkpoint {path} keeps the training; litft convert writes it once there is room"
    if needed > free:
        raise LitftError(f"writing {what} to {target} needs {needed / 2**30:.2f} GiB and only {free / 2**30:.2f} GiB is free there; {later}")
    staging, old = target.parent / f".{target.name}.partial", target.parent / f".{target.name}.old"
    for leftover in (staging, old):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        if adapter_only:
            _write_adapter(trained, meta, run_config, staging, dtype)
        else:
            _write_model(trained, meta, run_config, staging, dtype, lora, max_shard_bytes)
        if target.exists():
            os.rename(target, old)
        os.rename(staging, target)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        raise LitftError(f"the disk filled while writing {what} to {target} ({needed / 2**30:.2f} GiB needed); {later}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_model(trained: TrainedTensors, meta: CheckpointMeta, run_config: dict, staging: Path, dtype: Optional[str], lora: bool, max_shard_bytes: int) -> None:
    source = resolve_model(meta.model)
    config = trained_config(meta)
    out_dtype = DTYPES[dtype] if dtype else next(iter(trained.shapes.values()))[1]
    # Frozen weights come from the model the run started from (LoRA's base; a vision-language model's frozen image encoder).
    base = model_layout_weights(locate_checkpoint(source), config) if lora or kept_frozen(config, meta) else None
    scale = run_config["lora_alpha"] / run_config["lora_r"] if lora else 0.0
    prefix = "base_model.model." if lora else ""
    model = skeleton(config, out_dtype)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    groups = block_groups(model)
    used = set()
    with SafetensorsWriter(staging, [(n, shapes[n]) for g in groups for n in g], out_dtype, max_shard_bytes) as writer:
        for names in groups:
            block, read = _block_tensors(names, trained, base, prefix, scale, meta.job)
            used |= read
            for name in names:
                writer.write(name, block[name])
            del block  # the next block is read only now
    left = sorted(set(meta.trained_shapes) - used)
    if left:
        raise LitftError(f"the checkpoint trained {left[0]}, which cannot be merged into the model; convert with --merge_lora false")
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    config = config_of(model, config)
    config.dtype = out_dtype
    config.save_pretrained(staging)
    generation = locate_checkpoint(source) / "generation_config.json"
    if generation.is_file():
        shutil.copy(generation, staging / generation.name)
    save_processing(run_config, meta, staging, config)


def config_of(model, config):
    """The config that describes what was exported: the class written (``architectures``), and where that class is the text
    model of a composite folder (Qwen3.5 checkpoints trained as their causal-LM class), its text config, so that
    the folder loads as the model it holds rather than as the image-text model it came from."""
    config_class = getattr(type(model), "config_class", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if config_class is not None and not isinstance(config, config_class) and isinstance(text, config_class):
        config = copy.deepcopy(text)
    config.architectures = [type(model).__name__]
    return config


def model_from_checkpoint(path: Path, dtype: Optional[torch.dtype] = None):
    """A training checkpoint as a transformers model in memory, filled a block at a time as the export reads it (LoRA merged
    into the base), with nothing written to disk; and its tokenizer."""
    try:  # transformers 5 keeps it here; 4.x in modeling_utils
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights

    meta = CheckpointMeta.read(path)
    if meta.format != "dcp":
        raise LitftError(f"checkpoint {path} {meta.unreadable_format()}")
    run_config = yaml.safe_load((path / RUN_CONFIG).read_text())
    trained, lora = dcp_trained_tensors(path), meta.job == "finetune_lora"
    source = resolve_model(meta.model)
    config = trained_config(meta)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    out_dtype = dtype if isinstance(dtype, torch.dtype) else next(iter(trained.shapes.values()))[1]  # "auto": as trained
    with no_init_weights():  # every weight is filled from the checkpoint; buffers (rotary frequencies) are made as usual
        model = auto_model_class(config).from_config(config, dtype=out_dtype)
    base = model_layout_weights(locate_checkpoint(source), config) if lora or kept_frozen(config, meta) else None
    scale = run_config["lora_alpha"] / run_config["lora_r"] if lora else 0.0
    params = dict(model.named_parameters())
    with torch.no_grad():
        for names in block_groups(model):
            block, _ = _block_tensors(names, trained, base, "base_model.model." if lora else "", scale, meta.job)
            for name in names:
                params[name].copy_(block[name])
    model.tie_weights()
    return model.eval(), load_tokenizer(resolve_model(run_config.get("tokenizer") or meta.model))


def kept_frozen(config, meta: CheckpointMeta) -> bool:
    """Whether a full run left weights frozen that its checkpoint does not hold: a vision-language model's image encoder
    (not in pretraining, which starts every weight at random and trains them all)."""
    return sees_images(config) and meta.job != "pretrain"


def save_processing(run_config: dict, meta: CheckpointMeta, staging: Path, config) -> None:
    """The tokenizer beside an export; a vision-language model's (``config``'s) whole processor (image processor and chat
    template too), so that ``AutoProcessor`` loads the folder."""
    source = resolve_model(run_config.get("tokenizer") or meta.model)
    if sees_images(config):
        load_processor(source).save_pretrained(staging)
    else:
        load_tokenizer(source).save_pretrained(staging)


class SafetensorsWriter:
    """Writes safetensors files tensor by tensor, in a planned order, without holding them all.

    The format is an 8-byte little-endian header length, a JSON header giving each
    tensor's dtype, shape and byte range, then the raw bytes; with every shape known
    in advance the header can be written first and each tensor appended as it comes.
    """

    CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

    def __init__(self, folder: Path, plan: List[tuple], dtype: torch.dtype, max_shard_bytes: int):
        self.folder, self.dtype = folder, dtype
        size = torch.empty((), dtype=dtype).element_size()
        self.files: List[List[tuple]] = [[]]
        used = 0
        for name, shape in plan:
            nbytes = size * math.prod(shape)
            if self.files[-1] and used + nbytes > max_shard_bytes:
                self.files.append([])
                used = 0
            self.files[-1].append((name, shape, nbytes))
            used += nbytes
        self.total = sum(n for f in self.files for _, _, n in f)
        self.file_names = (
            ["model.safetensors"] if len(self.files) == 1
            else [f"model-{i:05d}-of-{len(self.files):05d}.safetensors" for i in range(1, len(self.files) + 1)]
        )
        self.pending = [(i, name, shape) for i, f in enumerate(self.files) for name, shape, _ in f]
        self.handle, self.current = None, -1

    def __enter__(self):
        return self

    def write(self, name: str, tensor: torch.Tensor) -> None:
        index, expected, shape = self.pending.pop(0)
        if name != expected or tuple(tensor.shape) != tuple(shape):
            raise RuntimeError(f"safetensors writer expected {expected} {shape}, got {name} {tuple(tensor.shape)}")
        if index != self.current:
            self._open(index)
        flat = tensor.detach().to(self.dtype).contiguous().reshape(-1)
        self.handle.write(memoryview(flat.view(torch.uint8).numpy()))  # the tensor's own bytes, not a copy

    def _open(self, index: int) -> None:
        if self.handle is not None:
            self.handle.close()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, nbytes in self.files[index]:
            header[name] = {"dtype": self.CODES[self.dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self.handle = open(self.folder / self.file_names[index], "wb")
        self.handle.write(len(text).to_bytes(8, "little") + text)
        self.current = index

    def __exit__(self, kind, value, traceback):
        if self.handle is not None:
            self.handle.close()
        if kind is None:
            if self.pending:
                raise RuntimeError(f"safetensors writer: {len(self.pending)} tensors were never written")
            if len(self.files) > 1:
                weight_map = {name: self.file_names[i] for i, f in enumerate(self.files) for name, _, _ in f}
                index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
                (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        return False


def _block_tensors(names: List[str], trained: TrainedTensors, base, prefix: str, scale: float, job: str):
    """One block's weights under their Hugging Face names, adapters folded in: W + (alpha / r) * B @ A; and the trained names read."""
    adapters = {}
    for name in names:
        module = name.rsplit(".", 1)[0]
        adapters[name] = (f"{prefix}{module}.lora_A.default.weight", f"{prefix}{module}.lora_B.default.weight")
    wanted = [prefix + n for n in names] + [k for pair in adapters.values() for k in pair]
    values = trained.read(wanted)
    block = {}
    for name in names:
        if prefix + name in values:
            block[name] = values[prefix + name]
        elif base is not None and base.find([name]) is not None:
            block[name] = base.get(base.find([name])).clone()
        else:
            raise LitftError(f"the checkpoint has no tensor for {name}; it was not written by a {job} run of this model")
        a_key, b_key = adapters[name]
        if name.endswith(".weight") and a_key in values:
            delta = values[b_key].float() @ values[a_key].float()
            block[name] = (block[name].float() + scale * delta).to(block[name].dtype)
    return block, set(values)


def _write_adapter(trained: TrainedTensors, meta: CheckpointMeta, run_config: dict, staging: Path, dtype: Optional[str]) -> None:
    """The LoRA adapter alone, as the peft folder that ``PeftModel.from_pretrained`` reads."""
    from peft import LoraConfig  # here, not at the top: litft.model.lora says why

    tensors = trained.read([n for n in trained.shapes if ADAPTER_KEY.search(n)])
    out_dtype = DTYPES[dtype] if dtype else None
    saved = {ADAPTER_KEY.sub(r".\1.weight", k): (v.to(out_dtype) if out_dtype else v).contiguous() for k, v in tensors.items()}
    adapted = {k.removesuffix(".lora_A.default.weight").removeprefix(PEFT_PREFIX) for k in tensors if ".lora_A." in k}
    # By short name (q_proj...), except in a vision-language model, whose encoder has layers of the same short names: by full name.
    config = trained_config(meta)
    targets = sorted(adapted if sees_images(config) else {name.rsplit(".", 1)[-1] for name in adapted})
    experts = None
    if any(".base_layer.lora_A." in k for k in tensors) or "experts" in targets:  # adapters on MoE experts' tensors (ParamWrapper)
        resolved = expert_lora_config(config, LoraArgs(
            run_config["lora_r"], run_config["lora_alpha"], 0.0, run_config.get("lora_target_modules", "all-linear")))
        targets, experts = resolved.target_modules, resolved.target_parameters
    LoraConfig(
        # peft refuses to load expert adapters with a dropout (it only matters in training)
        r=run_config["lora_r"], lora_alpha=run_config["lora_alpha"], lora_dropout=0.0 if experts else run_config["lora_dropout"],
        target_modules=sorted(targets), target_parameters=experts, task_type="CAUSAL_LM", bias="none", base_model_name_or_path=meta.model,
    ).save_pretrained(str(staging))
    save_file(saved, str(staging / "adapter_model.safetensors"), metadata={"format": "pt"})
    save_processing(run_config, meta, staging, config)
