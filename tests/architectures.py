"""Tiny random models of the causal LM architectures litft is checked against, built with transformers' own config classes.

Each is small enough to run in a unit test and sharp enough (initializer_range 0.2,
windows shorter than the samples) that dropping a feature of its attention or head
shows in the loss. The list is the one the conformance test runs and docs/models.md's
table is written from.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import torch

VOCAB = 326  # litft-tiny's tokenizer, so that the jobs can run these models on its tasks
WINDOW = 6  # shorter than the test's samples, so a dropped window changes the loss
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)


@dataclass(frozen=True)
class Architecture:
    """A transformers config class and the fields of its tiny model; ``features``: what its attention or head adds."""

    name: str
    config: str  # the config class's name in transformers
    fields: Dict = field(default_factory=dict)
    features: str = ""
    refused: Optional[str] = None  # a fragment of the one line litft refuses it with

    def build(self):
        import transformers

        fields = {**COMMON, **self.fields}
        return getattr(transformers, self.config)(**{k: v for k, v in fields.items() if v is not None})


ARCHITECTURES = [
    Architecture("llama", "LlamaConfig"),
    Architecture("mistral (window)", "MistralConfig", dict(sliding_window=WINDOW), "sliding window"),
    Architecture("qwen2 (window)", "Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0), "sliding window"),
    Architecture("qwen3", "Qwen3Config", dict(head_dim=8)),
    Architecture("phi3", "Phi3Config", dict(pad_token_id=0)),
    Architecture("phi", "PhiConfig", dict(num_key_value_heads=None)),
    Architecture("olmo2", "Olmo2Config"),
    Architecture("gpt2", "GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=256, hidden_size=None, intermediate_size=None,
                                            num_hidden_layers=None, num_attention_heads=None, num_key_value_heads=None,
                                            max_position_embeddings=None, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)),
    Architecture("granite", "GraniteConfig", dict(logits_scaling=4.0, residual_multiplier=0.5, embedding_multiplier=2.0,
                                                  attention_multiplier=0.3), "logit scaling"),
    Architecture("cohere", "CohereConfig", dict(logit_scale=0.5), "logit scale"),
    Architecture("smollm3", "SmolLM3Config", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    Architecture("gemma", "GemmaConfig", dict(head_dim=8)),
    Architecture("gemma2", "Gemma2Config", dict(head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=1.0, final_logit_softcapping=3.0,
                                                query_pre_attn_scalar=8), "sliding window, attention and final softcapping"),
    Architecture("gemma3", "Gemma3TextConfig", dict(head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8,
                                                    layer_types=["sliding_attention", "full_attention"]), "sliding window"),
    Architecture("cohere2", "Cohere2Config", dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]), "sliding window"),
    Architecture("gpt-oss", "GptOssConfig", dict(head_dim=8, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                                                 layer_types=["sliding_attention", "full_attention"]), "sliding window, attention sinks, MoE"),
    Architecture("mixtral", "MixtralConfig", dict(MOE), "MoE"),
    Architecture("qwen2-moe", "Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                     shared_expert_intermediate_size=32), "MoE"),
    Architecture("phimoe", "PhimoeConfig", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                                                router_jitter_noise=0.0, input_jitter_noise=0.0),
                 "MoE, sliding window (by the mask alone)"),
    Architecture("qwen3-moe", "Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8), "MoE"),
    Architecture("gpt-neox", "GPTNeoXConfig", dict(num_key_value_heads=None, use_parallel_residual=True)),
    Architecture("llama4 (chunked)", "Llama4TextConfig", dict(head_dim=8, attention_chunk_size=WINDOW, intermediate_size_mlp=64,
                                                             num_local_experts=4, interleave_moe_layer_step=2),
                 "attention within chunks (transformers' own masks, padded rows), MoE in every other layer"),
    # Layers that carry state from token to token (litft.model.recurrent): trained on padded rows, one sample per row.
    Architecture("mamba", "MambaConfig", dict(state_size=8, num_attention_heads=None, num_key_value_heads=None, intermediate_size=None, max_position_embeddings=None), "state space"),
    Architecture("mamba2", "Mamba2Config", dict(state_size=8, num_heads=4, head_dim=16, n_groups=1, chunk_size=8, num_attention_heads=None, num_key_value_heads=None, intermediate_size=None, max_position_embeddings=None), "state space (SSD)"),
    Architecture("falcon-mamba", "FalconMambaConfig", dict(state_size=8, num_attention_heads=None, num_key_value_heads=None, intermediate_size=None, max_position_embeddings=None), "state space"),
    Architecture("falcon-h1", "FalconH1Config", dict(head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1,
                                                     mamba_d_state=8, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=8),
                 "attention beside Mamba2 in each layer, MuP multipliers"),
    Architecture("bamba", "BambaConfig", dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                                              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8), "Mamba2 and attention layers"),
    Architecture("granite-4 hybrid", "GraniteMoeHybridConfig", dict(layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16,
                                                                    mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                                                                    mamba_chunk_size=8, num_local_experts=4, num_experts_per_tok=2,
                                                                    shared_intermediate_size=64), "Mamba2 and attention layers, MoE"),
    Architecture("jamba", "JambaConfig", dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                                              num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                                              mamba_dt_rank=4, use_mamba_kernels=False), "Mamba and attention layers, MoE"),
    Architecture("zamba", "ZambaConfig", dict(num_hidden_layers=3, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_expand=2,
                                              mamba_dt_rank=4, use_mamba_kernels=False, attention_head_dim=16, attention_hidden_size=64,
                                              n_mamba_heads=2), "Mamba layers and a shared attention block"),
    Architecture("zamba2", "Zamba2Config", dict(layers_block_type=["mamba", "hybrid"], mamba_d_state=8, mamba_headdim=16, n_mamba_heads=4,
                                                mamba_ngroups=1, chunk_size=8, attention_head_dim=16, use_mem_eff_path=False),
                 "Mamba2 layers and a shared attention block"),
    # The released checkpoints' pattern: Mamba2 (M), attention (*), MLP (-) and MoE (E) layers.
    Architecture("nemotron-h", "NemotronHConfig", dict(hybrid_override_pattern="M*-E", num_hidden_layers=None, ssm_state_size=8,
                                                       mamba_num_heads=4, mamba_head_dim=16, n_groups=1, chunk_size=8, head_dim=8,
                                                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                       moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1),
                 "Mamba2, attention, MLP and MoE layers"),
    Architecture("lfm2", "Lfm2Config", dict(layer_types=["conv", "full_attention"], block_ff_dim=64, conv_L_cache=3), "short convolutions"),
    Architecture("lfm2-moe", "Lfm2MoeConfig", dict(layer_types=["conv", "full_attention"], num_dense_layers=1, num_experts=4,
                                                   num_experts_per_tok=2, moe_intermediate_size=32, conv_L_cache=3),
                 "short convolutions, MoE"),
    Architecture("lfm3", "Lfm3Config", dict(layer_types=["conv", "sliding_attention"], pad_token_id=0, head_dim=8, conv_L_cache=3,
                                            sliding_window=WINDOW), "short convolutions, sliding window"),
    Architecture("qwen3-next", "Qwen3NextConfig", dict(layer_types=["linear_attention", "full_attention"], head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
                                                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
                 "gated delta rule, MoE"),
    Architecture("qwen3.5", "Qwen3_5TextConfig", dict(layer_types=["linear_attention", "full_attention"], head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4), "gated delta rule"),
    Architecture("qwen3.5-moe", "Qwen3_5MoeTextConfig", dict(layer_types=["linear_attention", "full_attention"], head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
                                                             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
                 "gated delta rule, MoE"),
    Architecture("olmo-hybrid", "OlmoHybridConfig", dict(layer_types=["linear_attention", "full_attention"], pad_token_id=0,
                                                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_linear_value_linear_conv_kernel_dim=4), "gated delta rule"),
    Architecture("kimi-linear", "KimiLinearConfig", dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                                                         pad_token_id=0, num_key_value_heads=4, num_experts=4, num_experts_per_token=2,
                                                         moe_intermediate_size=32, linear_head_dim=8, linear_num_heads=4, qk_rope_head_dim=4,
                                                         qk_nope_head_dim=4, v_head_dim=8, head_dim=8, kv_lora_rank=16, q_lora_rank=None),
                 "delta attention, MLA, MoE"),
    Architecture("minimax", "MiniMaxConfig", dict(layer_types=["linear_attention", "full_attention"], head_dim=8, num_local_experts=4,
                                                  num_experts_per_tok=2), "lightning attention, MoE"),
    Architecture("recurrent-gemma", "RecurrentGemmaConfig", dict(block_types=["recurrent", "attention"], lru_width=32, head_dim=8,
                                                                 num_key_value_heads=1), "RG-LRU"),
    Architecture("rwkv", "RwkvConfig", dict(attention_hidden_size=32, context_length=256, num_attention_heads=None, num_key_value_heads=None,
                                            max_position_embeddings=None), "RWKV time mixing"),
    Architecture("zaya", "ZayaConfig", dict(layer_types=["hybrid", "hybrid"], head_dim=8, num_experts=4, num_experts_per_tok=1,
                                            moe_intermediate_size=32, router_hidden_size=16, pad_token_id=0), "hybrid layers, MoE"),
    Architecture("xlstm", "xLSTMConfig", dict(num_heads=2, num_blocks=2, chunk_size=8, pad_token_id=0, num_attention_heads=None, num_key_value_heads=None, intermediate_size=None, max_position_embeddings=None), "mLSTM",
                 refused="not yet checked against transformers"),
]


def save_tiny(architecture: Architecture, folder: Path, seed: int = 0) -> Path:
    """The architecture's tiny model, random at its initializer range, saved as save_pretrained saves it (fp32)."""
    from transformers import AutoModelForCausalLM

    from litft.model.loading import load_tokenizer
    from litft.model.tiny import ensure_tiny_model

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(architecture.build(), dtype=torch.float32)
    model.save_pretrained(folder)
    load_tokenizer(str(ensure_tiny_model())).save_pretrained(folder)
    return folder


LENGTHS = [13, 20, 7, 16]  # longer and shorter than the windows (6)


def samples():
    generator = torch.Generator().manual_seed(1)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(0, VOCAB, (n,), generator=generator)
        out.append({"input_ids": ids, "labels": ids.clone(), "id": torch.tensor(i)})
    return out


def reference(folder, dtype=torch.float32, device="cpu"):
    """transformers' own loss (summed over target tokens) and gradients: eager attention and the per-expert loop, each sample
    alone (litft trains with grouped experts: litft.model.experts)."""
    from transformers import AutoModelForCausalLM

    eager = {"attn_implementation": "eager"}
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, experts_implementation="eager", **eager)
    except TypeError:  # a transformers without the experts interface: its experts are the loop already
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **eager)
    model = model.to(device).train()
    total = 0.0
    for sample in samples():
        ids = sample["input_ids"].to(device)
        logits = model(ids[None]).logits[0].float()
        total = total + torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum")
    total.backward()
    return total.detach().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}


def as_litft_builds_it(folder, dtype=torch.float32, device="cpu", attention=None, images=False):
    """The model as the jobs build it: meta skeleton, litft's fill block by block (as FSDP fills), litft_segments attention
    (or ``attention``: a vision-language model's is transformers' SDPA), grouped experts, the fused head where it is exact;
    ``images``: as a run on image records builds it (a Qwen3.5 folder's image-text model)."""
    from litft.model.attention import SEGMENTS
    from litft.config import TrainArgs
    from litft.objectives import next_token
    from litft.model.experts import use_grouped_experts
    from litft.model.loss import fuse_target_loss
    from litft.model.causal_lm import CausalLM
    from litft.model.loading import check_architecture, load_config, own_mask_layers
    from litft.model.hub_layout import model_layout_weights
    from litft.model.weights import Materializer, skeleton, transformer_blocks

    from litft.model.vision import reading_images

    config = reading_images(load_config(str(folder))) if images else load_config(str(folder))
    check_architecture(config)
    model = skeleton(config, dtype)
    model.set_attn_implementation(attention or ("sdpa" if own_mask_layers(config) else SEGMENTS))
    use_grouped_experts(model)
    fill = Materializer(model, model, model_layout_weights(folder, config), 0)
    for block in reversed(transformer_blocks(model)):
        fill(block)
    fill(model)
    fuse_target_loss(model)
    return CausalLM(model.to(device), TrainArgs(), next_token()).train()


def attention_path(architecture: Architecture) -> str:
    if getattr(architecture.build(), "num_attention_heads", None) is None:
        return "none (state-space layers only)"
    if "softcapping" in architecture.features or "sinks" in architecture.features:
        return "the model's own eager attention, a sample at a time"
    if "chunks" in architecture.features:
        return "transformers' SDPA with its chunked masks, a row per sample"
    if "window" in architecture.features:
        return "varlen kernel with its window (torch 2.11+) on a GPU; windowed SDPA a sample at a time otherwise"
    return "varlen kernel on a GPU (bf16); SDPA, a row per sample, otherwise"


def table() -> str:
    """docs/models.md's table of architectures: what the conformance test checks, and what each runs under CP and TP."""
    from litft.errors import LitftError
    from litft.model.loading import check_architecture, own_mask_layers
    from litft.parallel.context import check_context_parallel
    from litft.parallel.tensor import check_tensor_parallel
    from litft.model.recurrent import BOUNDARY_KERNELS, KERNEL_PACKAGES, carries_state

    def verdict(check, config) -> str:
        try:
            check(config, 2)
        except LitftError as err:
            line = str(err).split(", and ")[-1].split(";")[0].replace("|", "/")
            return "refused: " + ("state carried along the sequence" if "carry state" in line else line)
        return "yes"

    rows = ["| model (transformers config) | what it adds | attention | packed rows | --context_parallel | --tensor_parallel |",
            "|---|---|---|---|---|---|"]
    for a in ARCHITECTURES:
        config = a.build()
        try:
            check_architecture(config)
        except Exception as err:  # noqa: BLE001
            rows.append(f"| {a.name} (`{a.config}`) | {a.features} | refused: {str(err).split(': ', 1)[-1].split(';')[0]} | | | |")
            continue
        rows_are = "no: a sample per padded row (state)" if carries_state(config) else "yes"
        if own_mask_layers(config):
            rows_are = "no: a sample per padded row (transformers' masks)"
        packages = BOUNDARY_KERNELS.get(config.get_text_config().model_type)
        if packages:
            rows_are = f"with {' and '.join(KERNEL_PACKAGES[p] for p in packages)} installed; else a sample per padded row"
        rows.append(f"| {a.name} (`{a.config}`) | {a.features or '-'} | {attention_path(a)} | {rows_are} | {verdict(check_context_parallel, config)} | "
                    f"{verdict(check_tensor_parallel, config)} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
