"""Checkpoints stored in another layout than the model's, converted while they are read, a group of tensors at a time.

Some hub checkpoints store what the model holds as one tensor in several (Mixtral's
and the Qwen MoEs' experts one tensor per expert, where the model stacks them per
layer) or under another name (GPT-NeoX's ``embed_out``). transformers converts them
while loading with the operations of its conversion mapping. litft applies the same
operations, but only when the fill asks for a tensor: the group of stored tensors
that makes it (one layer's experts, say) is read, converted and kept until the fill
moves on to another group. Nothing is written to disk. Under FSDP (its expert
groups included) and ZeRO-3 a rank asks only for the rows it keeps, and a layer's
experts are then converted from the experts those rows cover alone.
"""

import copy
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from litft.errors import LitftError
from litft.model.weights import CheckpointWeights, Materializer, skeleton


class HubLayoutWeights:
    """A checkpoint in a layout transformers converts, read under the model's own tensor names (CheckpointWeights' interface)."""

    def __init__(self, stored: CheckpointWeights, model: torch.nn.Module, transforms: list):
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        self.folder, self.stored, self.model = stored.folder, stored, model
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
        names = model.state_dict()  # the model's names (on the meta device: no memory)
        self.shapes = {name: tensor.shape for name, tensor in names.items()}
        # Each group under its first target name: its converter (None for a plain rename) and the stored keys per source pattern.
        self.groups: Dict[str, Tuple[Optional[object], Dict[str, List[str]]]] = {}
        self.where: Dict[str, str] = {}  # model name -> its group's first target
        for key in sorted(stored.where, key=dot_natural_key):  # experts in numeric order, as transformers stacks them
            renamed, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, names)
            if renamed not in names and key in names:
                renamed, pattern = key, None
            if renamed not in names:
                continue  # a tensor the model does not hold (transformers ignores it too)
            converter = by_pattern[pattern] if pattern is not None else None
            _, sources = self.groups.setdefault(renamed, (converter, {}))
            sources.setdefault(pattern or key, []).append(key)
            targets = converter.target_patterns if converter is not None else [renamed]
            for target in targets:
                self.where[renamed.replace(targets[0], target)] = renamed
        self.converted: Dict[str, torch.Tensor] = {}  # the last group converted, by model name
        self.converted_group: Optional[str] = None

    def rows(self, name: str, first: int, last: int) -> torch.Tensor:
        """Rows ``first:last`` (dim 0) of a tensor, reading only the stored tensors that make them where the group stacks one
        stored tensor per row (a layer's experts, each its own file entry): an FSDP shard or ZeRO-3 partition needs a few experts."""
        group = self.where[name]
        converter, sources = self.groups[group]
        if not stacks_rows(converter, sources, self.shapes.get(name)):
            return self.get(name)[first:last]
        return self.convert(group, converter, sources, slice(first, last))[name]

    def find(self, names: Iterable[str]) -> Optional[str]:
        return next((name for name in names if name in self.where), None)

    def get(self, name: str) -> torch.Tensor:
        group = self.where[name]
        converter, sources = self.groups[group]
        if converter is None:
            return self.stored.get(next(iter(sources.values()))[0])  # renamed only: read as stored
        if self.converted_group != group:
            self.converted, self.converted_group = {}, None  # the previous group is dropped before the next is read
            self.converted = self.convert(group, converter, sources)
            for target, value in self.converted.items():
                expected = tuple(self.shapes[target]) if target in self.shapes else tuple(value.shape)
                if tuple(value.shape) != expected:
                    count = sum(len(keys) for keys in sources.values())
                    raise LitftError(f"the checkpoint in {self.folder} holds {count} tensors for {target} ({next(iter(sources.values()))[0]}, "
                                     f"...), which make shape {tuple(value.shape)} where the model expects {expected}: one is missing, "
                                     "or it does not match this model's config")
            self.converted_group = group
        return self.converted[name]

    def convert(self, group: str, converter, sources: Dict[str, List[str]], rows: slice = slice(None)) -> Dict[str, torch.Tensor]:
        """The group's tensors, by model name, made with transformers' operations from its stored tensors (those of ``rows``)."""
        transform = copy.deepcopy(converter)
        for pattern, keys in sources.items():
            transform.collected_tensors[pattern] = [self.stored.get(key) for key in keys[rows]]
        try:
            produced = transform.convert(group, model=self.model, config=self.model.config)
        except Exception as err:  # noqa: BLE001 - an operation's error, whatever its type, means the same here
            raise LitftError(f"transformers cannot convert {group} from the layout {self.folder} stores ({err}); "
                             "the checkpoint does not match this model's config") from None
        return {target: value[0] if isinstance(value, list) else value for target, value in produced.items()}


def stacks_rows(converter, sources: Dict[str, List[str]], shape) -> bool:
    """Whether a group's tensor is its stored tensors stacked along dim 0 (then joined along a later dim): row r made of the r-th
    stored tensor of each source, so a run of rows converts from those alone."""
    if converter is None or shape is None or any(len(keys) != shape[0] for keys in sources.values()):
        return False
    kinds = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    return kinds[0] == ("MergeModulelist", 0) and all(kind == "Concatenate" and dim >= 1 for kind, dim in kinds[1:])


def model_layout_weights(folder: Path, config) -> CheckpointWeights:
    """The checkpoint in ``folder`` read tensor by tensor under the model's own names, converted as read where it stores
    another layout that transformers knows how to convert."""
    stored = CheckpointWeights(folder)
    model = skeleton(config, torch.float32)
    # Every stored tensor once, under any of its names (tied embeddings are one tensor with two), as the fill knows them.
    walk = Materializer(model, model, None, 0)
    groups = [names for names, ((module, kind, attr), *_) in zip(walk.names, walk.owners)
              if kind == "_parameters" or attr not in module._non_persistent_buffers_set]
    if all(stored.find(group) is not None for group in groups):
        return stored
    from transformers.conversion_mapping import get_model_conversion_mapping

    transforms = get_model_conversion_mapping(model)
    if not transforms:
        return stored  # not a layout transformers converts: the fill names the first missing tensor
    return HubLayoutWeights(stored, model, transforms)
