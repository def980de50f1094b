"""Resuming sharded runs in real gloo processes: same topology, 4 -> 2 -> 1 ranks, FULL_SHARD -> HYBRID_SHARD, DeepSpeed ZeRO-3 -> one rank -> ZeRO-2 and -> no DeepSpeed."""

import json
from collections import Counter

import pytest
import torch

from tests.batch import Batch
from tests.conftest import read_metrics, run_recording_zero3_partitions

COMMON = [
    "--data", "TinyTasks", "--data.num_train", "64", "--data.num_val", "8",
    "--train.global_batch_size", "8", "--train.max_steps", "6", "--train.learning_rate", "3e-3",
    "--train.warmup_steps", "1", "--train.save_interval", "2", "--train.keep_checkpoints", "3", "--train.record_sample_ids", "true",
    "--eval.interval", "0", "--eval.max_batches", "1", "--eval.initial_validation", "false",
    "--precision", "32-true", "--accelerator", "cpu",
]
FULL_SHARD = ["--strategy", "fsdp", "--fsdp.sharding_strategy", "FULL_SHARD"]


def losses(out_dir):
    return {int(r["step"]): r["loss"] for r in read_metrics(out_dir) if "loss" in r}


def checkpoint(out_dir, step):
    return out_dir / "checkpoints" / f"step-{step:08d}"


def samples_by_step(out_dir):
    """Every rank's record of the samples it trained on: step -> sample ids (all ranks together)."""
    steps = {}
    for file in sorted((out_dir / "logs" / "samples").glob("rank-*.jsonl")):
        for line in file.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], []).extend(record["ids"])
    return steps


def assert_close_losses(expected, got, steps):
    for step in steps:
        assert abs(expected[step] - got[step]) <= 1e-5 * abs(expected[step]), (step, expected, got)


def assert_chain_sees_each_sample_once(whole, middle, last):
    """Steps 1-2 of ``whole``, 3-4 of ``middle`` and 5-6 of ``last`` trained, step by step, the samples ``whole`` trained: each once."""
    reference = samples_by_step(whole)
    chained = {s: ids for s, ids in reference.items() if s <= 2}
    chained.update({s: ids for s, ids in samples_by_step(middle).items() if s in (3, 4)})
    chained.update(samples_by_step(last))
    assert sorted(chained) == list(range(1, 7))
    for step in range(1, 7):
        assert sorted(chained[step]) == sorted(reference[step]) and len(set(chained[step])) == 8, step
    seen = Counter(i for ids in chained.values() for i in ids)
    assert max(seen.values()) == 1 and len(seen) == 48  # one epoch of 64: none twice, none skipped


ZERO3 = ["--strategy", "deepspeed", "--deepspeed.stage", "3"]
BACKGROUND = ["--train.async_save", "true"]  # checkpoints written by a thread while training goes on


def committed_only(out_dir):
    """Every checkpoint the run wrote was committed: none left partial."""
    return not list((out_dir / "checkpoints").glob(".*.partial"))


@pytest.fixture(scope="module")
def zero3_two_ranks(tmp_path_factory):
    """ZeRO-3 on 2 ranks, 6 steps, checkpoints at 2, 4 and 6, each rank's parameter partitions recorded: the reference
    (a launch of its own, with deepspeed.initialize patched to record)."""
    root = tmp_path_factory.mktemp("zero3")
    out = root / "run"
    recorded = run_recording_zero3_partitions(root, "finetune_full", *COMMON, *ZERO3, "--devices", "2", "--train.micro_batch_size", "2", "--out_dir", out)
    assert len(list((checkpoint(out, 2) / "model").glob("*.distcp"))) == 2  # litft's DCP layout, not DeepSpeed's files
    return out, recorded


@pytest.fixture(scope="module")
def runs(tmp_path_factory, zero3_two_ranks):
    """Every other run, in batches of long-lived processes (tests/batch.py), each resume in a phase after the run it continues."""
    batch = Batch(tmp_path_factory.mktemp("resume"))
    whole, _ = zero3_two_ranks
    # Resumed below on 2 ranks, then on one; a same-topology resume is the 2-rank ZeRO-3 LoRA's.
    four = batch.add("four", 4, "finetune_full", *COMMON, *FULL_SHARD, "--devices", "4", "--train.micro_batch_size", "2")
    two = batch.add("two", 2, "finetune_full", *COMMON, "--strategy", "fsdp", "--fsdp.sharding_strategy", "HYBRID_SHARD", "--fsdp.shard_size", "1",
                    "--devices", "2", "--train.micro_batch_size", "2", "--resume", checkpoint(four, 2), *BACKGROUND)
    batch.add("two-one", 1, "finetune_full", *COMMON, "--train.micro_batch_size", "8", "--resume", checkpoint(two, 4))
    one = batch.add("zero3-one", 1, "finetune_full", *COMMON, *ZERO3, "--devices", "1", "--train.micro_batch_size", "8",
                    "--resume", checkpoint(whole, 2))
    batch.add("zero3-one-stage2", 2, "finetune_full", *COMMON, "--strategy", "deepspeed", "--deepspeed.stage", "2", "--devices", "2",
              "--train.micro_batch_size", "2", "--resume", checkpoint(one, 4))
    batch.add("zero3-plain", 1, "finetune_full", *COMMON, "--train.micro_batch_size", "8", "--resume", checkpoint(whole, 4))
    lora = ["finetune_lora", *COMMON, *ZERO3, "--lora_r", "4", "--lora_dropout", "0.1", "--train.max_steps", "4", "--train.micro_batch_size", "2",
            "--devices", "2"]
    lora_whole = batch.add("zero3-lora", 2, *lora, *BACKGROUND)
    batch.add("zero3-lora-resumed", 2, *lora, "--resume", checkpoint(lora_whole, 2))
    return batch


@pytest.fixture(scope="module")
def four_ranks(runs):
    """FULL_SHARD on 4 ranks, 6 steps, checkpoints at 2, 4 and 6: the uninterrupted reference."""
    out = runs.out("four")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002", "step-00000004", "step-00000006"]
    assert len(list((checkpoint(out, 2) / "model").glob("*.distcp"))) == 4  # one shard file per rank
    return out


def test_topology_change_4_to_2_to_1_sees_every_sample_once(four_ranks, runs):
    """4 ranks (FULL_SHARD) -> 2 ranks (HYBRID_SHARD, 2 replicas, checkpoints written in the background) -> 1 process, from
    the same data position."""
    two, one = runs.out("two"), runs.out("two-one")
    meta = json.loads((checkpoint(two, 4) / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["step"] == 4 and committed_only(two)
    reference = losses(four_ranks)
    assert_close_losses(reference, losses(two), [3, 4, 5, 6])
    assert_close_losses(reference, losses(one), [5, 6])
    # Sample accounting, from what each rank recorded it trained on.
    assert_chain_sees_each_sample_once(four_ranks, two, one)


def test_convert_fsdp_checkpoint_matches_training_export(four_ranks, tmp_path):
    from transformers import AutoModelForCausalLM

    from litft.checkpoint.convert import convert

    converted = convert(checkpoint(four_ranks, 6), out_dir=tmp_path / "hf")
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(converted).eval()(ids).logits
        # final/ holds the weights gathered from the trained shards at the end of the run.
        trained = AutoModelForCausalLM.from_pretrained(four_ranks / "final").eval()(ids).logits
    torch.testing.assert_close(ours, trained, rtol=0, atol=1e-6)


def test_zero3_never_holds_the_whole_model_before_deepspeed_initialize(zero3_two_ranks):
    """Built under zero.Init and filled in place: every weight is already a partition of half when ZeRO gets it.

    Every weight comes from the checkpoint, so each rank copies its own slice out of
    the file and no parameter is ever gathered whole on a rank.
    """
    _, recorded = zero3_two_ranks
    assert [r["gathered"] for r in recorded] == [0, 0]
    ranks = [r["held"] for r in recorded]
    for held in ranks:
        assert len(held) == 38  # litft-tiny: every weight, each partitioned (the tied embedding once)
        for name, (local, whole, partition, _) in held.items():
            assert local == 0 and whole > 0 and partition == -(-whole // 2), (name, local, whole, partition)
    assert sum(p for _, _, p, _ in ranks[0].values()) <= 0.51 * sum(w for _, w, _, _ in ranks[0].values())


def test_zero3_resumes_on_one_rank_then_at_stage_2_and_sees_every_sample_once(zero3_two_ranks, runs):
    """ZeRO-3 on 2 ranks -> ZeRO-3 on 1 rank -> ZeRO-2 on 2 ranks, from the same data position, as if never stopped."""
    whole, _ = zero3_two_ranks
    one, stage2 = runs.out("zero3-one"), runs.out("zero3-one-stage2")
    reference = losses(whole)
    assert sorted(losses(one)) == [3, 4, 5, 6] and sorted(losses(stage2)) == [5, 6]
    assert_close_losses(reference, losses(one), [3, 4, 5, 6])
    assert_close_losses(reference, losses(stage2), [5, 6])
    assert_chain_sees_each_sample_once(whole, one, stage2)


def test_zero3_checkpoint_resumes_in_one_plain_process(zero3_two_ranks, runs):
    """DeepSpeed writes the layout a plain AdamW run reads: the run continues without DeepSpeed."""
    whole, _ = zero3_two_ranks
    plain = runs.out("zero3-plain")
    assert sorted(losses(plain)) == [5, 6]
    assert_close_losses(losses(whole), losses(plain), [5, 6])


def test_deepspeed_zero3_lora_resume_and_convert(runs, tmp_path):
    """LoRA with dropout under ZeRO-3, checkpoints written in the background: the adapters' states and every rank's
    generators come back; convert reads the checkpoint."""
    whole, resumed = runs.out("zero3-lora"), runs.out("zero3-lora-resumed")
    assert committed_only(whole)
    assert len(list((checkpoint(whole, 2) / "model").glob("*.distcp"))) == 2
    assert sorted(losses(resumed)) == [3, 4]
    assert_close_losses(losses(whole), losses(resumed), [3, 4])

    from safetensors.torch import load_file

    from litft.checkpoint.convert import convert

    adapter = convert(checkpoint(whole, 4), out_dir=tmp_path / "adapter", merge_lora=False)
    exported = load_file(whole / "final-adapter" / "adapter_model.safetensors")
    converted = load_file(adapter / "adapter_model.safetensors")
    assert converted.keys() == exported.keys()
    for name in exported:
        torch.testing.assert_close(converted[name], exported[name], rtol=0, atol=1e-6)
