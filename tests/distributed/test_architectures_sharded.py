"""Architectures beyond Llama under FSDP's fill and the mesh, against one process on the same global batch: a windowed model
under context parallel, a MoE with per-head norms and models with fused projections under tensor parallel, hybrid models whose
layers carry state under FSDP and ZeRO-3; and what
``litft estimate`` says a tensor-parallel rank holds against what it held."""

import json

import pytest
import torch
from safetensors.torch import load_file

from litft.data.order import SampleOrder
from tests.architectures import ARCHITECTURES, save_tiny
from tests.batch import Batch
from tests.conftest import read_metrics, step_losses

COMMON = [
    "--data", "TinyTasks", "--data.num_train", "32", "--data.num_val", "8", "--train.global_batch_size", "8",
    "--train.max_steps", "3", "--train.learning_rate", "3e-3", "--train.warmup_steps", "1", "--eval.interval", "0",
    "--eval.initial_validation", "false", "--eval.final_validation", "false", "--precision", "32-true", "--accelerator", "cpu",
    "--logger_name", "csv",
]
TP2 = ["--strategy", "fsdp", "--devices", "2", "--tensor_parallel", "2", "--train.micro_batch_size", "4"]
CASES = {
    "cp2-window": ("mistral (window)", ["--strategy", "fsdp", "--devices", "2", "--context_parallel", "2", "--train.micro_batch_size", "4"]),
    # Split as the model's own plan says: Qwen3-MoE's per-head q/k norms have their gradient summed over the group and its
    # experts stay whole (hub layout, converted on load); Phi-3's fused qkv and gate_up projections are gathered after the split.
    "tp2-moe": ("qwen3-moe", TP2),
    "tp2-fused": ("phi3", TP2),
    "tp2-neox": ("gpt-neox", TP2),  # one fused qkv with heads interleaved, a parallel residual
    "tp2-llama": ("llama", TP2),
    "zero3-moe": ("qwen3-moe", ["--strategy", "deepspeed", "--deepspeed.stage", "3", "--devices", "2", "--train.micro_batch_size", "4"]),
    # Each FSDP rank converts only its rows of the hub layout's per-expert tensors (and reads only its rows of the rest).
    "fsdp-moe": ("qwen3-moe", ["--strategy", "fsdp", "--devices", "2", "--train.micro_batch_size", "4"]),
    # Layers that carry state, on a sample per padded row: Falcon-H1's Mamba2 beside attention (its MuP vector set by the model's
    # init) sharded by FSDP, Qwen3-Next's gated delta rule and experts by ZeRO-3.
    "fsdp-state": ("falcon-h1", ["--strategy", "fsdp", "--devices", "2", "--train.micro_batch_size", "4"]),
    "zero3-state-moe": ("qwen3-next", ["--strategy", "deepspeed", "--deepspeed.stage", "3", "--devices", "2", "--train.micro_batch_size", "4"]),
}


# Vision-language models on the coloured-shapes images (tests/vision_models.py): FSDP wraps the image encoder's blocks as
# units too (Gemma 3, full fine-tuning, the encoder frozen); ZeRO-3 partitions it under LoRA (Mllama: its encoder and
# projector frozen leaves, the images read by cross-attention layers inside the language model, on records with an image
# each, as Mllama needs) and under full fine-tuning, where the projector trains (PaddleOCR-VL's 3-D positions; its
# projector's layers, run once per image by transformers, run once a forward, as the ranks' micro-batches hold 2, 1 and 0
# images). Llama 4 under FSDP: its MoE language model, and a projector its forward runs outside get_image_features, which
# the stand-in image must reach too. Qwen3.5-MoE under FSDP with LoRA: gated delta rule layers (state, a sample per padded
# row) and experts in the language model of a folder that trains as its text model on text records. The last field: the
# data's folder.
VISION_CASES = {
    "fsdp-vision": ("gemma3", "finetune_full", ["--strategy", "fsdp", "--devices", "2"], "shapes"),
    "fsdp-vision-moe": ("llama4", "finetune_full", ["--strategy", "fsdp", "--devices", "2"], "shapes"),
    "fsdp-vision-state": ("qwen3.5-moe", "finetune_lora", ["--strategy", "fsdp", "--devices", "2"], "shapes"),
    "zero3-vision-lora": ("mllama", "finetune_lora", ["--strategy", "deepspeed", "--deepspeed.stage", "3", "--devices", "2"], "images"),
    "zero3-vision-full": ("paddleocr-vl", "finetune_full", ["--strategy", "deepspeed", "--deepspeed.stage", "3", "--devices", "2"], "shapes"),
}


def vision_flags(root, data="shapes"):
    return ["--data", "JSON", "--data.json_path", root / data / "train.jsonl", "--data.val_path", root / data / "val.jsonl",
            *COMMON[6:], "--train.micro_batch_size", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each model saved once and trained by one process (micro-batches of 4), then every sharded case: two batches of
    long-lived processes (tests/batch.py)."""
    from tests.vision_models import VISION_MODELS, save_vision_model, write_shapes

    batch = Batch(tmp_path_factory.mktemp("architectures"))
    for name in sorted({name for name, _ in CASES.values()}):
        folder = save_tiny(next(a for a in ARCHITECTURES if a.name == name), batch.root / f"model-{name.split()[0]}")
        batch.add(f"single-{name.split()[0]}", 1, "finetune_full", folder, *COMMON, "--train.micro_batch_size", "4")
    for case, (name, flags) in CASES.items():
        batch.add(case, 2, "finetune_full", batch.root / f"model-{name.split()[0]}", *COMMON, *flags)
    # 8 text records after the 16 image ones: one of rank 1's first micro-batches holds two of them (checked), so under FSDP and ZeRO-3
    # it runs the sharded encoder on the stand-in image while rank 0 runs it on pictures (litft.model.vision.EncoderStandIn).
    write_shapes(batch.root / "shapes", 16, 0, text_only=8), write_shapes(batch.root / "shapes", 4, 1, "val.jsonl")
    write_shapes(batch.root / "images", 16, 2), write_shapes(batch.root / "images", 4, 3, "val.jsonl")
    assert any(all(i >= 16 for i in micro) for micro in SampleOrder(24, 8, 2, 1, 2, 42).micro_batches(0, 0))
    for case, (name, job, flags, data) in VISION_CASES.items():
        folder = save_vision_model(next(m for m in VISION_MODELS if m.name == name), batch.root / f"model-{name}")
        batch.add(f"single-{case}", 1, job, folder, *vision_flags(batch.root, data))
        batch.add(case, 2, job, folder, *vision_flags(batch.root, data), *flags)
    return batch


@pytest.mark.parametrize("case", sorted(VISION_CASES))
def test_sharded_vision_language_runs_match_one_process(case, runs):
    """The same global batch of image records, the image encoder sharded with the rest: the same losses, gradient norms and
    exported weights as one process."""
    reference, sharded = runs.out(f"single-{case}"), runs.out(case)
    expected, got = step_losses(reference), step_losses(sharded)
    assert len(got) == len(expected) == 3 and all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(expected, got)), (expected, got)
    norms = lambda run: [r["grad_norm"] for r in read_metrics(run) if "loss" in r]  # noqa: E731
    assert norms(sharded) == pytest.approx(norms(reference), rel=1e-4) and len(norms(reference)) == 3
    folder = "final-adapter" if VISION_CASES[case][1] == "finetune_lora" else "final"
    name = "adapter_model.safetensors" if folder == "final-adapter" else "model.safetensors"
    ours, theirs = load_file(sharded / folder / name), load_file(reference / folder / name)
    assert ours.keys() == theirs.keys()
    for key in ours:  # Adam's first steps move an element by about lr (3e-3) whatever its gradient's size, so one whose gradient
        # is summation noise (a LoRA B element of PaddleOCR-VL under ZeRO-3: 5e-5 apart, measured) is allowed 3% of a step
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-4, msg=key)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_runs_of_other_architectures_match_one_process(case, runs):
    name, _ = CASES[case]
    reference, sharded = runs.out(f"single-{name.split()[0]}"), runs.out(case)
    expected, got = step_losses(reference), step_losses(sharded)
    assert len(got) == len(expected) == 3 and abs(got[0] - expected[0]) <= 1e-5 * abs(expected[0])
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(expected, got)), (expected, got)
    norms = lambda run: [r["grad_norm"] for r in read_metrics(run) if "loss" in r]  # noqa: E731 (logged under every strategy)
    # The first step's gradients come from the same weights: only the order of fp32 sums differs (a missing average over
    # ranks would be a factor of 2). Later steps start from weights after Adam steps, which turn sum-order noise into weight
    # differences where a gradient nearly cancels: in Qwen3-Next one of in_proj_qkvz's 3,072 gradients is 2e-7 against a
    # median of 3e-2; clipped, it is 3e-8, about Adam's eps, where Adam's step moves 2e4 x lr per unit of gradient. That
    # element ends step 1 4e-4 apart between ZeRO-3 and one process, and step 3's gradient norm 5e-4 apart (relative),
    # with every loss within 1e-5 (measured; the pieces of the norm that moved are in no loss this test reads).
    assert norms(sharded)[0] == pytest.approx(norms(reference)[0], rel=1e-5) and len(norms(reference)) == 3
    assert norms(sharded)[1:] == pytest.approx(norms(reference)[1:], rel=2e-3)
    if "moe" in case:  # the router's balance summed over the ranks is the one process's (a TP group counts each token twice alike)
        balance = lambda run: [r[key] for key in ("expert_imbalance_max", "experts_idle") for r in read_metrics(run) if "loss" in r]  # noqa: E731
        assert balance(sharded) == pytest.approx(balance(reference), rel=1e-9) and len(balance(reference)) == 6
    ours, theirs = load_file(sharded / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        a, b = ours[key], theirs[key]
        if key.endswith("query_key_value.bias"):  # GPT-NeoX: (head, q/k/v, dim); a key bias has a gradient of 0 (the softmax
            a, b = (t.reshape(4, 3, -1)[:, [0, 2]] for t in (a, b))  # ignores it), so Adam's steps on it are rounding noise
        if "state" in case:
            # The element of Qwen3-Next's in_proj_qkvz whose gradient is about Adam's eps (above) ends 4e-4 apart; every other
            # element of every tensor is within 7e-5. One such element a tensor, and less than 2 x lr (3e-3) apart: Adam moves
            # an element by less than lr a step in either run, whatever its gradient.
            apart = ~torch.isclose(a, b, rtol=1e-4, atol=1e-4)
            assert int(apart.sum()) <= 1 and float((a - b).abs().max()) < 6e-3, key
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=key)


@pytest.mark.parametrize("case", sorted(c for c in CASES if c.startswith("tp2")))
def test_the_estimate_splits_tensor_parallel_blocks_as_training_did(case, runs, capsys):
    """The estimate reads the model's own plan, as training does: Phi-3's and GPT-NeoX's fused layers are counted split."""
    from litft.__main__ import main

    name, _ = CASES[case]
    held = read_metrics(runs.out(case))[0]["params_bytes"]  # the fullest rank's parameters, as the run measured them
    capsys.readouterr()
    main(["estimate", str(runs.root / f"model-{name.split()[0]}"), "--job", "finetune_full", "--strategy", "fsdp", "--devices", "2",
          "--tensor_parallel", "2", "--precision", "32-true", "--seq_len", "32", "--json", "true"])
    estimated = json.loads(capsys.readouterr().out)["per_rank"]["params"]["gpu"]
    assert estimated == held, (estimated, held)  # Llama's names alone counted Phi-3's 145,536 and GPT-NeoX's 152,064 bytes
