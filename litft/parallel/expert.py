"""Expert parallel: the experts of every MoE layer dealt out over N ranks, each token sent to the ranks that hold its experts.

Ranks ``g*N .. g*N+N-1`` form an expert group; rank ``i`` of a group holds experts
``i*E/N .. (i+1)*E/N - 1`` of every layer as the local shard of a DTensor (``Shard(0)``
on the mesh's ``expert`` dimension), and FSDP shards that shard again over the ranks
that hold the same experts. Everything else is data parallel as before: the ranks of a
group take different samples.

In a layer's forward each rank sorts its (token, expert) pairs by expert, which also
sorts them by the rank that holds the expert; one all-to-all of the per-expert counts
tells every rank what it will receive, a second sends the tokens' hidden states, the
rank's experts run on what arrived with one grouped matmul, and a third all-to-all
returns each output to where its token lives. The router's weights are applied there,
after the return, so their gradient stays on the token's rank. The backward of each
all-to-all is the same exchange reversed.

An expert's gradient on its rank is the sum over the tokens of the whole group, and FSDP
then averages it over the ranks that hold it, ``world / N`` of them, where every other
weight is averaged over ``world``: the experts' weights take their gradient times
``1 / N`` (``_ScaledGradient``), so the step equals one process's on the same batch.

LoRA on experts is computed here too, without a per-expert weight delta: the base's
grouped matmul plus ``scaling * (x @ A_e^T) @ B_e^T`` as two grouped matmuls of rank r.
peft's ``ParamWrapper`` modules keep the adapters (their names and layout, so the
exported adapter is peft's), but their forward no longer folds ``B @ A`` into a copy of
the whole expert stack. The adapters stay whole on every rank of an expert group (they
are small); each rank reads the rows of its own experts.
"""

from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from litft.errors import LitftError
from litft.model.experts import ADAPTERS, PROJECTIONS, DEALT, count_per_expert, expert_count, experts_modules, is_experts

BIASES = ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


def check_expert_parallel(config, size: int) -> None:
    """One line when the model's experts cannot be dealt out over ``size`` ranks."""
    if size == 1:
        return
    from litft.model.weights import skeleton

    experts = experts_modules(skeleton(config, torch.float32))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not experts:
        raise LitftError(f"--expert_parallel deals out MoE experts, and {text.model_type} has none litft can split "
                         "(transformers' experts interface); drop --expert_parallel")
    shared = sorted({name for name, _ in experts[0].named_parameters() if name not in expert_tensors(experts[0])})
    if shared:
        raise LitftError(f"--expert_parallel deals out each expert's own tensors, and {text.model_type}'s experts also hold {shared[0]}, "
                         "shared by all of them, which is not kept in step over an expert group yet; drop --expert_parallel")
    count = expert_count(experts[0])
    if count % size:
        raise LitftError(f"--expert_parallel {size} must divide the model's {count} experts per layer; choose a divisor of {count}")


def expert_tensors(module: torch.nn.Module) -> List[str]:
    """The experts module's own tensors that are dealt out by expert: its 3-D projections and their biases."""
    return [name for name in PROJECTIONS + BIASES if isinstance(getattr(module, name, None), torch.nn.Parameter)]


def deal_out_experts(module: torch.nn.Module, mesh) -> None:
    """Keep this rank's experts of ``module`` (already filled, whole) as DTensor shards on ``mesh`` (1-D, the expert group)."""
    size, place = mesh.size(), mesh.get_local_rank()
    for name in expert_tensors(module):
        whole = getattr(module, name)
        mine = whole.detach().chunk(size, dim=0)[place].clone()
        split = DTensor.from_local(mine, mesh, [Shard(0)], run_check=False)
        setattr(module, name, torch.nn.Parameter(split, requires_grad=whole.requires_grad))
    setattr(module, DEALT, (mesh.get_group(), size, place))
    take_over_forward(module)


def take_over_forward(module: torch.nn.Module) -> None:
    """Run ``module`` (an experts module) through ``experts_forward`` from now on."""
    module.forward = experts_forward.__get__(module)


def compute_expert_lora(model: torch.nn.Module) -> int:
    """Make the experts modules under peft's ParamWrapper compute their LoRA themselves (no weight delta); how many."""
    taken = 0
    for wrapper in model.modules():
        if type(wrapper).__name__ != "ParamWrapper":
            continue
        inner = wrapper.get_base_layer()
        while type(inner).__name__ == "ParamWrapper":
            inner = inner.get_base_layer()
        if not is_experts(inner):
            continue
        adapters = getattr(inner, ADAPTERS, None)
        if adapters is None:
            adapters = []
            setattr(inner, ADAPTERS, adapters)
            take_over_forward(inner)
            taken += 1
        adapters.append((wrapper.parameter_name, wrapper))
        wrapper.forward = _passes_through(wrapper)
    return taken


def _passes_through(wrapper):
    base = wrapper.base_layer

    def forward(x, *args, **kwargs):
        return base(x, *args, **kwargs)

    return forward


class _ScaledGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, factor: float):
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class _AllToAll(torch.autograd.Function):
    """Rows ``send[i]`` at a time to rank ``i`` of the group, ``receive[i]`` rows from it; the backward sends them back."""

    @staticmethod
    def forward(ctx, rows, send: List[int], receive: List[int], group):
        ctx.plan = (send, receive, group)
        return _send_rows(rows, send, receive, group)

    @staticmethod
    def backward(ctx, grad):
        send, receive, group = ctx.plan
        return _send_rows(grad, receive, send, group), None, None, None


def _send_rows(rows: torch.Tensor, send: List[int], receive: List[int], group) -> torch.Tensor:
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=receive, input_split_sizes=send, group=group)
    return out


def _local(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """This rank's experts of ``tensor``; a trained one's gradient scaled by ``factor`` (1/N under expert parallel)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return _ScaledGradient.apply(local, factor) if factor != 1.0 and local.requires_grad else local


def _inverse(order: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface (tokens, each token's top-k experts and weights), with the experts split or adapted."""
    group, size, place = getattr(self, DEALT, (None, 1, 0))
    tokens, top_k = top_k_index.shape
    total = expert_count(self)
    mine = total // size
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)  # pairs by expert, so by the rank that holds it
    rows = hidden_states[order // top_k]
    per_expert = count_per_expert(expert_ids, total)
    if size > 1:
        arriving = torch.empty_like(per_expert)  # arriving[i * mine + e]: pairs rank i sends to this rank's expert e
        dist.all_to_all_single(arriving, per_expert, group=group)
        by_source = arriving.view(size, mine)
        # The one read back to the host per layer: all_to_all_single takes its split sizes as host integers (torchtitan
        # reads them the same way); both directions come back in one copy.
        sizes = torch.cat([per_expert.view(size, mine).sum(1), by_source.sum(1)]).tolist()
        send, receive = sizes[:size], sizes[size:]
        rows = _AllToAll.apply(rows, send, receive, group)
        local_ids = torch.repeat_interleave(torch.arange(mine, device=rows.device).repeat(size), arriving, output_size=sum(receive))
        regroup = torch.argsort(local_ids, stable=True)  # arrived by source rank, each sorted by expert: now by expert
        out = _run_experts(self, rows[regroup], by_source.sum(0), place * mine, 1.0 / size)
        out = _AllToAll.apply(out[_inverse(regroup)], receive, send, group)
    else:
        out = _run_experts(self, rows, per_expert, 0, 1.0)
    weighted = out[_inverse(order)] * top_k_weights.reshape(-1, 1)  # the router's weights, on the token's own rank
    return weighted.view(tokens, top_k, hidden_states.shape[-1]).sum(dim=1).to(hidden_states.dtype)


def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor, first: int, factor: float) -> torch.Tensor:
    """This rank's experts on ``rows`` (sorted by expert, ``counts`` each): up (and gate), activation, down, without weights."""
    from transformers.integrations.moe import _grouped_linear

    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    row_experts = (torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts, output_size=rows.shape[0])
                   if self.has_bias else None)
    adapters = dict(getattr(self, ADAPTERS, []))

    def project(name: str, x: torch.Tensor) -> torch.Tensor:
        weight = _local(getattr(self, name), factor)
        bias = getattr(self, f"{name}_bias", None) if self.has_bias else None
        out = _grouped_linear(x, weight, offsets, bias=None if bias is None else _local(bias, factor)[row_experts],
                              is_transposed=self.is_transposed)
        wrapper = adapters.get(name)
        if wrapper is not None and wrapper.disable_adapters and wrapper.merged:
            wrapper.unmerge()  # as peft's forward does: adapters off means the base alone
        low = None if wrapper is None or wrapper.disable_adapters or wrapper.merged else _low_rank(wrapper, x, offsets, first, counts.numel())
        return out if low is None else out + low.to(out.dtype)

    up = project("gate_up_proj" if self.has_gate else "up_proj", rows.to(self.down_proj.dtype))
    hidden = self._apply_gate(up) if self.has_gate else self.act_fn(up)
    out = project("down_proj", hidden)
    return self.post_expert_norm(out) if getattr(self, "has_post_expert_norm", False) else out


def _low_rank(wrapper, x: torch.Tensor, offsets: torch.Tensor, first: int, count: int) -> Optional[torch.Tensor]:
    """``scaling * (x @ A_e^T) @ B_e^T`` for experts ``first .. first+count-1`` and each active adapter, as grouped matmuls.

    peft's layout: A is (experts * r, in), expert-major; B is (out, r * experts), expert-minor. torch's grouped matmul
    takes strides of 16 bytes only, so the rank is padded with zeros to a multiple of 16 bytes (adapter-sized copies).
    """
    from transformers.integrations.moe import _grouped_linear

    total, summed = wrapper.num_experts, None
    for name in [name for name in wrapper.active_adapters if name in wrapper.lora_A]:
        a, b = wrapper.lora_A[name].weight, wrapper.lora_B[name].weight
        a = a.reshape(total, -1, a.shape[-1])[first:first + count]  # (count, r, in)
        b = b.reshape(b.shape[0], -1, total).permute(2, 1, 0)[first:first + count]  # (count, r, out)
        rank, align = a.shape[1], max(1, 16 // a.element_size())
        if rank % align:
            pad = align - rank % align
            a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, 0, 0, pad))
        low = _grouped_linear(x.to(a.dtype), a, offsets)
        out = _grouped_linear(low, b.contiguous(), offsets, is_transposed=True) * wrapper.scaling[name]
        summed = out if summed is None else summed + out
    return summed


def expert_data_mesh(mesh):
    """The part of the experts' mesh that FSDP shards (or replicates) experts over: every dimension but ``expert``."""
    names = mesh.mesh_dim_names
    return mesh["replicate", "expert_shard"] if "replicate" in names else mesh["expert_shard"]


def is_expert_tensor(name: str) -> bool:
    """Whether a tensor (by its name in the model) is one of an experts module's own, dealt out by expert."""
    return ".experts." in f".{name}" and name.rsplit(".", 1)[-1] in PROJECTIONS + BIASES


def local_share(name: str, size: int) -> float:
    """The share of a tensor (by its name in the model) that a rank of an expert group holds."""
    return 1.0 / size if size > 1 and is_expert_tensor(name) else 1.0

