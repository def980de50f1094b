"""Training FLOPs per token, and the FLOPs of a run's steps (MFU against the peaks of litft.model.peaks).

MFU (model FLOPs utilization) is the share of the accelerator's dense peak that
the model's own arithmetic uses: ``tokens/s/device * FLOPs/token / peak``. It
compares runs across models, sequence lengths and hardware, where tokens/s alone
does not.

Counting conventions, chosen so that the numbers agree with
``torch.utils.flop_counter.FlopCounterMode`` and with published MFU figures:

- Only matrix multiplications count (2 FLOPs per multiply-add). Norms, softmax,
  activations, rotary embeddings and the loss are elementwise and left out, as
  in PaLM (Chowdhery et al. 2022, appendix B) and Megatron-LM (Narayanan et al.
  2021). The embedding lookup is a gather, not a matmul.
- Attention scores (Q K^T) and the weighted sum (P V) are counted over the full
  ``seq_len x seq_len`` square even though the mask is causal: the PaLM and
  Megatron convention, and what FlopCounterMode reports for eager attention
  and for the CUDA SDPA kernels, causal or not (it does not count the CPU SDPA
  kernel at all). ``causal=True`` counts half the square instead (the
  FlashAttention benchmarks' convention), for kernels that skip the masked half.
- Grouped-query attention: k and v projections are ``hidden x kv_heads*head_dim``.
- Gated MLPs (SwiGLU/GeGLU: llama, mistral, qwen2, gemma, ...) are three
  ``hidden x intermediate`` matmuls; plain MLPs two.
- Backward of a matmul whose weight trains costs twice its forward (input
  gradient and weight gradient), so full training is 3x forward.
- LoRA freezes the base: its matmuls need only the input gradient (1x forward
  instead of 2x); attention scores still need both operand gradients (2x); the
  adapters cost about 3x their own small forward. Exactly what autograd skips is
  counted too: the first block reads the frozen embedding, so its q/k/v
  projections get no input gradient, and with adapters on only some of its
  linears part of its attention backward is skipped as well (see
  ``_lora_backward``). That matters only for shallow models (about 1/layers).
- Activation checkpointing recomputes each transformer block's forward during
  the backward. That is work the hardware does (``recompute=True`` adds it, as
  torch's non-reentrant checkpoint does it: all of the block but its last
  matmul), but not work the model needs: MFU is conventionally computed without
  it (PaLM's definition; "hardware FLOPs utilization" is the other number).
"""

from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Tuple, Union

import torch

from litft.errors import LitftError
from litft.model.peaks import peak_flops
from litft.model.recurrent import carries_state, state_layers

# Model types whose MLP is gated (three matmuls). Phi-3 fuses gate and up into one
# matmul of twice the width, which is the same count.
GATED_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo", "olmo2",
     "granite", "cohere", "cohere2", "smollm3", "glm", "helium", "exaone"}
)
PLAIN_MLP_MODEL_TYPES = frozenset(
    {"gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "falcon", "phi", "starcoder2", "bloom", "stablelm"}
)

@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a decoder-only transformer that set its matmul FLOPs."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated: bool
    router: int = 0  # a MoE router's outputs (its experts); the MLP's width is then that of the top-k experts a token runs

    def linears(self) -> Dict[str, Tuple[int, int]]:
        """(in, out) features of every linear layer of one block, by the module names llama-style models use."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes = {
            "q_proj": (self.hidden, q),
            "k_proj": (self.hidden, kv),
            "v_proj": (self.hidden, kv),
            "o_proj": (q, self.hidden),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }
        if self.gated:
            shapes["gate_proj"] = (self.hidden, self.intermediate)
        if self.router:
            shapes["router"] = (self.hidden, self.router)
        return shapes


def _get(config, name: str, default=None):
    value = config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)
    return default if value is None else value


def expert_count(config) -> int:
    """A MoE layer's experts, whichever field the config names them by (0 for a dense model)."""
    return max(_get(config, "num_local_experts", 0), _get(config, "num_experts", 0), _get(config, "n_routed_experts", 0))


def experts_per_token(config) -> Optional[int]:
    """The experts each token runs (top-k), or None where the config does not say."""
    return _get(config, "num_experts_per_tok") or _get(config, "num_experts_per_token")


def model_shape(config, gated: Optional[bool] = None) -> ModelShape:
    """Read a Hugging Face config (object or dict) into a :class:`ModelShape`.

    ``gated`` overrides the MLP kind for model types this module does not know;
    otherwise unknown types with a SiLU activation are taken as SwiGLU.
    """
    if not isinstance(config, dict) and hasattr(config, "get_text_config"):
        config = config.get_text_config()  # multimodal configs keep the language model in a sub-config
    if not isinstance(config, dict) and carries_state(config):
        raise LitftError(f"{config.model_type}'s state-carrying layers ({state_layers(config)[0]}) are not counted yet, and attention's "
                         "count for every layer would overstate them")
    try:
        hidden = int(_get(config, "hidden_size"))
        layers = int(_get(config, "num_hidden_layers"))
        heads = int(_get(config, "num_attention_heads"))
        vocab = int(_get(config, "vocab_size"))
    except TypeError:
        raise LitftError("the model config lacks hidden_size, num_hidden_layers, num_attention_heads or vocab_size") from None
    kv_heads = int(_get(config, "num_key_value_heads", heads))
    head_dim = int(_get(config, "head_dim", hidden // heads))
    intermediate = int(_get(config, "intermediate_size") or _get(config, "n_inner") or _get(config, "ffn_dim") or 4 * hidden)
    experts = expert_count(config)
    router = 0
    if experts > 1:
        # A token runs through its top-k experts (and any shared expert): the matmuls of one MLP that wide, plus the router.
        top_k = experts_per_token(config)
        if not top_k:
            raise LitftError("the MoE config names no num_experts_per_tok; its FLOPs per token are unknown and MFU will not be reported")
        expert = int(_get(config, "moe_intermediate_size") or intermediate)
        shared = int(_get(config, "shared_expert_intermediate_size", 0) or _get(config, "n_shared_experts", 0) * expert)
        intermediate, router = int(top_k) * expert + shared, int(experts)
    if gated is None:
        model_type = _get(config, "model_type", "")
        if model_type in GATED_MODEL_TYPES:
            gated = True
        elif model_type in PLAIN_MLP_MODEL_TYPES:
            gated = False
        else:
            gated = str(_get(config, "hidden_act", "")) in ("silu", "swish")
    return ModelShape(hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, gated, router)


def _lora_targets(shape: ModelShape, targets: Union[str, Iterable[str]]) -> Tuple[str, ...]:
    """The block's linear layers that carry adapters; "all-linear" is every one but the output head, as in peft."""
    linears = shape.linears()
    if isinstance(targets, str):
        targets = list(linears) if targets == "all-linear" else [targets]
    chosen = tuple(dict.fromkeys(t.rsplit(".", 1)[-1] for t in targets))
    if not chosen:
        raise LitftError("LoRA needs at least one target module")
    unknown = [t for t in chosen if t not in linears]
    if unknown:
        raise LitftError(f"cannot count FLOPs of LoRA on {unknown}; known linear layers are {sorted(linears)}")
    return chosen


def flops_per_token(
    config,
    seq_len: int,
    trained: str = "all",
    lora_r: Optional[int] = None,
    lora_targets: Union[str, Iterable[str]] = "all-linear",
    recompute: bool = False,
    causal: bool = False,
    gated: Optional[bool] = None,
) -> float:
    """FLOPs of one training step (forward + backward) per token of a ``seq_len`` sequence.

    ``trained``: "all" (full finetune or pretraining) or "lora" (frozen base, adapters of
    rank ``lora_r`` on ``lora_targets``, module names or "all-linear" as peft takes them);
    "forward" counts the forward alone (no step: a reference model's scoring).
    ``recompute=True`` gives hardware FLOPs under activation checkpointing: the blocks'
    forward that is redone, and under LoRA the first block's full backward (peft makes the
    embedding output require a gradient then). Leave it False for MFU. ``causal=True``
    counts half the attention square. See the module docstring for every convention.

    For a dense decoder this is close to ``6 * params`` (full) plus attention; the
    difference from that rule of thumb is the embedding (no matmul) and the attention.
    """
    if trained not in ("all", "lora", "forward"):
        raise LitftError(f"trained must be 'all', 'lora' or 'forward', got {trained!r}")
    if seq_len < 1:
        raise LitftError(f"seq_len must be at least 1, got {seq_len}")
    shape = model_shape(config, gated=gated)
    linears = shape.linears()
    matmul = {name: 2 * d_in * d_out for name, (d_in, d_out) in linears.items()}  # forward FLOPs per token

    span = seq_len / 2 if causal else seq_len  # keys each query is multiplied with
    attention = 2 * 2 * shape.heads * shape.head_dim * span  # Q K^T and P V
    block = sum(matmul.values()) + attention
    head = 2 * shape.hidden * shape.vocab
    forward = shape.layers * block + head
    if trained == "forward":  # a forward without gradients (a preference run's reference)
        return float(forward)

    # Checkpointed blocks run their forward again in the backward; torch's non-reentrant
    # checkpoint (what litft uses) stops once every tensor the backward saved is back, so the
    # block's last matmul (down_proj, or its adapter's B under LoRA) is not redone.
    if trained == "all":
        total = 3 * forward
        recomputed = shape.layers * (block - matmul["down_proj"])
    else:
        if lora_r is None or lora_r < 1:
            raise LitftError("trained='lora' needs lora_r >= 1")
        targets = _lora_targets(shape, lora_targets)
        adapter_forward = sum(2 * lora_r * (linears[t][0] + linears[t][1]) for t in targets)
        # With checkpointing on, peft makes the embedding output require a gradient
        # (enable_input_require_grads), so the hardware does the first block's full backward.
        backward = _lora_backward(shape, matmul, attention, targets, lora_r, embedding_grad=recompute) + head
        total = forward + shape.layers * adapter_forward + backward
        last = 2 * lora_r * linears["down_proj"][1] if "down_proj" in targets else matmul["down_proj"]
        recomputed = shape.layers * (block + adapter_forward - last)
    return float(total + (recomputed if recompute else 0))


def _lora_backward(
    shape: ModelShape, matmul: Dict[str, int], attention: float, targets: Tuple[str, ...], r: int, embedding_grad: bool = False
) -> float:
    """Backward FLOPs per token of the blocks under LoRA: what autograd computes, and no more.

    A frozen matmul needs its input gradient only where its input depends on a trainable
    tensor. The first block reads the frozen embedding, so what it skips depends on which
    of its linears carry adapters; from its output on, everything needs gradients.
    """
    linears = shape.linears()
    half = attention / 2  # Q K^T or P V, forward

    def linear(name: str, input_needs_grad: bool) -> Tuple[float, bool]:
        """Backward FLOPs of one (possibly adapted) linear, and whether its output needs a gradient."""
        d_in, d_out = linears[name]
        flops = matmul[name] if input_needs_grad else 0  # frozen weight: input gradient only
        if name in targets:
            # dA and dB (weights), B's input gradient, A's input gradient where the input needs one.
            flops += 2 * r * (d_in + 2 * d_out) + (2 * r * d_in if input_needs_grad else 0)
        return flops, input_needs_grad or name in targets

    total, needs = 0.0, embedding_grad  # a frozen embedding's output needs no gradient
    for _ in range(shape.layers):
        (fq, q), (fk, k), (fv, v) = (linear(n, needs) for n in ("q_proj", "k_proj", "v_proj"))
        scores = q or k
        # dQ and dK of the scores, dP and dV of the weighted sum: each costs one forward half.
        total += fq + fk + fv + half * (q + k + scores + v)
        fo, attn_out = linear("o_proj", scores or v)
        residual = needs or attn_out
        fu, up = linear("up_proj", residual)
        fg, gate = linear("gate_proj", residual) if shape.gated else (0, False)
        fd, mlp_out = linear("down_proj", up or gate)
        total += fo + fu + fg + fd
        needs = residual or mlp_out
    return total


class StepFlops:
    """Model FLOPs of the batches a run trains on, and the peak they are measured against.

    FLOPs per token are linear in the sequence length (the attention square), so two
    coefficients give every sample's FLOPs from its length without calling
    :func:`flops_per_token` in the loop. Counting per sample, not per padded batch,
    makes a step's FLOPs the same however the global batch is split across ranks.
    """

    def __init__(self, config, peak: Optional[float], reference_forwards: int = 0, **kind):
        self.per_token, self.per_key = self.coefficients(config, **kind)
        if reference_forwards:  # the objective's forwards without gradients (a preference run's reference), of every row
            token, key = self.coefficients(config, trained="forward")
            self.per_token, self.per_key = self.per_token + reference_forwards * token, self.per_key + reference_forwards * key
        self.peak = peak

    @staticmethod
    def coefficients(config, **kind) -> Tuple[float, float]:
        one, two = flops_per_token(config, 1, **kind), flops_per_token(config, 2, **kind)
        return one - (two - one), two - one

    def of_row(self, length: int) -> float:
        """FLOPs of one sample (or packed row) of ``length`` real tokens; padding is not the model's work."""
        return length * (self.per_token + self.per_key * length)

    @classmethod
    def for_run(cls, config, lora, precision: str, device, peak_tflops: Optional[float] = None, say=print,
                reference_forwards: int = 0) -> Optional["StepFlops"]:
        """The counter for a run's model config and LoRA flags (a ``config.LoraArgs`` or None), or None with a line saying why.

        ``reference_forwards``: forwards without gradients every micro-batch also runs (the objective's: DPO/IPO's reference
        with the adapter switched off).
        """
        kind = {"trained": "lora", "lora_r": lora.r, "lora_targets": lora.targets} if lora is not None else {}
        if precision.startswith("32") and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
            precision = "tf32"
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        peak = peak_flops(name, precision, peak_tflops)
        try:
            return cls(config, peak, reference_forwards=reference_forwards, **kind)
        except LitftError as err:
            say(f"litft: no MFU for this run: {err}")
            return None
