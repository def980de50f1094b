"""Models whose layers carry a state from token to token (Mamba, Mamba2, gated delta rules, short convolutions, RG-LRU).

Such a layer reads the whole row before a token, not only the tokens its attention
mask allows: in a padding-free row the second sample would start from the state the
first one left. litft trains these models on right-padded rows, one sample per row,
so every sample starts from the layer's initial state and its padding comes after
it, where nothing that carries loss reads it. The packed rows of attention-only
models stay as they are. Which model types take this path was checked against
transformers' own forward (tests/architectures.py); others that carry state are
refused in one line.

Where the model's CUDA kernels keep the samples of a row apart themselves
(:data:`BOUNDARY_KERNELS`: mamba-ssm's scans and causal-conv1d restart at each
change of ``seq_idx``, fla's gated delta rule at each start in ``cu_seqlens``),
rows are packed as for attention-only models and those boundaries are passed on.
That needs a transformers that hands them to the kernels (5.24 on; its PyTorch
path refuses them) and every kernel package installed and running on the run's
device. The CPU tests put stand-ins of the three packages in their place
(tests/state_kernel_standins).
"""

import functools
import importlib
import importlib.util
import inspect
from typing import List, Optional, Tuple

from litft.errors import LitftError

# Config fields of layers that carry a state from token to token.
STATE_FIELDS = ("mamba_", "ssm_", "linear_num_", "linear_key_head", "conv_L_cache", "layers_block_type", "lru_width", "block_types")
# Layer types (``layer_types`` in a config) that carry a state; hybrid layers hold attention and a state-space layer side by side.
STATE_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "mamba", "recurrent")
# Recurrent models whose configs name no layer types and no field of the kinds above.
STATE_MODEL_TYPES = ("mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "xlstm", "minimax")
# Model types (their text config's) whose loss and gradients on padded rows equal transformers' eager forward of one sample at
# a time, to 1e-5 and 1e-4 (tests/unit/test_architectures.py).
CHECKED = ("mamba", "mamba2", "falcon_mamba", "falcon_h1", "bamba", "granitemoehybrid", "jamba", "zamba", "zamba2", "nemotron_h",
           "lfm2", "lfm2_moe", "lfm3", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear", "minimax",
           "recurrent_gemma", "rwkv", "zaya")
# The packages whose CUDA kernels transformers uses for these layers when they are installed (the PyTorch reference otherwise).
KERNEL_PACKAGES = {"mamba_ssm": "mamba-ssm", "causal_conv1d": "causal-conv1d", "fla": "flash-linear-attention"}
# Model types whose every state layer takes per-sample boundaries in its kernels, and the packages those kernels come from:
# Mamba2 mixers (conv1d and the chunked scan, fused or not: seq_idx) and gated delta rules (the conv's seq_idx, the rule's
# cu_seqlens from cu_seq_lens_q). Each is checked against transformers' forward of one sample at a time
# (tests/unit/test_state_kernels.py). Mamba1's kernels, short convolutions and the other recurrences take none, and
# Mamba2ForCausalLM does not hand its keyword arguments to its backbone (transformers 5.24), so no seq_idx reaches them.
MAMBA2 = ("mamba_ssm", "causal_conv1d")
DELTA_RULE = ("fla", "causal_conv1d")
BOUNDARY_KERNELS = {
    **dict.fromkeys(("falcon_h1", "bamba", "granitemoehybrid", "zamba2", "nemotron_h"), MAMBA2),
    **dict.fromkeys(("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid"), DELTA_RULE),
}


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def state_layers(config) -> List[str]:
    """What in the config says a layer carries state (a layer type, a field, or the model type); empty for attention-only models."""
    text = text_config(config)
    found = sorted({t for t in (getattr(text, "layer_types", None) or []) if t in STATE_LAYER_TYPES})
    found += sorted(key for key in text.to_dict() if key.startswith(STATE_FIELDS))
    if text.model_type in STATE_MODEL_TYPES and not found:
        found = [text.model_type]
    return found


def carries_state(config) -> bool:
    return bool(state_layers(config))


def check_recurrent(config) -> None:
    """One line for a model with state-carrying layers that litft has not checked against transformers."""
    text = text_config(config)
    layers = state_layers(config)
    if layers and text.model_type not in CHECKED:
        raise LitftError(
            f"litft cannot train {text.model_type} models yet: their layers carry state from token to token ({layers[0]}) and litft's "
            "padded rows for them are not yet checked against transformers for this model type; use transformers' Trainer for it"
        )


def refuse_split(config, flag: str) -> None:
    """Context and tensor parallel cut what a state-carrying layer reads whole (the row, the state's heads): one line."""
    layers = state_layers(config)
    if layers:
        raise LitftError(
            f"{flag} cannot split {text_config(config).model_type}'s layers that carry state along the whole sequence "
            f"({layers[0]}); drop {flag} (FSDP and DeepSpeed shard these models)"
        )


def installed_kernels() -> List[str]:
    return [dist for module, dist in KERNEL_PACKAGES.items() if importlib.util.find_spec(module) is not None]


@functools.lru_cache(maxsize=None)
def transformers_passes_boundaries() -> bool:
    """Whether this transformers hands seq_idx and cu_seqlens to installed state kernels, probed once: its kernel dispatch
    (5.24 on) refuses per-sample boundaries on its PyTorch path, which a function of a package that is not installed takes."""
    try:
        from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

        wrapped = use_kernel_func_from_hub_with_fallback("litft_probe", "litft_no_such_package")(lambda x, seq_idx=None: x)
        wrapped(0, seq_idx=0)
    except ValueError:
        return True  # the PyTorch path refused the boundaries: the kernels' paths are handed them
    except Exception:  # noqa: BLE001 - no such dispatch, or one that takes other arguments: boundaries never reach a kernel
        return False
    return False


# Where transformers finds each kernel in its package, and the keyword that carries the boundaries: transformers hands a
# kernel only the keywords its signature names, so a release without that keyword would drop them without a word.
BOUNDARY_FUNCTIONS = {
    "mamba_ssm": ("ops.triton.ssd_combined", ("mamba_split_conv1d_scan_combined", "mamba_chunk_scan_combined"), "seq_idx"),
    "causal_conv1d": ("", ("causal_conv1d_fn",), "seq_idx"),
    "fla": ("ops.gated_delta_rule", ("chunk_gated_delta_rule",), "cu_seqlens"),
}


def kernel_device(package: str) -> Optional[str]:
    """Where an installed kernel package runs ("cuda" for the real ones; a stand-in names its own), or None where it is
    absent, fails to import, or one of its kernels does not take per-sample boundaries."""
    if importlib.util.find_spec(package) is None:
        return None
    where, functions, keyword = BOUNDARY_FUNCTIONS[package]
    try:  # a build for another CUDA or torch fails here, as it would in transformers' own import
        root = importlib.import_module(package)
        module = importlib.import_module(f"{package}.{where}") if where else root
        if not all(keyword in inspect.signature(getattr(module, name)).parameters for name in functions):
            return None
    except Exception:
        return None
    return getattr(root, "litft_device_type", "cuda")


def boundary_kernels(config, device_type: str, packed_attention: bool = True) -> Tuple[str, ...]:
    """The kernel packages that keep packed samples apart in this model's state layers on ``device_type``; empty where
    they are not all there, or where the run's attention does not keep packed samples apart itself (``packed_attention``
    False: sdpa, eager): rows are then a sample each."""
    packages = BOUNDARY_KERNELS.get(text_config(config).model_type, ())
    if not packages or not transformers_passes_boundaries() or not packed_attention:
        return ()
    return packages if all(kernel_device(package) == device_type for package in packages) else ()


def describe(config, packed_by: Tuple[str, ...] = ()) -> str:
    """The first screen's line for a state-carrying model: how its rows are laid out, and which kernels run its layers."""
    model_type, layer = text_config(config).model_type, state_layers(config)[0]
    if packed_by:
        names = ", ".join(KERNEL_PACKAGES[p] for p in packed_by)
        return f"rows: packed; {model_type}'s layers that carry state ({layer}) restart at each sample through {names} (seq_idx, cu_seqlens)"
    kernels = installed_kernels()
    found = (f"{', '.join(kernels)} installed (transformers runs them on a GPU)" if kernels
             else "PyTorch reference path (mamba-ssm, causal-conv1d, flash-linear-attention not installed)")
    why = ""
    if model_type in BOUNDARY_KERNELS:
        needed = ", ".join(KERNEL_PACKAGES[p] for p in BOUNDARY_KERNELS[model_type])
        why = f"; packed rows need {needed} on a GPU" + ("" if transformers_passes_boundaries() else " and transformers >= 5.24")
    return (f"rows: one sample per right-padded row, since {model_type}'s layers carry state from token to token "
            f"({layer}){why}; recurrent kernels: {found}")
