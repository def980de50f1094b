"""torch.compile of the transformer blocks: one compiled code for every block of a kind, chosen once per run.

Each block is compiled on its own (regional compilation) before any strategy wraps
or shards it. With dynamo inlining nn.Module calls (the default since torch 2.5)
the parameters are graph inputs, not constants, so the second block of a kind
reuses the first one's code instead of compiling its own: a Llama-3.2-1B compiles
one graph for its 16 blocks. Lengths that change from step to step cost one more
graph, after which they are symbolic. Anything a block reads that changes per
call (a counter, a per-layer index) would fail the guard on every call and
recompile until dynamo's limit, which is what the attention record's counter did
before it became a set.

``auto`` compiles only for FP8, whose casts inductor fuses into the matmuls'
neighbours. Otherwise litft's blocks, with Liger's kernels, ran faster eager on
every GPU record (one H200, Llama-3.2-1B shape, full bf16-true, 4 x 2048 tokens):
59,168 tok/s eager against 57,150 compiled and 53,361 compiled without Liger
(10a465b), 59,340 against 57,251 (cc1229b), 49,993 against 48,505 (d32da7f).
Plain HF blocks in a bare loop did gain (50,388 eager, 63,815 compiled), so
litft's compiled path is slower than it should be; until a profile says why,
``--compile true`` is the user's choice. On two CPU cores the tiny models gain
nothing measurable.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from litft.errors import LitftError

CHOICES = ("auto", "true", "false")


@dataclass(frozen=True)
class CompileChoice:
    """Whether the blocks are compiled, and the reason, for the first screen."""

    enabled: bool
    reason: str

    def line(self) -> str:
        return f"compile: {'on' if self.enabled else 'off'} ({self.reason})"


def requested_mode(value) -> str:
    """``--compile`` as one of auto/true/false: YAML and Python callers may give a bool."""
    if isinstance(value, bool):
        return "true" if value else "false"
    mode = str(value).lower()
    if mode not in CHOICES:
        raise LitftError(f"--compile {value} is unknown; choose auto, true or false")
    return mode


def choose(requested, accelerator: str, blocked_by: Optional[str], fp8: Optional[str] = None) -> CompileChoice:
    """What ``--compile`` means for this run (``blocked_by``: what keeps compile from working here, from the run plan's
    table, which refuses an explicit ``true`` with it in one line; ``auto`` falls back)."""
    mode = requested_mode(requested)
    if mode == "false":
        return CompileChoice(False, "--compile false")
    if blocked_by is not None:
        return CompileChoice(False, f"auto: not with {blocked_by.split(' (')[0]}")
    if mode == "true":
        return CompileChoice(True, "--compile true: one compiled code per kind of block")
    if accelerator != "cuda":
        return CompileChoice(False, "auto: on the CPU compiling costs more than it saves")
    if fp8 is not None:
        return CompileChoice(True, f"auto with --fp8 {fp8}: inductor fuses the FP8 casts; one compiled code per kind of block")
    return CompileChoice(False, "auto: eager blocks with fused kernels measured faster than compiled ones on CUDA (docs/speed.md)")


def compile_blocks(blocks) -> int:
    """Compile each block in place, lazily at its first call; the number of kinds (distinct classes) compiled."""
    kinds = set()
    for block in blocks:
        block.compile()
        kinds.add(type(block))
    return len(kinds)


def eager_blocks():
    """A context in which compiled blocks run as plain Python and nothing new is compiled.

    Generation (evaluation's greedy answers, GRPO's rollouts) calls each block with a
    batch of another size, one token at a time, and a KV cache whose per-layer state
    dynamo guards on: compiled, it added a variant per layer until dynamo's recompile
    limit (8), which training's own variants share. ``torch.compiler.set_stance``
    where torch has it (2.6 on), dynamo's disable switch, read on every call, before.
    """
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is not None:
        return set_stance("force_eager")
    return torch._dynamo.config.patch(disable=True)


class CompileStats:
    """torch.compile's time and frames so far in this process, read on log steps (both are host counters: no device sync)."""

    def __init__(self, kinds: int):
        self.kinds = kinds

    def read(self) -> dict:
        from torch._dynamo.utils import calculate_time_spent, counters

        # Frames compiled, first compiles and recompiles alike (a graph break's continuation counts as one too).
        frames = int(counters["frames"].get("total", 0))
        return {"compile_s": calculate_time_spent().get("total_wall_time", 0.0), "compiled_frames": frames,
                "recompiles": max(frames - self.kinds, 0)}
