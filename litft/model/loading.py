"""Finding and loading a model: a local folder, litft-tiny or a hub id; its tokenizer and config; the weights (or a seeded
init) for runs that load them whole; and the one-line refusal of an architecture litft cannot train as transformers
computes it."""

import re
from pathlib import Path
from typing import Dict, List, Optional

import torch
from transformers import AutoConfig, AutoTokenizer

from litft.errors import LitftError
from litft.model.recurrent import STATE_LAYER_TYPES, check_recurrent
from litft.model.vision import as_text_model, auto_model_class, from_pretrained_as
from litft.model.tiny import TINY_NAMES, ensure_tiny_model
from litft.model.weights import skeleton, transformer_blocks


def resolve_model(name: str) -> str:
    """A local directory for ``litft-tiny`` (``litft-tiny-moe``) or a path; hub ids pass through unchanged.

    A string that names a filesystem location (it exists, starts with ``.``, ``/``
    or ``~``, or has more than one ``/``) must exist; anything else is a hub id.
    """
    if name in TINY_NAMES:
        return str(ensure_tiny_model(name))
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file():
            raise LitftError(f"model directory {name} has no config.json; point the model argument at a Hugging Face model folder")
        return str(path)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise LitftError(f"model path {name} does not exist; pass an existing folder or a Hugging Face hub id")
    return name


def _hub_error(name: str, err: Exception) -> LitftError:
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return LitftError(
        f"could not load '{name}' ({first_line}); pass a local Hugging Face model folder, or check the hub id and network access"
    )


def load_tokenizer(source: str):
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise _hub_error(source, err) from None
    if tokenizer.pad_token_id is None:
        # Padding never reaches the loss, so any existing token will do.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_config(source: str):
    """The folder's (or hub id's) config as litft reads it: a composite folder that trains as its text model names that
    class (litft.model.vision.as_text_model)."""
    try:
        return as_text_model(AutoConfig.from_pretrained(source))
    except (OSError, ValueError) as err:
        raise _hub_error(source, err) from None


# The attention layers litft's padding-free attention computes as transformers does.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Attention layers whose pattern only transformers' own masks make (Llama 4's attention within chunks of
# ``attention_chunk_size`` tokens): such a model trains a sample per padded row through transformers' SDPA or eager path.
OWN_MASK_LAYER_TYPES = ("chunked_attention",)


def own_mask_layers(config) -> Optional[str]:
    """The layer type that needs transformers' own masks (``chunked_attention``), or None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return next((kind for kind in OWN_MASK_LAYER_TYPES if kind in (getattr(text, "layer_types", None) or [])), None)


def check_architecture(config) -> None:
    """One line, before any process starts, for a model litft cannot train as transformers computes it.

    A layer type litft has not listed is judged by what its layers are: a layer that mixes no tokens (an MLP, experts)
    computes each token alone, whatever the rows look like, and trains; one that mixes them some other way (attention over
    selected tokens) is refused, naming its module. Attention in chunks trains on padded rows (``own_mask_layers``).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = list(getattr(text, "layer_types", None) or [])
    others = sorted(set(types) - set(ATTENTION_LAYER_TYPES) - set(OWN_MASK_LAYER_TYPES) - set(STATE_LAYER_TYPES))
    if others:
        mixers = token_mixers(config, types, others)
        for kind in others:
            if mixers.get(kind, "unknown") is not None:
                how = f" ({mixers[kind]})" if mixers.get(kind, "unknown") != "unknown" else ""
                raise LitftError(
                    f"litft cannot train {text.model_type} models yet: their {kind} layers mix tokens{how} in a way litft's padding-free "
                    "attention does not compute as transformers does (attention over selected tokens); use transformers' "
                    "Trainer for it"
                )
    check_recurrent(config)


# Modules that mix the tokens of a sequence: attention (transformers' attention modules say whether they are causal), a
# convolution along the sequence, or a recurrence.
MIXING_NAMES = re.compile(r"Attention|Mamba|Mixer|DeltaNet|Recurren|Lru|Rwkv|Conv")


def token_mixers(config, types: List[str], kinds: List[str]) -> Dict[str, Optional[str]]:
    """For each of ``kinds`` (layer types), the first module of its first layer that mixes tokens, or None where it mixes none;
    a kind whose layers cannot be told apart from the model's blocks is left out (judged unknown)."""
    try:
        blocks = transformer_blocks(skeleton(config, torch.float32))
    except Exception:  # noqa: BLE001 - a structure that cannot be built here: judged unknown
        return {}
    if len(blocks) != len(types):
        return {}
    found = {}
    for kind in kinds:
        block = blocks[types.index(kind)]
        mixing = [type(m).__name__ for m in block.modules() if hasattr(m, "is_causal") or isinstance(m, torch.nn.Conv1d)
                  or MIXING_NAMES.search(type(m).__name__)]
        found[kind] = mixing[0] if mixing else None
    return found


def load_causal_lm(source: str, *, random_init: bool, dtype: torch.dtype, quantization_config=None, device=None, config=None):
    """Weights from ``source``, or a seeded random init of its config for pretraining; ``config``: the run's, where it
    chose the class (a composite folder's image-text model: litft.model.vision.reading_images).

    bitsandbytes quantizes while loading, so a quantized model is loaded straight
    onto ``device``, the one it will train on.
    """
    config = config if config is not None else load_config(source)
    if random_init:
        return auto_model_class(config).from_config(config, dtype=dtype)
    kwargs = {"dtype": dtype}
    if quantization_config is not None:
        kwargs.update(quantization_config=quantization_config, device_map={"": device or torch.device("cpu")})
    try:
        model = from_pretrained_as(config, source, **kwargs)
    except (OSError, ValueError) as err:
        raise _hub_error(source, err) from None
    if quantization_config is not None:
        keep_4bit_training_layout(model)
    return model


def keep_4bit_training_layout(model: torch.nn.Module) -> None:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference.

    On CPUs with AVX512-BF16, bitsandbytes (0.49 and later) rewrites a Linear4bit's
    weight the first time it runs in eval mode without gradients: another memory
    layout, absmax rounded to bf16, the nested statistics dropped, and a kernel with
    no backward. Training after the first validation then computed other losses and
    lost the gradient through every frozen 4-bit layer. litft validates and trains
    the same weights, so every 4-bit layer keeps the layout it was loaded in.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


# Rotary modules whose frequencies are a complex buffer, by class.
COMPLEX_ROTARY_BUFFERS = {"Llama4VisionRotaryEmbedding": ("freqs_ci",)}


def keep_rotary_fp32(model: torch.nn.Module) -> int:
    """Recompute rotary frequencies wherever a low-precision cast reached them; the number of modules fixed.

    ``--precision bf16-true`` casts the whole module, buffers included (Lightning's
    ``HalfPrecision.convert_module``), and rotary frequencies rounded to bf16 put
    every position past a few hundred visibly off (transformers#25681, #29496).
    A complex buffer fares worse under any cast to a real dtype (DeepSpeed's too,
    at every precision, and an FSDP fill into a buffer cast on meta): Llama 4's
    image encoder keeps its frequencies as one, and would keep their real part,
    scaling where it rotates. The rotary module is built again from its config,
    which computes them in fp32 (complex where they were).
    """
    fixed = 0
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        rounded = isinstance(inv_freq, torch.Tensor) and inv_freq.dtype != torch.float32
        made_real = any(isinstance(getattr(module, name, None), torch.Tensor) and not getattr(module, name).is_complex()
                        for name in COMPLEX_ROTARY_BUFFERS.get(type(module).__name__, ()))
        if not (rounded or made_real) or not hasattr(module, "config"):
            continue
        fresh = type(module)(config=module.config)
        for name, buffer in fresh.named_buffers(recurse=False):
            if buffer.is_floating_point() or buffer.is_complex():
                now = getattr(module, name)
                setattr(module, name, buffer.to(device=now.device, dtype=buffer.dtype if buffer.is_complex() else torch.float32))
        fixed += 1
    return fixed
