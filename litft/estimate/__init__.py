"""``litft estimate``: GPU and CPU memory of one rank of a training run, from the model's config alone.

A run that does not fit is found out after the model has loaded, the processes
have met and the first step has run; on a queued cluster that is hours. The
estimate builds the model the job builds (``build.build_model``, with the same
flag groups and checks) on the meta device, so trained and frozen parameters,
4-bit layers and FSDP units are counted exactly; the chosen strategy lays them
out on the fullest rank as it does in real runs (``memory_layout``); activations
come from a traced training step (``estimate.trace``).
"""

import inspect
import json as jsonlib
from typing import Literal, Optional

from litft.config import TrainArgs
from litft.estimate.plan import longest_sequence, plan_memory, render
from litft.cli.flags import (
    CONTEXT_PARALLEL, DEEPSPEED, DEVICES, FSDP, JOB, LORA_ALPHA, LORA_DROPOUT, LORA_R, LORA_TARGETS, MODEL, NUM_NODES, OBJECTIVE, PRECISION, QUANTIZE,
    EXPERT_PARALLEL, STRATEGY, TENSOR_PARALLEL, TRAIN, Flag, command, required,
)

ESTIMATE_FLAGS = [
    required(MODEL, "Hugging Face hub id, or a folder (or config.json) with the model's config; no weights are read."),
    Flag("job", JOB, "finetune_lora", "What trains: finetune_lora (adapters on a frozen base), finetune_full or pretrain (every weight)."),
    PRECISION.but(help="32-true, bf16-mixed, bf16-true or 16-mixed (default: bf16-mixed, or 16-mixed on GPUs without bf16)."),
    DEVICES,
    NUM_NODES,
    STRATEGY.but(help="auto (one device, or DDP for several), ddp, fsdp or deepspeed, as for the jobs."),
    FSDP,
    DEEPSPEED,
    CONTEXT_PARALLEL.but(help="Ranks of a node that split each sequence between them: activations per rank shrink that many times."),
    TENSOR_PARALLEL.but(help="Ranks of a node that split each block's heads and MLP (with --strategy fsdp): the blocks' weights per rank and their inner activations shrink that many times."),
    EXPERT_PARALLEL.but(help="Ranks of a node that deal each MoE layer's experts out (with --strategy fsdp): FSDP gathers only a rank's experts, and each MoE layer sends and receives its tokens by all-to-all."),
    QUANTIZE.but(help="QLoRA's 4-bit base (finetune_lora only)."),
    LORA_R,
    LORA_ALPHA.but(help="Adapter scale numerator."),
    LORA_DROPOUT.but(help="Dropout on the adapters' input (it keeps a copy of their input for backward)."),
    LORA_TARGETS.but(help='Module names to adapt, or "all-linear".'),
    TRAIN.but(default=TrainArgs(micro_batch_size=1), help="Only micro_batch_size, gradient_checkpointing, activation_offload (device activations to host memory) and tiled_mlp change memory; accumulation does not, as gradients are counted whole beside the activations, where accumulation's later micro-batches have them."),
    OBJECTIVE.but(help="sft, a preference objective (dpo, ipo, simpo, orpo: a micro-batch then holds micro_batch_size pairs, two sequences each, and DPO/IPO under LoRA add the reference's no-grad forward), or grpo (a micro-batch holds completions with their prompts; sampling holds one generate call's groups' KV cache between steps)."),
    Flag("seq_len", Optional[int], None, "Tokens in each sample of a micro-batch (the data's max_seq_length, or the packed row length; for pairs, prompt plus one response; default 2048); under grpo the longest prompt (default 512), to which --objective.max_new_tokens are added."),
    Flag("image_size", Optional[str], None, "A vision-language model's image size, WIDTHxHEIGHT or one side (448x448, 448): the "
         "model's processor counts the tokens each image becomes, and every sample holds --images of them beside its --seq_len text tokens."),
    Flag("images", int, 1, "Images per sample, with --image_size."),
    Flag("accelerator", Literal["cuda", "cpu"], "cuda", "Where the run trains: cuda (one GPU per rank, --gpu), or cpu (the ranks share this machine's memory, or --device_memory_gb)."),
    Flag("gpu", str, "H100", "The device, by name: H100, H200, A100, A100-40GB, L40S, L4, A10G, ... (memory as torch.cuda reports it)."),
    Flag("device_memory_gb", Optional[float], None, "Memory of one device in GiB; overrides --gpu."),
    Flag("headroom", float, 0.1, "Share of device memory to leave free for the allocator's fragmentation and what is not counted."),
    Flag("attention", Optional[Literal["sdpa", "eager"]], None, "Attention kernel to estimate for (default: what transformers picks for the model, as the jobs do)."),
    Flag("longest", bool, False, "Find the longest --seq_len that fits the device with these flags (a few traced estimates; "
         "--seq_len, default 2048, is where the search starts) and show the estimate at it."),
    Flag("json", bool, False, "Print the estimate as JSON instead of a table."),
]


@command(ESTIMATE_FLAGS)
def estimate(**flags) -> dict:
    """Estimate the GPU and CPU memory one rank of a training run needs, from the model's config alone."""
    plan = longest_sequence(flags) if flags.get("longest") else plan_memory(flags)
    print(jsonlib.dumps(plan, indent=2) if flags["json"] else render(plan))
    return plan


def memory_plan(**flags) -> dict:
    """The estimate as data, for code: the same keywords and defaults as ``litft estimate``'s flags."""
    bound = inspect.signature(estimate).bind(**flags)
    bound.apply_defaults()
    flags = dict(bound.arguments)
    return longest_sequence(flags) if flags.get("longest") else plan_memory(flags)


__all__ = ["estimate", "memory_plan", "plan_memory", "render"]
