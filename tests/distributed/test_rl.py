"""GRPO under every strategy (expert and tensor parallel included) against one process, and stopped inside a cycle of iterations then resumed.

Rollouts depend on (seed, epoch, cycle, prompt) and never on the rank layout or the batching: each completion
draws from noise of its own, so two ranks sample the completions one process samples, though one process
left-pads a step's four prompts' groups into one batch and each of two ranks its two; the step's loss is then
the same sum over the same tokens. Each run takes two cycles of two iterations (four steps) with the sampler's log-probs recomputed, a format reward
that some completions of the random litft-tiny meet and some do not, and one held-out validation.
The loss formulas themselves are checked against the papers' in tests/unit/test_rl.py.
"""

import json

import pytest

from tests.batch import Batch
from tests.conftest import read_metrics, step_losses

COMMON = [
    "--objective", "grpo", "--objective.group_size", "4", "--objective.max_new_tokens", "8", "--objective.rewards", "format",
    "--objective.format_pattern", ".*[aeiou].*", "--objective.iterations", "2", "--objective.temperature", "0.7",
    "--train.global_batch_size", "4", "--train.max_steps", "4", "--train.learning_rate", "3e-3", "--train.warmup_steps", "1",
    "--eval.interval", "4", "--eval.initial_validation", "false", "--precision", "32-true", "--accelerator", "cpu", "--logger_name", "csv",
]
TINY = ["--data.num_train", "16", "--data.num_val", "4"]
JOBS = {"lora": ["finetune_lora", "--lora_r", "4", "--lora_dropout", "0", *TINY], "full": ["finetune_full", *TINY],
        "moe": ["finetune_full", "litft-tiny-moe", *TINY]}
TWO = ["--devices", "2", "--train.micro_batch_size", "4"]  # each rank: 2 prompts, 8 completions in 2 micro-batches
CASES = {
    "fsdp-full": ("full", ["--strategy", "fsdp", *TWO]),
    "zero3-lora": ("lora", ["--strategy", "deepspeed", "--deepspeed.stage", "3", *TWO]),
    "ddp-lora-resumed": ("lora", None),  # stopped after step 1 of a 2-step cycle, resumed
    # Each rank holds half the experts: generate's forwards send tokens through the dispatch, every rank stepping in turn.
    "fsdp-ep-moe": ("moe", ["--strategy", "fsdp", "--expert_parallel", "2", *TWO]),
    # Both ranks of the tensor-parallel group sample the same rollouts with their halves of every layer; the file keeps one copy.
    "fsdp-tp-full": ("full", ["--strategy", "fsdp", "--tensor_parallel", "2", *TWO]),
    # Prompts about pictures (and one text prompt) for a vision-language model (PaddleOCR-VL's 3-D positions): the images
    # reach generate and every training forward, and the sharded image encoder runs on every rank in both.
    "fsdp-vision": ("vision", ["--strategy", "fsdp", *TWO]),
    # Llama 4: generate runs its image encoder ahead of the model's forward, before any training forward made FSDP's root.
    "fsdp-vision-moe": ("vision-moe", ["--strategy", "fsdp", *TWO]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.vision_models import VISION_MODELS, save_vision_model, write_shape_prompts

    batch = Batch(tmp_path_factory.mktemp("rl"))
    train, val = write_shape_prompts(batch.root / "shapes", 15, 0, text_only=1), write_shape_prompts(batch.root / "shapes", 4, 1, "val.jsonl")
    jobs = dict(JOBS)
    for job, name in (("vision", "paddleocr-vl"), ("vision-moe", "llama4")):
        folder = save_vision_model(next(m for m in VISION_MODELS if m.name == name), batch.root / f"model-{job}")
        jobs[job] = ["finetune_lora", folder, "--lora_r", "4", "--data", "Prompts", "--data.path", train, "--data.val_path", val]
    for name, job in jobs.items():
        batch.add(f"single-{name}", 1, *job, *COMMON, "--train.micro_batch_size", "8")
    for case, (name, flags) in CASES.items():
        if flags is not None:
            batch.add(case, 2, *jobs[name], *COMMON, *flags)
    flags = [*JOBS["lora"], *COMMON, "--strategy", "ddp", *TWO]
    stopped = batch.add("ddp-lora-stopped", 2, *flags, "--train.stop_after_steps", "1")
    batch.add("ddp-lora-resumed", 2, *flags, "--resume", "auto", out=stopped)
    return batch


def rollouts(out_dir):
    rows = {}
    for path in sorted((out_dir / "rollouts").glob("step-*.jsonl")):
        rows[path.name] = [json.loads(line) for line in path.read_text().splitlines()]
    return rows


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_sample_train_and_validate_as_one_process(case, runs):
    reference, got = runs.out(f"single-{CASES[case][0]}"), runs.out(case)
    expected, ours = rollouts(reference), rollouts(got)
    assert sorted(expected) == ["step-1.jsonl", "step-3.jsonl"] and sorted(ours) == sorted(expected)
    for name in expected:
        assert len(ours[name]) == 16
        for a, b in zip(expected[name], ours[name]):
            assert {k: a[k] for k in ("prompt", "completion", "rewards", "cut")} == {k: b[k] for k in ("prompt", "completion", "rewards", "cut")}
            assert a["advantage"] == pytest.approx(b["advantage"], abs=1e-9)
            assert a["completion_ids"] == b["completion_ids"] and a["prompt_ids"] == b["prompt_ids"]
            assert len(b["logprobs"]) == len(b["completion_ids"]) and b["logprobs"] == pytest.approx(a["logprobs"], rel=2e-5, abs=1e-5)
    rewards = [r["reward"] for rows in expected.values() for r in rows]
    assert 0 < sum(rewards) < len(rewards), "the format reward should split the completions, or the advantages are all 0"
    a, b = step_losses(reference), step_losses(got)
    assert len(a) == len(b) == 4 and all(abs(x - y) <= 1e-5 * abs(x) + 1e-7 for x, y in zip(a, b)), (a, b)
    assert any(abs(x) > 1e-3 for x in a), a
    # (step, value) pairs flattened: newer pytest's approx takes no nested sequences
    figures = lambda run: [v for r in read_metrics(run) for k in ("reward_mean", "val_reward", "clip_fraction") if k in r for v in (r["step"], r[k])]  # noqa: E731
    assert figures(got) == pytest.approx(figures(reference), abs=1e-6)
    # The engine's log-prob of each sampled token against the trainer's at the first forward on it (the sampler's, with 2
    # iterations): the same policy, in eval mode, at the temperature; the KV cache sums in another order.
    gaps = [r["sampler_logprob_gap"] for r in read_metrics(got) if "sampler_logprob_gap" in r]
    assert gaps and all(0 <= gap < 1e-5 for gap in gaps), gaps


def test_the_sampler_state_of_a_cycle_is_in_the_checkpoint(runs):
    """The run stopped after the first of a cycle's two steps kept the cycle's rollouts and their log-probs beside its weights."""
    stopped = runs.out("ddp-lora-resumed")
    first = sorted((stopped / "checkpoints").iterdir())[0]
    assert (first / "rollouts.pt").is_file()
