"""How a ZeRO-3 run builds and fills its model so that no rank ever holds the whole of it.

Imported only when a ZeRO-3 run builds its model: DeepSpeed is an optional dependency.
"""

import bitsandbytes as bnb
import deepspeed
import torch
from deepspeed import comm
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.partition_parameters import GatheredParameters
from transformers.initialization import no_init_weights

from litft.device import release_freed_host_memory
from litft.model.vision import auto_model_class
from litft.model.weights import Materializer, transformer_blocks


class PartitionOnBuild(deepspeed.zero.Init):
    """``zero.Init`` without its broadcast of each new parameter from rank 0.

    DeepSpeed sends every freshly built parameter whole from rank 0 so that random
    init values agree across ranks. litft's filler gives every value afterwards,
    so that broadcast would move the whole model over the network at start-up only
    to be overwritten, and each receiving rank would write (so hold) every tensor
    whole for a moment. Each parameter is only cut into its partition here.
    """

    def _zero_init_param(self, param):
        self._convert_to_deepspeed_param(param)
        param.partition()


def build_partitioned(config, dtype: torch.dtype, ds_config: dict) -> torch.nn.Module:
    """The model's modules, each parameter partitioned over the ranks as soon as its module is built (values come from ``PartitionedFill``).

    Every rank builds the same modules in the same order. transformers' init is
    skipped (the filler gives every value), so tied weights are tied here.
    """
    with PartitionOnBuild(config_dict_or_path=ds_config), no_init_weights():
        model = auto_model_class(config).from_config(config, dtype=dtype)
    model.tie_weights()
    release_freed_host_memory()
    return model


class PartitionedFill:
    """Gives a model built under ``zero.Init`` its first values, one module at a time.

    A tensor the checkpoint holds goes straight into each rank's own partition:
    every rank copies its slice of the flattened tensor out of the file's memory
    mapping, so no rank holds more than its partition and no bytes cross ranks.
    The rest (a seeded init, which needs the whole module; NVMe-offloaded or
    secondary partitions) is whole on every rank only while its module is filled:
    rank 0 computes it as ``Materializer`` does under every other strategy and
    leaving ``GatheredParameters`` sends it to every rank's partition. Buffers and
    LoRA adapters (ordinary tensors until ``deepspeed.initialize``) are the same
    on every rank and filled on each.
    """

    def __init__(self, materializer: Materializer, dtype: torch.dtype):
        self.materializer, self.dtype = materializer, dtype

    @torch.no_grad()
    def __call__(self, part: torch.nn.Module) -> None:
        first = comm.get_rank() == 0
        done = set()  # a tied parameter is filled once, under its first module
        for module in part.modules():
            partitioned = {a: p for a, p in module._parameters.items() if hasattr(p, "ds_id") and id(p) not in done}
            done.update(id(p) for p in partitioned.values())
            local = [(kind, a, t) for kind in ("_parameters", "_buffers") for a, t in getattr(module, kind).items()
                     if t is not None and not hasattr(t, "ds_id")]
            keys = {a: self.materializer.checkpoint_key(module, "_parameters", a) for a in partitioned}
            # A module's init needs its parameters whole, so only a module the checkpoint fills entirely is filled in place.
            if all(keys.values()) and all(self.materializer.checkpoint_key(module, kind, a) for kind, a, _ in local):
                partitioned = {a: p for a, p in partitioned.items() if not _fill_own_partition(p, self.materializer, keys[a])}
            slots = [(kind, a, _template(t.shape, t.dtype, t.requires_grad)) for kind, a, t in local]
            if first:
                slots += [("_parameters", a, _template(p.ds_shape, self.dtype, p.requires_grad)) for a, p in partitioned.items()]
            with GatheredParameters(list(partitioned.values()), modifier_rank=0):
                if slots:
                    self.materializer.fill_slots(self.materializer.module_names.get(id(module), ""), module, slots)
                if first:
                    for attr, param in partitioned.items():
                        param.data.copy_(module._parameters[attr].data)
                        module._parameters[attr] = param
            if partitioned:
                release_freed_host_memory()


def _fill_own_partition(param, materializer: Materializer, key: str) -> bool:
    """Copy this rank's slice of the checkpoint's tensor into its ZeRO-3 partition; False where DeepSpeed keeps the partition elsewhere.

    DeepSpeed partitions a parameter by flattening it and giving rank r the
    elements from r x partition size, the last partition padded.
    """
    own = param.ds_tensor
    if getattr(param, "ds_secondary_tensor", None) is not None or getattr(own, "final_location", None) == OffloadDeviceEnum.nvme:
        return False
    start = own.ds_numel * comm.get_rank(group=param.ds_process_group)
    count = max(0, min(own.ds_numel, param.ds_numel - start))
    if count:
        own.narrow(0, 0, count).copy_(materializer.stored_range(key, param.ds_shape, start, count))
    own.narrow(0, count, own.numel() - count).zero_()
    return True


def _template(shape, dtype: torch.dtype, requires_grad: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta").requires_grad_(requires_grad)


class QuantizedPartitionedFill:
    """QLoRA under ZeRO-3: a unit at a time (each block, then the rest), filled, its 4-bit layers quantized, then cut into partitions.

    No rank holds more than its partitions and one unit's 4-bit layers in full
    precision: the other tensors the checkpoint holds (embeddings, head, norms) are
    partitioned empty and each rank copies in its own slice, as ``PartitionedFill``
    does. Every rank quantizes the same values the same way, so the ranks agree
    without sending a byte; the quantization is what transformers does while
    loading a 4-bit model, and the adapters get the seeded values of every other build.
    """

    def __init__(self, materializer: Materializer, hf_model: torch.nn.Module, ds_config: dict):
        self.materializer, self.hf_model, self.ds_config = materializer, hf_model, ds_config

    @torch.no_grad()
    def __call__(self, lm: torch.nn.Module) -> None:
        device = torch.device(get_accelerator().current_device_name())  # quantized where it runs, with its statistics
        partitioned = None  # the first ZeRO parameter: it converts the rest, as deepspeed.initialize would
        for unit in [*transformer_blocks(self.hf_model), lm]:
            layouts = {id(m): m.weight for m in unit.modules() if isinstance(m, bnb.nn.Linear4bit) and m.weight.is_meta}
            stored = self._leave_empty([
                (m, a) for m in unit.modules() if id(m) not in layouts for a, p in m._parameters.items() if p is not None and p.is_meta
            ])
            self.materializer(unit)
            for module in unit.modules():
                if id(module) in layouts:
                    value = module.weight.data
                    module.weight = bnb.nn.Params4bit(value, requires_grad=False, **layouts[id(module)].__dict__).to(device)
            fresh = [p for p in unit.parameters() if not hasattr(p, "ds_id")]
            if partitioned is None:
                PartitionOnBuild(module=unit, config_dict_or_path=self.ds_config)
                partitioned = next(p for p in unit.parameters() if hasattr(p, "ds_id"))
            elif fresh:
                partitioned.convert_to_zero_parameters(param_list=fresh)
            for param, key in stored:
                if not _fill_own_partition(param, self.materializer, key):
                    with GatheredParameters([param], modifier_rank=0):
                        if comm.get_rank() == 0:
                            param.data.copy_(self.materializer.stored(key, param.ds_shape))
            release_freed_host_memory()

    def _leave_empty(self, places: list) -> list:
        """Put an empty parameter (memory never written, so never resident) wherever a checkpoint tensor goes; ``(parameter, key)`` each.

        ``places`` are ``(module, attr)`` of meta parameters; a tied tensor is made once, for all its places.
        """
        stored, made = [], set()
        for module, attr in places:
            meta = module._parameters[attr]
            if not meta.is_meta or id(meta) in made:
                continue
            made.add(id(meta))
            key = self.materializer.checkpoint_key(module, "_parameters", attr)
            if key is None:
                continue
            param = torch.nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype), requires_grad=meta.requires_grad)
            self.materializer.put(module, "_parameters", attr, param)
            stored.append((param, key))
        return stored
