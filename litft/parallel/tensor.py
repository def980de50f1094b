"""Tensor parallel: each block's attention and MLP split over N ranks of a node, as DTensors (Megatron's column and row split).

q/k/v and the MLP's gate/up projections are split by output feature (column), so each
rank computes whole heads and a slice of the MLP's width; o_proj and down_proj are split
by input feature (row) and end in an all-reduce, so a block's output is whole on every
rank again. Norms, rotary, embeddings and the head stay whole (FSDP shards them over the
data-parallel ranks as before); the head's loss is computed on every rank of the group.

LoRA follows its base layer: for a column-split layer the adapter's B is split the same
way and A stays whole; for a row-split one A is split by input feature (its small
output all-reduced) and B stays whole. The sum of base and adapter then has the base's
layout, and peft's forward runs unchanged.

Which layers split, and how, comes from the model's own ``base_model_tp_plan`` (transformers'
config) where it names block layers: fused projections whose output is reshaped or
normalized across heads (Phi-3's qkv_proj, OLMo 2's q/k norms) are gathered after the
split and re-split before the row layer, and norms applied per head inside split
attention (Qwen3, Gemma 3) have their gradient summed over the group. Experts stay whole
on every rank (their split is expert parallelism). Without a plan, Llama's layer names
decide, and a model with neither is refused.

The ranks of a group take the same samples and compute the same loss, so FSDP averages
gradients over the data-parallel ranks only; the loop's scale (``world / targets``, with
every rank counting its targets) comes out as ``data ranks / targets`` by itself.
"""

import copy
import fnmatch
import inspect
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from litft.errors import LitftError
from litft.model.experts import routers_outside_the_interface
from litft.model.recurrent import refuse_split

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output feature
ROW = ("o_proj", "down_proj")  # split by input feature, then all-reduced
SPLIT_ADAPTER = {"column": "lora_B", "row": "lora_A"}  # the LoRA matrix split with its layer; the other stays whole
# transformers' plan styles, as litft splits them. "gathered": the column split's output is gathered whole after the matmul;
# "from whole": the row split slices a whole input itself. "summed": kept whole, its gradient summed over the group.
PLAN_KINDS = {
    "colwise": "column", "rowwise": "row", "colwise_gather_output": "column gathered", "colwise_rep": "column gathered",
    "rowwise_split_input": "row from whole", "rowwise_rep": "row from whole", "replicated_with_grad_allreduce": "summed",
}
SUMMED = "_litft_grad_summed_over_tensor_parallel"  # set on modules whose parameters' gradients are partial on each rank


def check_tensor_parallel(config, size: int, quantize: Optional[str] = None) -> None:
    """One line when the model cannot be split over ``size`` ranks: whole heads and an even MLP on every rank, no 4-bit base."""
    if size == 1:
        return
    if quantize is not None:
        raise LitftError("--quantize with --tensor_parallel is not supported: 4-bit weights cannot be split as DTensors; drop one of them")
    refuse_split(config, "--tensor_parallel")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    counts = {
        "attention heads": getattr(text, "num_attention_heads", None),
        "key/value heads": getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None),
        "MLP width (intermediate_size)": getattr(text, "intermediate_size", None),
    }
    for what, count in counts.items():
        if count is None:
            raise LitftError(f"--tensor_parallel needs a model with {what} in its config ({type(text).__name__} has none); drop --tensor_parallel")
        if count % size:
            raise LitftError(f"--tensor_parallel {size} must divide the model's {count} {what}; choose a divisor of {count}")
    from litft.model.weights import per_head_tensors, skeleton, transformer_blocks

    model = skeleton(config, torch.float32)
    routers = routers_outside_the_interface(model)
    if routers:
        raise LitftError(f"--tensor_parallel does not split {text.model_type}'s experts, which run outside transformers' experts "
                         f"interface ({type(routers[0][1]).__name__}); drop --tensor_parallel")
    block = transformer_blocks(model)[0]
    planned = block_plan(config)
    if planned is not None:
        unknown = sorted({style for style in planned.values() if style not in PLAN_KINDS})
        if unknown:
            raise LitftError(f"--tensor_parallel does not know the style {unknown[0]!r} of {text.model_type}'s tensor-parallel plan; "
                             "drop --tensor_parallel")
    kinds = split_layers(block, planned)
    if not any(kind != "summed" for kind in kinds.values()):
        raise LitftError(f"--tensor_parallel needs a tensor-parallel plan in the model's config or Llama-style layer names "
                         f"({', '.join(COLUMN + ROW)}), and {text.model_type} has neither; drop --tensor_parallel")
    unsplit = unmatched_splits(block) if planned is None else None
    if unsplit:
        raise LitftError(
            f"--tensor_parallel splits Llama-style q/k/v/o_proj and gate/up/down_proj in pairs, and {text.model_type} has {unsplit} "
            "(fused or otherwise named projections) and no tensor-parallel plan; drop --tensor_parallel"
        )
    partial = unsummed_after_split(block, kinds)
    if partial:
        raise LitftError(f"--tensor_parallel splits {text.model_type}'s heads, and {partial} works on them whole-weighted with "
                         "no plan for its gradient; drop --tensor_parallel")
    per_head = per_head_tensors(model)
    if per_head:
        raise LitftError(f"--tensor_parallel splits attention heads, and {text.model_type}'s per-head {per_head[0]} "
                         "is not split with them yet; drop --tensor_parallel")


# Layers split together: a row-split layer reads what its column-split partners wrote, one slice per rank.
PARTNERS = {"o_proj": ("q_proj", "k_proj", "v_proj"), "down_proj": ("up_proj",)}


def unmatched_splits(block: torch.nn.Module) -> Optional[str]:
    """The first split layer whose partner is missing from its module: a row split would read a whole input as its slice."""
    found = split_layers(block)
    parents: Dict[str, set] = {}
    for name in found:
        parent, _, leaf = name.rpartition(".")
        parents.setdefault(parent, set()).add(leaf)
    for parent, leaves in parents.items():
        for row, columns in PARTNERS.items():
            if (row in leaves) != all(c in leaves for c in columns) or ("gate_proj" in leaves and row == "down_proj" and row not in leaves):
                missing = row if row not in leaves else next(c for c in columns if c not in leaves)
                return f"{parent}.{sorted(leaves)[0]} but no {missing}"
    return None


def one_rank_of(config, size: int):
    """The config of what one rank of a tensor-parallel group computes in a block (heads and MLP width / size), for tracing."""
    if size == 1:
        return config
    config = copy.deepcopy(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    text.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    text.num_key_value_heads = (getattr(text, "num_key_value_heads", None) or text.num_attention_heads) // size
    text.num_attention_heads //= size
    text.intermediate_size //= size
    return config


def block_plan(config) -> Optional[Dict[str, str]]:
    """The model's tensor-parallel plan for the layers inside a block (name pattern in the block -> transformers' style),
    or None where it has none that splits a block layer. Experts are left out: they stay whole on every rank."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan_of = getattr(text, "base_model_tp_plan", None) or {}
    inside = {key.split(".*.", 1)[1]: style for key, style in plan_of.items()
              if key.startswith("layers.*.") and "experts" not in key.split(".")}
    return inside if any(PLAN_KINDS.get(style, "split") != "summed" for style in inside.values()) else None


def split_layers(block: torch.nn.Module, planned: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """What tensor parallel does to the block's modules, by their name in the block: ``"column"``, ``"row"``, their
    ``gathered``/``from whole`` forms, or ``"summed"``; from the model's plan, else from Llama's layer names."""
    found = {}
    for name, _ in block.named_modules():
        if planned is not None:
            style = next((style for pattern, style in planned.items() if fnmatch.fnmatchcase(name, pattern)), None)
            if style is not None:
                found[name] = PLAN_KINDS.get(style, style)
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in COLUMN:
            found[name] = "column"
        elif leaf in ROW:
            found[name] = "row"
    return found


def unsummed_after_split(block: torch.nn.Module, kinds: Dict[str, str]) -> Optional[str]:
    """The first module with weights that sits beside a column split (so it sees one rank's heads) and is neither split
    nor summed: its gradient would be one rank's part."""
    parents = {name.rpartition(".")[0] for name, kind in kinds.items() if kind == "column"}
    for parent in sorted(parents):
        for child, module in block.get_submodule(parent).named_children() if parent else block.named_children():
            name = f"{parent}.{child}" if parent else child
            if name not in kinds and any(True for _ in module.parameters()):
                return name
    return None


def style_of(kind: str):
    """torch's parallel style for one of litft's split kinds."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "column": lambda: ColwiseParallel(),
        "row": lambda: RowwiseParallel(),
        "column gathered": lambda: ColwiseParallel(output_layouts=Replicate()),
        "row from whole": lambda: RowwiseParallel(input_layouts=Replicate()),
    }[kind]()


def plan(block: torch.nn.Module, kinds: Dict[str, str]) -> dict:
    """torch's parallelize_module plan for one block, LoRA adapters placed with their base layer."""
    styles = {}
    for name, kind in kinds.items():
        if kind == "summed":
            continue
        layer = block.get_submodule(name)
        base = getattr(layer, "base_layer", None)
        if base is None:
            styles[name] = style_of(kind)
            continue
        # peft's lora.Linear: the base and one adapter matrix split the same way, the other adapter matrix whole.
        styles[f"{name}.base_layer"] = style_of(kind)
        for adapter in layer.lora_A:
            styles[f"{name}.{SPLIT_ADAPTER[kind.split()[0]]}.{adapter}"] = style_of(kind)
    return styles


def splits_local_data() -> bool:
    """Whether torch's ``parallelize_module`` can split each rank's own copy of a tensor instead of scattering rank 0's
    (its ``src_data_rank``, read from its signature): then a rank needs only its slice filled."""
    from torch.distributed.tensor.parallel import parallelize_module

    return "src_data_rank" in inspect.signature(parallelize_module).parameters


def split_parts(block: torch.nn.Module, config) -> Dict[Tuple[int, str], Tuple[str, int]]:
    """The block's tensors that tensor parallel splits, by (module id, attr): the split dimension's kind ("column": dim 0,
    "row": dim 1) and the dimension, for the fill to read only a rank's slice. Biases of row splits stay whole."""
    parts = {}
    for name, kind in split_layers(block, block_plan(config)).items():
        if kind == "summed":
            continue
        layer = block.get_submodule(name)
        base = getattr(layer, "base_layer", layer)
        if not isinstance(base, torch.nn.Linear):  # torch's styles split other modules (embeddings) on other dimensions
            continue
        column = kind.split()[0] == "column"
        for attr, param in base._parameters.items():
            if param is not None and (column or attr == "weight"):
                parts[(id(base), attr)] = ("column", 0) if column else ("row", 1)
    return parts


def parallelize_block(block: torch.nn.Module, mesh, config, local: bool = False) -> None:
    """Split one filled transformer block over the 1-D tensor-parallel ``mesh``, as the model's plan (or Llama's names) says.
    ``local``: each rank's own tensors hold its slice (filled by :func:`split_parts`), so no rank sends its copy."""
    from torch.distributed.tensor.parallel import parallelize_module

    kinds = split_layers(block, block_plan(config))
    styles = plan(block, kinds)
    if not styles:
        raise LitftError(f"--tensor_parallel found nothing to split in {type(block).__name__}; drop --tensor_parallel")
    for name, kind in kinds.items():
        if kind == "summed":
            setattr(block.get_submodule(name), SUMMED, True)
    parallelize_module(block, mesh, styles, **({"src_data_rank": None} if local else {}))


def sum_partial_gradients(module: torch.nn.Module, group) -> None:
    """Sum over the tensor-parallel group the gradients each rank holds only its heads' part of (per-head norms).

    FSDP has already reduced them over the data-parallel ranks; the sum is linear, so
    adding the local shards (laid out alike on every rank of the group) gives the
    gradient of the whole model.
    """
    for sub in module.modules():
        if getattr(sub, SUMMED, False):
            for param in sub.parameters():
                if param.grad is not None:
                    grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                    dist.all_reduce(grad, group=group)


def split_over_tensor_parallel(name: str, planned: Optional[Dict[str, str]] = None) -> bool:
    """Whether a parameter (by its full name) is split over the tensor-parallel ranks, for ``litft estimate``: as the
    model's block plan says (``block_plan``), else as Llama's layer names do, the way training splits it."""
    parts = name.split(".")
    kind, rest = None, []
    if planned is not None:
        at = next((i for i in range(len(parts) - 1) if parts[i] in ("layers", "h", "blocks") and parts[i + 1].isdigit()), None)
        inner = [] if at is None else parts[at + 2 :]
        for cut in range(len(inner), 0, -1):  # the longest module path the plan names
            module = ".".join(p for p in inner[:cut] if p != "base_layer")
            style = next((style for pattern, style in planned.items() if fnmatch.fnmatchcase(module, pattern)), None)
            if style is not None:
                kind, rest = PLAN_KINDS.get(style, style).split()[0], [p for p in inner[cut:] if p != "base_layer"]
                break
    else:
        for i, part in enumerate(parts):
            if part in COLUMN or part in ROW:
                kind, rest = "column" if part in COLUMN else "row", [p for p in parts[i + 1 :] if p != "base_layer"]
                break
    if kind not in ("column", "row"):
        return False
    if rest[:1] in (["lora_A"], ["lora_B"]):
        return rest[0] == SPLIT_ADAPTER[kind]
    return kind == "column" or rest[-1:] != ["bias"]  # a row split's bias is added whole, after the all-reduce


def splitting(placement) -> bool:
    """Whether a DTensor placement splits the tensor over its mesh dimension.

    Not ``isinstance(Shard)``: FSDP's shard of a tensor-parallel shard is a ``_StridedShard``, a
    subclass of Shard on older torch and not on newer (2.13's ``is_shard()`` says False).
    """
    return not (placement.is_replicate() or placement.is_partial())


def copies_of(tensor: torch.Tensor, world_size: int) -> int:
    """How many ranks hold the same piece of ``tensor``: those its DTensor mesh does not split it over."""
    if not isinstance(tensor, DTensor):
        return world_size
    split = 1
    for size, placement in zip(tensor.device_mesh.shape, tensor.placements):
        split *= size if splitting(placement) else 1
    return world_size // split


def clip_by_global_norm(params: List[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip by the global 2-norm of the gradients; the norm before clipping.

    torch's clip_grad_norm_ stacks the norms of DTensors, which fails when they live on
    different meshes (split layers on data x tensor, norms and embeddings on data only).
    Here each rank sums the squares of its local pieces, each weighed by one over the
    number of ranks that hold the same piece, and one all-reduce gives the global sum.
    """
    world = dist.get_world_size()
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        total += torch.linalg.vector_norm(local, dtype=torch.float32).square() / copies_of(grad, world)
    dist.all_reduce(total)
    norm = total.sqrt()
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grad in grads:
        (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(factor.to(grad.dtype))
    return norm
