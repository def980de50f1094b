"""Where a model's first values come from: a checkpoint read tensor by tensor, or a seeded init.

Every job builds its model on the meta device (no memory), applies LoRA there,
and then gives real values to one unit at a time: a transformer block, then the
rest. Under FSDP each block is sharded right after it is filled, so no rank ever
holds more than one full block beside its shards. Because every tensor's value is
a pure function of (checkpoint or seed, tensor name), one process, DDP, FSDP and
DeepSpeed all start from the same weights, which is what lets the tests compare
their losses.
"""

import json
import math
import re
import zlib
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open
from torch import nn
from transformers import PreTrainedModel

from litft.errors import LitftError
from litft.model.vision import auto_model_class, language_model_name

PEFT_PREFIX = "base_model.model."


def checkpoint_name(name: str) -> str:
    """The name a tensor has in the base model's checkpoint: peft's wrappers removed (nested ones too: expert adapters)."""
    return re.sub(r"(\.base_layer)+\.", ".", name.removeprefix(PEFT_PREFIX))


def is_lora_tensor(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name


class CheckpointWeights:
    """Read-only access to the tensors of a Hugging Face checkpoint folder, one tensor at a time.

    safetensors files are memory-mapped, so reading a tensor touches only its bytes.
    ``.bin`` checkpoints are loaded with ``weights_only=True`` (never arbitrary pickle).
    """

    def __init__(self, folder: Path):
        self.folder = folder
        self.where: Dict[str, Path] = {}
        self._open: dict = {}
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.where = {name: folder / file for name, file in weight_map.items()}
        elif (folder / "model.safetensors").is_file():
            with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
                self.where = {name: folder / "model.safetensors" for name in f.keys()}
        elif (folder / "pytorch_model.bin").is_file():
            state = torch.load(folder / "pytorch_model.bin", map_location="cpu", mmap=True, weights_only=True)
            self._open[folder / "pytorch_model.bin"] = state
            self.where = {name: folder / "pytorch_model.bin" for name in state}
        else:
            raise LitftError(f"{folder} has no model.safetensors(.index.json) or pytorch_model.bin; point the model argument at a full Hugging Face checkpoint")

    def find(self, names: Iterable[str]) -> Optional[str]:
        """The first of ``names`` (or the same without the base-model prefix) that the checkpoint holds."""
        for name in names:
            for candidate in (name, name.removeprefix("model.")):
                if candidate in self.where:
                    return candidate
        return None

    def get(self, name: str) -> torch.Tensor:
        path = self.where[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        handle = self._open[path]
        return handle[name] if isinstance(handle, dict) else handle.get_tensor(name)


def locate_checkpoint(source: str) -> Path:
    """A local folder holding ``source``'s weights; hub ids go through the hub cache (downloaded once)."""
    path = Path(source)
    if path.is_dir():
        return path
    try:
        return Path(snapshot_download(source, allow_patterns=["*.safetensors", "*.json", "*.bin"]))
    except Exception as err:  # noqa: BLE001 - hub errors come in many types; all mean the same to the user
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise LitftError(f"could not fetch the weights of '{source}' ({first}); pass a local Hugging Face model folder") from None


def per_head_tensors(model: nn.Module) -> List[str]:
    """Attention parameters with one value per head outside q/k/v (gpt-oss's sinks): splitting heads over ranks must split them too."""
    return [name for name, _ in model.named_parameters() if name.rsplit(".", 1)[-1] == "sinks"]


def skeleton(config, dtype: torch.dtype) -> nn.Module:
    """The model's structure with every parameter and buffer on the meta device."""
    with torch.device("meta"):
        return auto_model_class(config).from_config(config, dtype=dtype)


def seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


class Materializer:
    """Gives real values to the meta tensors of any part of a model, on request.

    ``weights`` is None for a random init (pretraining from scratch). LoRA
    adapters are always initialized as peft does (A Kaiming-uniform, B zero), from
    a seed derived from the adapter's name.
    """

    def __init__(self, root: nn.Module, hf_model: nn.Module, weights: Optional[CheckpointWeights], seed: int):
        self.root, self.hf_model = root, hf_model
        self.weights = weights
        self.seed = seed
        # Tensors are known by where they sit (module, kind, attribute), not by identity: a precision plugin's cast
        # (bf16-true under FSDP) replaces buffers with new tensors between this walk and the fill. A tensor may sit
        # in several places (tied input and output embeddings): one group of names and places each.
        self.group_of: Dict[Tuple[int, str, str], int] = {}
        self.names: List[List[str]] = []
        self.owners: List[list] = []
        self.module_names: Dict[int, str] = {}  # each module's name under root, for the fills that walk a part
        # The rows (dim 0) of a parameter that its place will keep, by (module, attr), during a fill that was told them
        # (FSDP's shard, an expert group's experts; and the columns of a tensor-parallel row split): only those are read,
        # converted and copied.
        self.kept_rows: Dict[Tuple[int, str], Tuple[int, ...]] = {}
        groups: Dict[int, int] = {}
        for module_name, module in root.named_modules(remove_duplicate=False):
            self.module_names[id(module)] = module_name
            for kind in ("_parameters", "_buffers"):
                for attr, tensor in getattr(module, kind).items():
                    if tensor is None:
                        continue
                    if id(tensor) not in groups:
                        groups[id(tensor)] = len(self.names)
                        self.names.append([])
                        self.owners.append([])
                    group = self.group_of[(id(module), kind, attr)] = groups[id(tensor)]
                    self.names[group].append(checkpoint_name(f"{module_name}.{attr}" if module_name else attr))
                    self.owners[group].append((module, kind, attr))

    def __call__(self, part: nn.Module, kept_rows: Optional[Dict[Tuple[int, str], Tuple[int, ...]]] = None) -> None:
        """Fill ``part``; ``kept_rows`` names, by (module id, attr), the rows of a parameter that will be kept. The other rows
        are left unread and unwritten (never resident), for a strategy that drops them right after the fill."""
        self.kept_rows = kept_rows or {}
        try:
            for module in part.modules():
                self._fill_module(self.module_names.get(id(module), ""), module)
        finally:
            self.kept_rows = {}

    @torch.no_grad()
    def _fill_module(self, module_name: str, module: nn.Module) -> None:
        pending = [
            (kind, attr, tensor)
            for kind in ("_parameters", "_buffers")
            for attr, tensor in getattr(module, kind).items()
            if tensor is not None and tensor.is_meta
        ]
        if not pending:
            return
        values = self.fill_slots(module_name, module, [(kind, attr, meta) for kind, attr, meta in pending])
        for (kind, attr, _), value in zip(pending, values):
            self.put(module, kind, attr, value)

    def put(self, module: nn.Module, kind: str, attr: str, value: torch.Tensor) -> None:
        """``value`` in this place and wherever else the model uses the same tensor (a tied tensor in each of its modules)."""
        for owner, owner_kind, owner_attr in self.owners[self.group_of[(id(module), kind, attr)]]:
            getattr(owner, owner_kind)[owner_attr] = value

    @torch.no_grad()
    def fill_slots(self, module_name: str, module: nn.Module, slots: List[tuple]) -> List[torch.Tensor]:
        """Put first values into some of ``module``'s tensors and return them, in order.

        Each slot is ``(kind, attr, template)``: the new tensor gets the template's
        shape and dtype. The model's init runs on the module holding the new
        tensors, so it needs the module itself, not only the values.
        """
        name = checkpoint_name(module_name)
        fresh = []
        for kind, attr, template in slots:
            key = self.checkpoint_key(module, kind, attr)
            rows = self.kept_rows.get((id(module), attr)) if kind == "_parameters" else None
            # safetensors hands out views of its file mapping; the parameter gets its own memory.
            value = self._read(key, template, rows) if key is not None else torch.empty(template.shape, dtype=template.dtype)
            if kind == "_parameters":
                value = nn.Parameter(value, requires_grad=template.requires_grad)
            getattr(module, kind)[attr] = value
            fresh.append((key, template, value, rows))
        if any(key is None for key, _, _, _ in fresh):
            # Computed buffers start as NaN, so that one the module's own init leaves unset can be told apart.
            derived = [value for (kind, _, _), (key, _, value, _) in zip(slots, fresh)
                       if kind == "_buffers" and key is None and value.is_floating_point() and value.numel()]
            for value in derived:
                value.fill_(math.nan)
            self.initialize(name, module, [value for key, _, value, _ in fresh if key is None])
            self.derive_from_ancestors(module_name, [value for value in derived if value.isnan().all()])
            for key, template, value, rows in fresh:
                if key is not None:  # the module's init also touched these; the checkpoint wins
                    value.data.copy_(self._read(key, template, rows))
        return [value for _, _, value, _ in fresh]

    def derive_from_ancestors(self, module_name: str, unset: List[torch.Tensor]) -> None:
        """Buffers the module's own init leaves unset (Falcon-H1's MuP vector is set by the model's init for every layer):
        the init of each enclosing module runs, nearest first, until they are set. Those inits match no class of weight."""
        parts = module_name.split(".") if module_name else []
        with torch.random.fork_rng(devices=[]):
            while unset and parts:
                parts.pop()
                torch.manual_seed(seed_for(self.seed, checkpoint_name(".".join(parts))))  # any draw it makes: a function of the name
                self.init_of(checkpoint_name(".".join(parts)))(self.root.get_submodule(".".join(parts)))
                unset = [value for value in unset if value.isnan().all()]

    def checkpoint_key(self, module: nn.Module, kind: str, attr: str) -> Optional[str]:
        """The checkpoint's name for one of ``module``'s tensors; None where the tensor is initialized instead."""
        names = self.names[self.group_of[(id(module), kind, attr)]]
        persistent = kind == "_parameters" or attr not in module._non_persistent_buffers_set
        if self.weights is None or is_lora_tensor(names[0]) or not persistent:
            return None
        key = self.weights.find(names)
        if key is None:
            raise LitftError(f"the checkpoint in {self.weights.folder} has no tensor for {names[0]}; it does not match this model's config")
        return key

    def stored(self, key: str, shape) -> torch.Tensor:
        """The checkpoint's tensor as stored (a view of the file's mapping for safetensors), its shape checked."""
        stored = self.weights.get(key)
        if stored.shape != torch.Size(shape):
            raise LitftError(f"{key} in {self.weights.folder} has shape {tuple(stored.shape)}, the model expects {tuple(shape)}")
        return stored

    def stored_rows(self, key: str, shape, first: int, last: int) -> torch.Tensor:
        """Rows ``first:last`` (dim 0) of the checkpoint's tensor: a view of the file's mapping, or, for a layout converted
        while read (litft.model.hub_layout), converted from only the stored tensors that make them."""
        rows = getattr(self.weights, "rows", None)
        if rows is None or len(shape) < 2:
            return self.stored(key, shape)[first:last]
        part = rows(key, first, last)
        if tuple(part.shape) != (last - first, *shape[1:]):
            raise LitftError(f"{key} in {self.weights.folder} has rows of shape {tuple(part.shape[1:])}, the model expects {tuple(shape[1:])}")
        return part

    def stored_range(self, key: str, shape, start: int, count: int) -> torch.Tensor:
        """Elements ``start:start + count`` of the checkpoint's tensor flattened (a ZeRO-3 partition), read from the rows that hold them."""
        if len(shape) < 2 or count <= 0:
            return self.stored(key, shape).reshape(-1).narrow(0, start, count)
        row = math.prod(shape[1:])
        first, last = start // row, -(-(start + count) // row)
        return self.stored_rows(key, shape, first, last).reshape(-1).narrow(0, start - first * row, count)

    def _read(self, key: str, meta: torch.Tensor, rows: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
        if rows is None or not meta.dim():
            return self.stored(key, meta.shape).to(meta.dtype, copy=True)
        value = torch.empty(meta.shape, dtype=meta.dtype)  # the other rows stay untouched (no memory behind them) and are dropped
        first, last, *columns = rows  # columns too for a tensor-parallel row split: (first, last, first column, last column)
        if last > first:
            part = self.stored_rows(key, meta.shape, first, last)
            if columns:
                value[first:last, columns[0]:columns[1]].copy_(part[:, columns[0]:columns[1]])
            else:
                value[first:last].copy_(part)
        return value

    def initialize(self, name: str, module: nn.Module, values: List[torch.Tensor]) -> None:
        """peft's adapter init for LoRA matrices, the model's own init for everything else."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed_for(self.seed, name))
            dotted = f".{name}."
            if ".lora_A." in dotted or ".lora_embedding_A." in dotted:
                for value in values:
                    nn.init.kaiming_uniform_(value, a=math.sqrt(5))
            elif ".lora_B." in dotted or ".lora_embedding_B." in dotted:
                for value in values:
                    nn.init.zeros_(value)
            else:
                # Also recomputes non-persistent buffers such as the rotary frequencies.
                self.init_of(name)(module)

    def init_of(self, name: str):
        """The init of the innermost transformers model that holds ``name``, as transformers applies it: a composite model's
        parts (a vision-language model's image encoder) init as their own class does, down to their computed buffers."""
        parts = name.split(".") if name else []
        for end in range(len(parts), 0, -1):
            try:
                holder = self.hf_model.get_submodule(".".join(parts[:end]))
            except AttributeError:
                continue
            if isinstance(holder, PreTrainedModel):
                return holder._init_weights
        return self.hf_model._init_weights


class AdapterInit:
    """The fill of a model loaded with real weights (a 4-bit base loaded by transformers): only its LoRA adapters get values.

    They come from (seed, name) as under every other build, computed on the CPU, so a
    QLoRA run starts from the same adapters whichever strategy and device builds it.
    A part is filled once however often it is offered (FSDP offers each unit, then the root).
    """

    def __init__(self, materializer: Materializer):
        self.materializer = materializer
        self.done: set = set()

    @torch.no_grad()
    def __call__(self, part: nn.Module) -> None:
        for module in part.modules():
            if id(module) in self.done:
                continue
            self.done.add(id(module))
            name = self.materializer.module_names.get(id(module), "")
            params = [p for a, p in module._parameters.items() if p is not None and is_lora_tensor(f"{name}.{a}")]
            if params:
                values = [torch.empty(p.shape, dtype=p.dtype) for p in params]
                self.materializer.initialize(checkpoint_name(name), module, values)
                for param, value in zip(params, values):
                    param.data.copy_(value)


def transformer_blocks(hf_model: nn.Module) -> List[nn.Module]:
    """The repeated blocks of any HF causal LM, found from its ``_no_split_modules``, in order."""
    classes = set(getattr(hf_model, "_no_split_modules", None) or [])
    blocks = [m for m in hf_model.modules() if type(m).__name__ in classes]
    if not blocks:
        raise LitftError(
            f"{type(hf_model).__name__} names no transformer block class (_no_split_modules); it cannot be sharded per block"
        )
    return blocks


def language_model_blocks(hf_model: nn.Module) -> List[nn.Module]:
    """A vision-language model's language-model blocks, in order: what ``--compile`` compiles there. The image encoder's
    blocks run eager: they take a batch's images in whatever number and size it has (Qwen-VL's patches per image,
    Idefics3's tiles), and the encoder is a small part of a step."""
    inside = {id(m) for m in hf_model.get_submodule(language_model_name(hf_model)).modules()}
    blocks = [block for block in transformer_blocks(hf_model) if id(block) in inside]
    if not blocks:
        raise LitftError(f"{type(hf_model).__name__} names no block class of its language model (_no_split_modules), so --compile "
                         "has nothing to compile; pass --compile false")
    return blocks
