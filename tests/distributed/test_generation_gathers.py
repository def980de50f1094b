"""Sharded generation gathers the weights once per generate call, not once per decode step: every all-gather a rank makes
while it generates (each cycle's rollouts, held around their generate calls) is counted (at torch.distributed, where FSDP2's and DeepSpeed's collectives
land), on 2 ranks under FSDP (full fine-tuning, one gather per FSDP unit) and ZeRO-3 (LoRA, the whole model in one
gather), against the decode steps the call made; the rollouts are then those of one process (tests/distributed/test_rl.py
checks that for the same flags)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

COUNT_GATHERS = """
import json, os, sys
import torch.distributed as dist
counted = [0]
for name in ("all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_single", "all_gather_coalesced"):
    real = getattr(dist, name, None)
    if real is not None:
        def counting(*args, _real=real, **kwargs):
            counted[0] += 1
            return _real(*args, **kwargs)
        setattr(dist, name, counting)
import litft.parallel.strategies.deepspeed as deepspeed_strategy  # on gloo ZeRO-3 gathers by broadcasts: one gather a call
real_gather = deepspeed_strategy.gather_by_broadcasts
def counted_gather(*args, **kwargs):
    counted[0] += 1
    return real_gather(*args, **kwargs)
deepspeed_strategy.gather_by_broadcasts = counted_gather
if os.environ.get("NO_PARAM_GROUPS"):  # a stand-in for a torch whose FSDP2 keeps its parameter groups where litft cannot find them
    import litft.parallel.strategies.fsdp as fsdp
    fsdp.param_groups_of = lambda unit: []
import contextlib
from torch.distributed.fsdp import FSDPModule
from litft.model.generation import Generation
call, generating = Generation.call, Generation.generating
steps = [0]
def counted_call(self, prompts, max_new_tokens, sampler=None, visuals=None):
    out = call(self, prompts, max_new_tokens, sampler, visuals)
    steps[0] += len(sampler.logps) if sampler is not None else max_new_tokens
    return out
@contextlib.contextmanager
def counted_generating(self):
    before, steps[0] = counted[0], 0
    with generating(self):
        yield
    units = sum(isinstance(m, FSDPModule) for m in self.model.modules())
    partitioned = sum(hasattr(p, "ds_id") for p in self.model.parameters())
    with open(os.path.join(os.environ["GATHERS"], f"rank-{dist.get_rank()}.jsonl"), "a") as f:
        f.write(json.dumps({"gathers": counted[0] - before, "steps": steps[0], "units": units, "partitioned": partitioned}) + "\\n")
Generation.call, Generation.generating = counted_call, counted_generating
from litft.__main__ import main
main(sys.argv[1:])
"""

COMMON = ["--objective", "grpo", "--objective.group_size", "2", "--objective.max_new_tokens", "8", "--objective.rewards", "format",
          "--data.num_train", "8", "--data.num_val", "0", "--train.global_batch_size", "4", "--train.micro_batch_size", "4",
          "--train.max_steps", "1", "--eval.initial_validation", "false", "--precision", "32-true", "--accelerator", "cpu",
          "--logger_name", "csv", "--devices", "2"]


def count(tmp_path, name, *flags, **env):
    root = tmp_path / name
    root.mkdir()
    script = root / "count_gathers.py"
    script.write_text(COUNT_GATHERS)
    env = dict(os.environ, **env, GATHERS=str(root), PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(script), *flags, *COMMON, "--out_dir", str(root / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [[json.loads(line) for line in path.read_text().splitlines()] for path in sorted(root.glob("rank-*.jsonl"))]


@pytest.mark.parametrize("name,flags", [
    # litft-tiny under FSDP: its two blocks, its untied embeddings and head, and the root, each gathered once per call.
    ("fsdp-full", ["finetune_full", "--strategy", "fsdp"]),
    # ZeRO-3 gathers every partitioned weight once per call (LoRA: the frozen base too).
    ("zero3-lora", ["finetune_lora", "--strategy", "deepspeed", "--deepspeed.stage", "3"]),
])
def test_one_gather_per_unit_per_generate_call(tmp_path, name, flags):
    ranks = count(tmp_path, name, *flags)
    assert len(ranks) == 2
    for calls in ranks:
        assert calls and all(c["steps"] >= 2 for c in calls), calls  # decode steps that would each gather again
        # FSDP: each unit once; ZeRO-3 on the CPU: each partitioned parameter once (its coalesced gather goes a tensor at a
        # time over gloo), where each decode step gathered every one of them again.
        assert all(c["gathers"] == (c["units"] or c["partitioned"]) for c in calls), calls


def test_where_the_parameter_groups_cannot_be_found_each_decode_step_gathers_as_in_training(tmp_path):
    """The branch for a torch whose FSDP2 keeps its groups elsewhere (a stand-in hides them): correct, every unit gathered
    at every forward of the call (the prompt's and each new token's but the last)."""
    for calls in count(tmp_path, "fsdp-fallback", "finetune_full", "--strategy", "fsdp", NO_PARAM_GROUPS="1"):
        assert calls and all(c["gathers"] >= c["units"] * c["steps"] for c in calls), calls
