"""Every command-line flag, declared once; each command's flat signature is assembled from them.

jsonargparse reads a function's signature and the ``Args:`` section of its
docstring to make the command's flags, their ``--help`` text and the YAML schema
of ``--config``. The jobs and ``litft estimate`` share most flags, so they are
declared here once and each command lists the ones it takes, in order, with its
own default or wording where it differs (LitGPT's flat flags, without its copies).
"""

import functools
import inspect
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, List, Literal, Optional, Union

from litft.config import Accelerator, DeepSpeedArgs, EvalArgs, FSDPArgs, Precision, Quantize, StrategyName, TrainArgs

from litft.objectives.args import ObjectiveArgs
from litft.data.base import DataModule
from litft.data.sft import PromptStyle
from litft.model.tiny import TINY_NAME


@dataclass(frozen=True)
class Flag:
    """One parameter of a command: name, type, default and its one line of help."""

    name: str
    annotation: Any
    default: Any
    help: str

    def but(self, **changes) -> "Flag":
        """The same flag with another default or help text, for one command."""
        return replace(self, **changes)


def command(flags: List[Flag]) -> Callable:
    """Give a ``**flags`` function the flat signature that ``flags`` describe, and their help under its docstring.

    Python callers get the same signature: positional and keyword arguments are
    bound to it and the defaults filled in before the function runs.
    """
    parameters = [inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=f.default, annotation=f.annotation) for f in flags]

    def decorate(function: Callable) -> Callable:
        doc = function.__doc__.strip() + "\n\n    Args:\n" + "\n".join(f"        {f.name}: {f.help}" for f in flags) + "\n"
        signature = inspect.Signature(parameters, return_annotation=inspect.signature(function).return_annotation)

        @functools.wraps(function)
        def bound(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs)
            arguments.apply_defaults()
            return function(**arguments.arguments)

        bound.__signature__ = signature
        bound.__doc__ = doc
        return bound

    return decorate


_NO_DEFAULT = inspect.Parameter.empty

MODEL = Flag("model", str, TINY_NAME, "Hugging Face hub id or local model folder (litft-tiny is built locally).")
DATA = Flag("data", Optional[DataModule], None, "Training data (default: TinyTasks, generated here).")
OUT_DIR = Flag("out_dir", Path, None, "Folder for logs, the run's config and the final model.")
PRECISION = Flag(
    "precision", Optional[Precision], None,
    "32-true, bf16-mixed, bf16-true or 16-mixed (default: bf16-mixed on GPUs that have it, else 32-true).",
)
DEVICES = Flag("devices", int, 1, "Processes (GPUs) per node.")
NUM_NODES = Flag("num_nodes", int, 1, "Nodes taking part.")
STRATEGY = Flag("strategy", StrategyName, "auto", "auto (one device, or DDP for several), ddp, fsdp (FSDP2, sharded per block) or deepspeed (ZeRO).")
FSDP = Flag("fsdp", FSDPArgs, FSDPArgs(), "Sharding options for --strategy fsdp.")
DEEPSPEED = Flag("deepspeed", DeepSpeedArgs, DeepSpeedArgs(), "ZeRO stage, offload and config file for --strategy deepspeed.")
LAUNCHER = Flag(
    "launcher", Literal["auto", "ray"], "auto",
    "auto: start --devices processes here, or join those torchrun, srun, mpirun, the deepspeed launcher or a RANK/LOCAL_RANK/WORLD_SIZE "
    "environment started; ray: one worker per device on the Ray cluster at RAY_ADDRESS, or on a local Ray started for the run.",
)
CONTEXT_PARALLEL = Flag(
    "context_parallel", int, 1,
    "Ranks of a node that split each sequence between them (DeepSpeed-Ulysses: attention heads exchanged all-to-all), for sequences "
    "too long for one rank's memory; must divide --devices and the attention heads. Ranks of a group take the same samples.",
)
TENSOR_PARALLEL = Flag(
    "tensor_parallel", int, 1,
    "Ranks of a node that split every block's attention heads and MLP between them (column/row-parallel DTensors, with --strategy fsdp "
    "sharding over the rest), for models whose weights do not fit; must divide --devices, the heads and the MLP width.",
)
EXPERT_PARALLEL = Flag(
    "expert_parallel", int, 1,
    "Ranks of a node that deal every MoE layer's experts out between them (tokens sent to their experts' ranks by all-to-all, with "
    "--strategy fsdp sharding the rest over all ranks), so a rank holds 1/N of the experts; must divide --devices and the experts.",
)
ACCELERATOR = Flag("accelerator", Accelerator, "auto", "auto, cpu or cuda.")
ATTENTION = Flag(
    "attn_implementation", Literal["auto", "litft_segments", "flash_attention_2", "sdpa", "eager"], "auto",
    "Attention kernel: auto is flash_attention_2 where flash-attn is installed, else litft_segments (samples of a row kept apart without a mask); sdpa or eager need a dense mask for packed rows.",
)
COMPILE = Flag(
    "compile", Union[bool, Literal["auto"]], "auto",
    "torch.compile each transformer block before sharding, one compiled code per kind of block: auto compiles with --fp8 on CUDA "
    "where the strategy and flags allow it; otherwise eager blocks with Liger's kernels measured faster (docs/speed.md).",
)
FP8 = Flag(
    "fp8", Optional[Literal["tensorwise", "rowwise"]], None,
    "FP8 matmuls through torchao (pip install 'litft[fp8]'), on GPUs of compute capability 8.9 or later with bf16 precision: tensorwise "
    "(fastest; FP8 all-gather under FSDP) or rowwise scaling; weights and checkpoints stay in the model's dtype; under LoRA the frozen base only.",
)
KERNELS = Flag(
    "kernels", Literal["auto", "liger", "none"], "auto",
    "Fused Triton kernels of liger-kernel for RMSNorm, RoPE and SwiGLU (pip install 'litft[kernels]'): auto uses them on a GPU where installed.",
)
QUANTIZE = Flag("quantize", Optional[Quantize], None, "Load the frozen base in 4 bits with bitsandbytes (QLoRA); -dq also quantizes the scales.")
LORA_R = Flag("lora_r", int, 8, "Rank of the adapters.")
LORA_ALPHA = Flag("lora_alpha", int, 16, "Adapter scale numerator (the update is scaled by alpha / r).")
LORA_DROPOUT = Flag("lora_dropout", float, 0.0, "Dropout on the adapters' input; 0.05 can help small data trained for many epochs.")
LORA_TARGETS = Flag(
    "lora_target_modules", Union[str, List[str]], "all-linear",
    'Module names to adapt, or "all-linear" for every linear layer but the output head.',
)
EXPORT = Flag(
    "export", Literal["adapter", "merged", "both", "none"], "adapter",
    "What the run writes at its end: the adapter as a peft folder (out_dir/final-adapter, megabytes), the merged model as a "
    "Hugging Face folder (out_dir/final, the whole model's size), both, or none (the checkpoints only; litft convert writes either later).",
)
OBJECTIVE = Flag(
    "objective", ObjectiveArgs, ObjectiveArgs(),
    "sft, dpo, ipo, simpo, orpo or grpo: the response tokens' cross-entropy (sft), a preference loss on chosen/rejected pairs (dpo, ipo "
    "against a reference; simpo, orpo reference-free; default data TinyPreferences), or RL from rewards on sampled completions (grpo; "
    "default data TinyPrompts); --objective dpo --objective.beta 0.1.",
)
TRAIN = Flag("train", TrainArgs, TrainArgs(), "Batch, schedule and run length.")
EVAL = Flag("eval", EvalArgs, EvalArgs(), "Validation cadence and scoring.")
SEED = Flag("seed", int, 42, "Seeds the weights of new layers, the data order and dropout.")
OVERWRITE = Flag(
    "overwrite", bool, False, "Replace the final model, logs and checkpoints of an earlier litft run in out_dir (nothing else there is touched)."
)
RESUME = Flag(
    "resume", Optional[str], None,
    'Continue from a checkpoint: "auto" takes the newest finished one in out_dir (or starts afresh if there is none), or a checkpoint folder\'s path.',
)

LoggerName = Literal["tensorboard", "wandb", "mlflow", "csv"]
LOGGER_NAME = Flag(
    "logger_name", Union[LoggerName, List[LoggerName]], "tensorboard",
    "Where metrics and the run's config go besides out_dir/logs/csv (always written): tensorboard, wandb, mlflow, or a list such as [tensorboard, mlflow]; csv alone adds none.",
)
PROFILE = Flag(
    "profile", bool, False,
    "Profile a few training steps after warm-up with torch.profiler: each rank writes a Chrome trace and a table of its top operators to out_dir/logs/profile/, rank 0 prints its table.",
)

# Where the processes run and how they split the model: every job and litft estimate.
PARALLEL = [PRECISION, DEVICES, NUM_NODES, STRATEGY, FSDP, DEEPSPEED, CONTEXT_PARALLEL, TENSOR_PARALLEL, EXPERT_PARALLEL, ACCELERATOR]
MODEL_OPTIONS = [ATTENTION, COMPILE, FP8, KERNELS]
LORA = [QUANTIZE, LORA_R, LORA_ALPHA, LORA_DROPOUT, LORA_TARGETS, EXPORT]
RUN_CONTROL = [SEED, OVERWRITE, RESUME]
WATCHING = [LOGGER_NAME, PROFILE]
JOB = Literal["finetune_lora", "finetune_full", "pretrain"]


def required(flag: Flag, help: str) -> Flag:
    """A flag without a default (a positional argument on the command line)."""
    return flag.but(default=_NO_DEFAULT, help=help)


# litft chat and litft generate.
TRAINED_MODEL = required(
    MODEL, "A model folder (a run's final/ or final-adapter/), a litft run or checkpoint folder (made in memory, a LoRA adapter merged), litft-tiny, or a hub id."
)
PROMPT = Flag("prompt", Optional[str], None, "The prompt to answer (required).")
GENERATION = [
    Flag("system", Optional[str], None, "A system prompt, placed where the chat template puts one."),
    Flag("max_new_tokens", int, 256, "The most tokens one answer may have."),
    Flag("temperature", float, 0.7, "Sampling temperature; 0 answers greedily (the same answer every time)."),
    Flag("top_p", float, 0.9, "Sample from the fewest tokens whose probabilities add up to top_p (1 keeps them all)."),
    Flag("prompt_style", PromptStyle, "chat", "How prompts are rendered, as in training: chat (the tokenizer's chat template), alpaca or plain."),
    Flag("image", Optional[Path], None, "A picture the conversation is about, for a vision-language model: it goes with the first prompt, through the model's processor."),
    ACCELERATOR,
    SEED.but(help="Seeds the sampling."),
]
