"""DDP, FSDP2 and DeepSpeed ZeRO, in real gloo processes, must train what one process trains on the same global batch.

Each run is also checked against the sharding theory: the bytes of parameters,
gradients and optimizer states a rank holds, as a fraction of what one process holds.
"""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from litft.parallel.tensor import split_over_tensor_parallel
from tests.batch import Batch
from litft.launch.launchers import free_port
from tests.conftest import ROOT, final_value, read_metrics, run_recording_zero3_partitions, step_losses

COMMON = [
    "--data", "TinyTasks", "--data.num_train", "64", "--data.num_val", "8",
    "--train.global_batch_size", "8", "--train.max_steps", "4", "--train.learning_rate", "3e-3",
    "--train.warmup_steps", "1", "--eval.interval", "0", "--eval.max_batches", "1", "--eval.initial_validation", "false",
    "--precision", "32-true", "--accelerator", "cpu",
]
JOBS = {
    "finetune_full": ([], "final/model.safetensors"),
    "finetune_lora": (["--lora_dropout", "0", "--lora_r", "4"], "final-adapter/adapter_model.safetensors"),
    "qlora": (["--lora_dropout", "0", "--lora_r", "4", "--quantize", "bnb.nf4"], "final-adapter/adapter_model.safetensors"),
}
# Per rank, as a fraction of one process: (parameters, gradients, optimizer states).
# ZeRO's optimizer states include its fp32 master copy of the partition: (2 + 1) / 2 of Adam's 2 states.
LAYOUTS = {
    "ddp": (["--strategy", "ddp", "--train.peak_tflops", "0.5"], (1.0, 1.0, 1.0)),
    "FULL_SHARD": (["--strategy", "fsdp", "--fsdp.sharding_strategy", "FULL_SHARD"], (0.5, 0.5, 0.5)),
    "SHARD_GRAD_OP": (["--strategy", "fsdp", "--fsdp.sharding_strategy", "SHARD_GRAD_OP"], (0.5, 0.5, 0.5)),
    "NO_SHARD": (["--strategy", "fsdp", "--fsdp.sharding_strategy", "NO_SHARD"], (1.0, 1.0, 1.0)),
    "zero0": (["--strategy", "deepspeed", "--deepspeed.stage", "0"], (1.0, 1.0, 1.0)),
    "zero2": (["--strategy", "deepspeed", "--deepspeed.stage", "2"], (1.0, 0.5, 0.75)),
    "zero3": (["--strategy", "deepspeed", "--deepspeed.stage", "3"], (0.5, 0.5, 0.75)),
}
STATE_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes")


def command(job):
    return "finetune_lora" if job == "qlora" else job


# Every layout trains the full model; LoRA (only adapters sharded) runs under DDP and the two that shard everything.
CASES = [("finetune_full", layout) for layout in LAYOUTS] + [("finetune_lora", layout) for layout in ("ddp", "FULL_SHARD", "zero3")]
QLORA = {
    "ddp": (["--strategy", "ddp"], (1.0, 1.0, 1.0)),
    # The 4-bit base stays whole on every rank (FSDP ignores it), so only adapters' states halve.
    "FULL_SHARD": (["--strategy", "fsdp", "--fsdp.sharding_strategy", "FULL_SHARD"], (None, 0.5, 0.5)),
    "zero3": (["--strategy", "deepspeed", "--deepspeed.stage", "3"], (0.5, 0.5, 0.75)),
}
TWO = ["--devices", "2", "--train.micro_batch_size", "2"]
# Exact memory savers ride along where they must not change what trains (tiled MLP: float rounding apart).
SAVERS = ["--train.activation_offload", "true", "--train.tiled_mlp", "true"]
WITH_SAVERS = {("finetune_full", "FULL_SHARD"), ("finetune_lora", "zero3")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_dir):
    """Every run of this file but the two that start their own processes, in three batches of long-lived processes
    (tests/batch.py): the one-process references, the 4-rank runs, then the 2-rank ones (resumes of 4-rank checkpoints among them)."""
    import json

    batch = Batch(tmp_path_factory.mktemp("sharding"))
    for job in JOBS:  # one process, 2 micro-batches of 4
        batch.add(f"single-{job}", 1, command(job), *COMMON, *JOBS[job][0], "--train.micro_batch_size", "4")
    for job, layout in CASES:
        savers = SAVERS if (job, layout) in WITH_SAVERS else []
        batch.add(f"{job}-{layout}", 2, job, *COMMON, *JOBS[job][0], *LAYOUTS[layout][0], *TWO, *savers)
    for layout in ("ddp", "FULL_SHARD"):  # the 4-bit weights stay on the device under offload: tensor subclasses never move
        batch.add(f"qlora-{layout}", 2, "finetune_lora", *COMMON, *JOBS["qlora"][0], *QLORA[layout][0], *TWO,
                  *(SAVERS if layout == "FULL_SHARD" else []))
    batch.add("bf16-checkpointed", 2, "finetune_full", *COMMON, *LAYOUTS["FULL_SHARD"][0], *TWO, "--precision", "bf16-mixed",
              "--train.gradient_checkpointing", "true", "--train.activation_offload", "true")
    config = json.loads((tiny_dir / "config.json").read_text())
    config["tie_word_embeddings"] = False
    untied = batch.root / "untied" / "config.json"
    untied.parent.mkdir()
    untied.write_text(json.dumps(config))
    pretrain = ["pretrain", untied, "--tokenizer", tiny_dir, *COMMON]
    batch.add("pretrain-single", 1, *pretrain, "--train.micro_batch_size", "4")
    batch.add("pretrain-fsdp", 2, *pretrain, "--strategy", "fsdp", *TWO)
    batch.add("pretrain-zero3", 2, *pretrain, *LAYOUTS["zero3"][0], *TWO)
    four = ["--strategy", "fsdp", "--devices", "4", "--train.micro_batch_size", "2"]
    cp = batch.add("full-cp", 4, "finetune_full", *COMMON, *four, "--context_parallel", "2", "--train.save_interval", "2")
    batch.add("lora-cp-fsdp", 4, "finetune_lora", *COMMON, *JOBS["finetune_lora"][0], *four, "--train.save_interval", "null",
              "--context_parallel", "2")
    batch.add("lora-cp-zero3", 2, "finetune_lora", *COMMON, *JOBS["finetune_lora"][0], *LAYOUTS["zero3"][0], "--devices", "2",
              "--train.micro_batch_size", "4", "--context_parallel", "2")
    tp = batch.add("full-tp", 4, "finetune_full", *COMMON, *four, "--tensor_parallel", "2", "--train.save_interval", "2")
    batch.add("lora-tp", 4, "finetune_lora", *COMMON, *JOBS["finetune_lora"][0], *four, "--tensor_parallel", "2", "--train.save_interval", "null")
    for name, parent in (("full-cp-resumed", cp), ("full-tp-resumed", tp)):  # on 2 ranks, without the split
        batch.add(name, 2, "finetune_full", *COMMON, "--strategy", "fsdp", "--devices", "2", "--train.micro_batch_size", "4",
                  "--eval.final_validation", "false", "--resume", parent / "checkpoints" / "step-00000002")
    return batch


@pytest.fixture(scope="module")
def reference(runs):
    """One process, 2 micro-batches of 4, per job."""
    return lambda job: runs.out(f"single-{job}")


def state_bytes(out_dir):
    return next(tuple(row[k] for k in STATE_KEYS) for row in read_metrics(out_dir) if "params_bytes" in row)


def assert_same_training(single, sharded, job, fractions):
    reference, distributed = step_losses(single), step_losses(sharded)
    assert len(reference) == len(distributed) == 4
    assert reference[-1] < reference[0]
    for a, b in zip(reference, distributed):
        assert abs(a - b) <= 1e-5 * abs(a), (reference, distributed)
    # The exported weights (gathered from the shards) equal the single process's; Adam turns float
    # reduction-order noise into ~1e-5 differences, far below one step's update (~lr = 3e-3).
    weights = JOBS[job][1]
    ours, theirs = load_file(sharded / weights), load_file(single / weights)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-4, msg=name)
    for key, fraction, held, whole in zip(STATE_KEYS, fractions, state_bytes(sharded), state_bytes(single)):
        if fraction is None:
            continue
        assert abs(held - fraction * whole) <= 0.01 * whole, (key, held, whole, fraction)


@pytest.mark.parametrize("job, layout", CASES, ids=[f"{job}-{layout}" for job, layout in CASES])
def test_two_ranks_match_one_process(runs, reference, job, layout):
    fractions = LAYOUTS[layout][1]
    out = runs.out(f"{job}-{layout}")
    assert_same_training(reference(job), out, job, fractions)
    if layout == "FULL_SHARD":  # each phase's peak on the fullest rank, logged at the end
        last = read_metrics(out)[-1]
        assert all(last[f"phase_peak_gb/{p}"] > 0 and last[f"phase_peak_rank/{p}"] in (0, 1)
                   for p in ("load", "first_step", "steps", "save", "export")), last
    if (job, layout) in WITH_SAVERS:  # the savers were on: a micro-batch's saved activations went to host memory
        assert next(r["offloaded_bytes"] for r in read_metrics(out) if "params_bytes" in r) > 0
    if layout == "NO_SHARD":
        assert [r["replica_checksum_spread"] for r in read_metrics(out) if "replica_checksum_spread" in r] == [0.0]
    if layout == "ddp":
        # The same global batches are the same model FLOPs, however many ranks share them.
        assert flops_per_token_logged(reference(job)) == pytest.approx(flops_per_token_logged(out), rel=1e-9)
        rows = [r for r in read_metrics(out) if "mfu" in r]
        assert rows and all(r["mfu"] == pytest.approx(r["tflops_per_s_per_device"] / 0.5) for r in rows)
        assert all(r["peak_memory_gb"] == max(r["rank_peak_gb/0"], r["rank_peak_gb/1"]) > 0 for r in rows)
        names = {name for r in read_metrics(out) for name in r}  # no metric is a folder of another: MLflow keeps each as a file
        assert not {name.rpartition("/")[0] for name in names} & names


def flops_per_token_logged(out_dir):
    """Model FLOPs per token of each step, from the logged rates: TFLOP/s of all devices over tokens/s."""
    rows = [r for r in read_metrics(out_dir) if "tflops_per_s_per_device" in r]
    world = round(rows[0]["tokens_per_s"] / rows[0]["tokens_per_s_per_device"])
    return [r["tflops_per_s_per_device"] * 1e12 * world / r["tokens_per_s"] for r in rows]


@pytest.mark.parametrize("layout", list(QLORA))
def test_qlora_on_two_ranks_matches_one_process(tmp_path, runs, reference, layout):
    """Under ZeRO-3 the 4-bit base is quantized a block at a time and partitioned as it is made, never whole on a rank."""
    flags, fractions = QLORA[layout]
    if layout != "zero3":
        out = runs.out(f"qlora-{layout}")
    else:  # with deepspeed.initialize patched to record what each rank holds: a process of its own
        out = tmp_path / "qlora"
        recorded = run_recording_zero3_partitions(tmp_path, "finetune_lora", *COMMON, *JOBS["qlora"][0], *flags, *TWO, "--out_dir", out)
        assert [r["gathered"] for r in recorded] == [0, 0]  # each rank copied its own slices; nothing was sent whole
        for rank in recorded:
            assert sum(kind == "Params4bit" for *_, kind in rank["held"].values()) == 28  # 7 per block, 4 blocks
            for name, (local, whole, partition, _) in rank["held"].items():
                assert local == 0 and partition == -(-whole // 2), (name, local, whole, partition)
    assert_same_training(reference("qlora"), out, "qlora", fractions)


def test_fsdp_bf16_with_activation_checkpointing_tracks_fp32(runs, reference):
    """bf16 compute with fp32 gradient reduction and per-block recomputation: close to fp32, not equal."""
    out = runs.out("bf16-checkpointed")
    fp32, bf16 = step_losses(reference("finetune_full")), step_losses(out)
    assert len(bf16) == 4
    # Offloaded under checkpointing: each block's input (tests/unit/test_memory_savers.py counts them exactly).
    assert next(r["offloaded_bytes"] for r in read_metrics(out) if "params_bytes" in r) > 0
    for a, b in zip(fp32, bf16):
        assert abs(a - b) <= 5e-3 * abs(a), (fp32, bf16)
    # Sharded weights stay fp32 (the policy casts only for compute), so the export is fp32 too.
    assert all(t.dtype == torch.float32 for t in load_file(out / "final" / "model.safetensors").values())


def test_pretrain_from_config_untied_fsdp_and_zero3_match_one_process(runs):
    """Random init (a pure function of seed and tensor name) and untied embeddings sharded as units of their own.

    Under ZeRO-3 no value is sent at build time: a random init reaches each rank's
    partition only from rank 0's fill of its module.
    """
    single = runs.out("pretrain-single")
    assert "lm_head.weight" in load_file(single / "final" / "model.safetensors")
    assert_same_training(single, runs.out("pretrain-fsdp"), "finetune_full", (0.5, 0.5, 0.5))
    assert_same_training(single, runs.out("pretrain-zero3"), "finetune_full", LAYOUTS["zero3"][1])


@pytest.mark.parametrize("job", ["finetune_full"])  # LoRA under FSDP is covered on one node; the 2-D mesh is what this tests
def test_hybrid_shard_two_nodes_match_one_process(tmp_path, reference, job):
    """Two launches on 127.0.0.1 (node ranks 0 and 1) x 2 processes: shard inside a node, replicate across, and each node's
    two ranks one context group that splits every row (so the nodes are the two data-parallel ranks)."""
    out = tmp_path / "hybrid"
    args = [
        sys.executable, "-m", "litft", job, *COMMON, *JOBS[job][0], "--strategy", "fsdp", "--devices", "2",
        "--num_nodes", "2", "--context_parallel", "2", "--train.micro_batch_size", "2", "--out_dir", str(out),
    ]
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(rank)),
        )
        for rank in (1, 0)
    ]
    logs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), logs[1][-3000:] + logs[0][-3000:]
    assert_same_training(reference(job), out, job, (0.5, 0.5, 0.5))
    # Replica groups (the two nodes) hold identical parameters after training.
    assert [r["replica_checksum_spread"] for r in read_metrics(out) if "replica_checksum_spread" in r] == [0.0]
    # Both nodes wrote their shards of one checkpoint, committed once.
    meta = (out / "checkpoints" / "step-00000004" / "meta.json").read_text()
    assert '"world_size": 4' in meta and len(list((out / "checkpoints" / "step-00000004" / "model").glob("*.distcp"))) == 4


def test_fsdp_with_context_parallel_matches_one_process_and_resumes_without_it(runs, reference):
    """4 ranks: FSDP over all of them, two context groups of 2 (two data-parallel ranks, micro-batches of 2 rows, each row cut
    in two). TinyTasks' uneven samples make padding-free rows that are padded to the group and cut mid-sample, so the
    all-to-all around attention and targets across a slice's edge are exercised. The step-2 checkpoint then resumes on 2
    ranks without context parallel and ends where one process ends."""
    single, out = reference("finetune_full"), runs.out("full-cp")
    assert_same_training(single, out, "finetune_full", (0.25, 0.25, 0.25))
    assert abs(final_value(out, "val_loss") - final_value(single, "val_loss")) <= 1e-5 * final_value(single, "val_loss")
    resumed = runs.out("full-cp-resumed")
    expected = step_losses(single)[2:]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(step_losses(resumed), expected)) and len(step_losses(resumed)) == 2


@pytest.mark.parametrize("layout", ["fsdp", "zero3"])
def test_lora_with_context_parallel_matches_one_process(runs, reference, layout):
    """fsdp: 4 ranks, two context groups of 2, the adapters sharded with their layers; zero3: ZeRO-3 partitions the weights
    over the two ranks of one context group."""
    assert_same_training(reference("finetune_lora"), runs.out(f"lora-cp-{layout}"), "finetune_lora", (None, None, None))


@pytest.mark.parametrize("job", ["finetune_full", "finetune_lora"])
def test_tensor_parallel_under_fsdp_matches_one_process(runs, reference, job):
    """4 ranks: two tensor-parallel groups of 2 (each block's heads and MLP split, LoRA adapters with their layer), FSDP over
    the two groups. The full model's step-2 checkpoint then resumes on 2 ranks without tensor parallel (DCP reshards the
    split tensors) and ends where one process ends."""
    out = runs.out("full-tp" if job == "finetune_full" else "lora-tp")
    fractions = (None, None, None)
    if job == "finetune_full":
        # A split layer's tensors are held by one rank of four (tensor x FSDP), the rest (norms, embeddings) by one of two.
        weights = load_file(reference(job) / JOBS[job][1])
        held = sum(t.numel() / (4 if split_over_tensor_parallel(name) else 2) for name, t in weights.items())
        fractions = (held / sum(t.numel() for t in weights.values()),) * 3
    assert_same_training(reference(job), out, job, fractions)
    assert abs(final_value(out, "val_loss") - final_value(reference(job), "val_loss")) <= 1e-5 * final_value(reference(job), "val_loss")
    if job == "finetune_full":
        resumed = runs.out("full-tp-resumed")
        expected = step_losses(reference(job))[2:]
        assert len(step_losses(resumed)) == 2 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(step_losses(resumed), expected))
