"""Vision-language models train as transformers computes them.

Each tiny model (tests/vision_models.py) is saved with its processor; the coloured-shapes records come in TRL's two vision
layouts, text before or after the image, one record without an image. The reference is the model's own eager forward,
one record at a time, on what its processor makes of the rendered prompt and conversation.
"""

import json
import shutil

import pytest
import torch

from litft.data import JSON
from litft.data.collate import collate
from litft.errors import LitftError
from litft.model.loading import load_tokenizer
from tests.conftest import read_metrics, step_losses
from tests.vision_models import REAL_PROCESSORS, VISION_MODELS, reference_loss, save_vision_model, shape_image, write_shapes


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes")
    train, val = write_shapes(folder, 16, 0), write_shapes(folder, 4, 1, "val.jsonl")
    text_only = {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "red"}]}
    val.write_text(val.read_text() + json.dumps(text_only) + "\n")
    return folder, train, val, [json.loads(line) for line in val.read_text().splitlines()]


@pytest.fixture(scope="module")
def vision_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    return {m.name: save_vision_model(m, root / m.name) for m in VISION_MODELS + REAL_PROCESSORS}


def as_litft_builds_it(folder):
    """The model as the jobs build a vision-language model (tests/architectures.py's build, transformers' SDPA), the batch's
    image tensors from its processor at the step."""
    from litft.data.images import load_processor
    from litft.model.vision import ImageInputs
    from tests.architectures import as_litft_builds_it as built

    lm = built(folder, attention="sdpa", images=True)
    lm.images = ImageInputs(load_processor(str(folder)), lm.hf_model)
    return lm


@pytest.mark.parametrize("model", VISION_MODELS + REAL_PROCESSORS, ids=[m.name for m in VISION_MODELS + REAL_PROCESSORS])
def test_loss_and_gradients_equal_transformers(model, vision_folders, shapes):
    """Micro-batches of two padded rows (images batched as the processor batches them, one row without an image): the summed
    loss to 1e-5 and every gradient to 1e-4 of its norm (the key biases' gradients are zero in exact arithmetic: noise)."""
    folder, _, val, records = shapes
    prepared = JSON(json_path=val, val_path=val).tokenize(load_tokenizer(str(vision_folders[model.name])), 0)
    assert len(prepared.val) == len(records) and [len(s["images"]) for s in prepared.val] == [1, 1, 1, 1, 0]
    lm = as_litft_builds_it(vision_folders[model.name])
    total = 0.0
    for start in range(0, len(prepared.val), 2):
        loss = lm.loss_sum(collate(prepared.val[start : start + 2], pad_id=0))
        loss.backward()
        total += loss.item()
    expected, count, expected_grads = reference_loss(vision_folders[model.name], records, folder)
    assert sum(int((s["labels"] != -100).sum()) for s in prepared.val) == count
    assert abs(total - expected.item()) <= 1e-5 * abs(expected.item()), (total, expected.item())
    grads = {n: p.grad for n, p in lm.hf_model.named_parameters() if p.grad is not None}
    assert grads.keys() == expected_grads.keys()
    scale = max(g.norm() for g in expected_grads.values())
    for name, grad in expected_grads.items():
        assert (grads[name] - grad).norm() <= 1e-4 * grad.norm() + 1e-6 * scale, name


# Where full fine-tuning's checks find each model's image encoder (frozen) and projector (trained), by parameter name.
ENCODER_AND_PROJECTOR = {"paddleocr-vl": (".visual.vision_model.", ".projector."), "qwen3.5": (".visual.blocks.", ".visual.merger.")}


@pytest.mark.parametrize("job, name", [("finetune_lora", "gemma3"), ("finetune_full", "paddleocr-vl"), ("finetune_full", "qwen3.5"),
                                       ("finetune_lora", "qwen3.5")])
def test_jobs_train_images_and_export_what_transformers_loads(job, name, vision_folders, shapes, tmp_path, capsys):
    """Step 0's val_loss is the model's own; full fine-tuning keeps the image encoder frozen and trains the projector; LoRA
    adapts the language model only. The export loads with AutoModelForImageTextToText and AutoProcessor (peft's PeftModel
    on the base for the adapter) and gives the run's last val_loss. A Qwen3.5 folder, which trains as its text model on
    text records, trains and exports its image-text model on these image records."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from litft.cli.jobs import JOBS
    from litft.config import EvalArgs, TrainArgs

    folder, train, val, records = shapes
    source = vision_folders[name]
    result = JOBS[job](str(source), out_dir=tmp_path / "run", data=JSON(json_path=train, val_path=val),
                       train=TrainArgs(global_batch_size=4, micro_batch_size=2, max_steps=2, save_interval=None, learning_rate=1e-2),
                       eval=EvalArgs(interval=10**6, initial_validation=True), accelerator="cpu", logger_name="csv")
    first, last = [h["val_loss"] for h in result.history if "val_loss" in h]
    if name == "qwen3.5" and job == "finetune_lora":  # the adapter loads on the class it adapted (litft chat, generate, evaluate)
        from litft.cli.chat import load_for_chat
        from litft.model.vision import sees_images

        model, _, _ = load_for_chat(str(result.final_dir), torch.float32)
        assert type(model.get_base_model()).__name__ == "Qwen3_5ForConditionalGeneration" and sees_images(model.get_base_model().config)
    if name == "qwen3.5" and job == "finetune_full":
        assert "trains as its text model" not in capsys.readouterr().out
        exported_config = json.loads((result.final_dir / "config.json").read_text())
        assert exported_config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "vision_config" in exported_config
        # Its checkpoints say so: a resume on text records (which would build the text model) is one line.
        import dataclasses

        from litft.checkpoint.format import CheckpointMeta

        newest = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1]
        meta = CheckpointMeta.read(newest)
        assert meta.image_text_model
        with pytest.raises(LitftError, match="was trained on image records .*resume it with data of the same kind"):
            meta.check_fits(newest, dataclasses.replace(meta, image_text_model=False))
    expected, count, _ = reference_loss(source, records, folder)
    assert abs(first - expected.item() / count) <= 1e-5 * first
    AutoProcessor.from_pretrained(result.final_dir)  # the processor travels with the export
    base = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32, attn_implementation="eager")
    if job == "finetune_lora":
        adapted = load_file(str(result.final_dir / "adapter_model.safetensors"))
        assert adapted and all(".language_model." in key for key in adapted)
        exported = PeftModel.from_pretrained(base, result.final_dir)
    else:
        exported = AutoModelForImageTextToText.from_pretrained(result.final_dir, attn_implementation="eager")
        before, after = base.state_dict(), exported.state_dict()
        encoder, projector = ENCODER_AND_PROJECTOR[name]
        assert before.keys() == after.keys() and any(encoder in k for k in before) and any(projector in k for k in before)
        assert all(torch.equal(before[k], after[k]) for k in before if encoder in k)
        assert not all(torch.equal(before[k], after[k]) for k in before if projector in k)
    again, _, _ = reference_loss(source, records, folder, model=exported)
    assert abs(again.item() / count - last) <= 1e-5 * last


def test_bad_image_records_are_refused_in_one_line(vision_folders, shapes, tmp_path):
    """A missing image file, an image part without its image, an image that does not decode, an image record that is not a
    conversation, a text that writes the image placeholder: one line naming the record (and the file), before any model is
    built; image data on a text-only model too."""
    from litft.cli.jobs import JOBS
    from litft.config import TrainArgs

    folder, train, _, _ = shapes
    tokenizer = load_tokenizer(str(vision_folders["gemma3"]))
    good = json.loads(train.read_text().splitlines()[0])
    (tmp_path / "broken.png").write_bytes(b"not a png")
    shape_image("red", __import__("random").Random(0)).save(tmp_path / "fine.png")
    cases = {
        "does not exist": dict(good, images=["missing.png"]),
        r"1 image part\(s\) in its turns and 2 image\(s\)": dict(good, images=["fine.png", "fine.png"]),
        "does not decode as an image": dict(good, images=["broken.png"]),
        "no 'messages' list": {"prompt": "What colour?", "completion": "red", "images": ["fine.png"]},
    }
    for says, record in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(record) + "\n")
        with pytest.raises(LitftError, match=says) as caught:
            JSON(json_path=path, val_path=path).tokenize(tokenizer, 0)
        assert "record 0 of" in str(caught.value) and "\n" not in str(caught.value)
    # A text record that writes the image placeholder, which the processor takes for a picture that is not there.
    literal = {"messages": [{"role": "user", "content": "What does <image> do in a prompt?"}, {"role": "assistant", "content": "It marks a picture."}]}
    path.write_text(json.dumps(dict(good, images=["fine.png"])) + "\n" + json.dumps(literal) + "\n")
    with pytest.raises(LitftError, match=r"^record 1 of .*refuses it .*'<image>' \(the model's image placeholder\)[^\n]*$"):
        JSON(json_path=path, val_path=path).tokenize(load_tokenizer(str(vision_folders["llava"])), 0)
    with pytest.raises(LitftError, match="has no image processor"):
        JOBS["finetune_full"]("litft-tiny", out_dir=tmp_path / "text", data=JSON(json_path=train), accelerator="cpu", logger_name="csv",
                              train=TrainArgs(max_steps=1))
    assert not (tmp_path / "text").exists()


def test_image_models_refuse_what_they_cannot_run_yet(vision_folders, shapes, tmp_path):
    """Packing and scoring by generation: one line each, before anything is written."""
    from litft.cli.jobs import JOBS
    from litft.config import EvalArgs

    _, train, _, _ = shapes
    source = str(vision_folders["llava"])
    with pytest.raises(LitftError, match="a sample per padded row"):
        JOBS["finetune_full"](source, out_dir=tmp_path / "a", data=JSON(json_path=train, packing=True), accelerator="cpu", logger_name="csv")
    with pytest.raises(LitftError, match="not scored by generation yet"):
        JOBS["finetune_full"](source, out_dir=tmp_path / "c", data=JSON(json_path=train), eval=EvalArgs(score_samples=4), accelerator="cpu",
                              logger_name="csv")
    # Mllama computes a record beside one with another number of images otherwise than alone (by hand: a one-image record
    # beside a two-image one, logits 1.4 apart): every record needs the same number, at least one.
    with pytest.raises(LitftError, match=r"^the data's records carry 0 to 1 images, and mllama computes"):
        JOBS["finetune_lora"](str(vision_folders["mllama"]), out_dir=tmp_path / "d", data=JSON(json_path=train, val_path=shapes[2]),
                              accelerator="cpu", logger_name="csv")
    assert not any((tmp_path / name).exists() for name in "acd")
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_rl_prompts_about_images_keep_their_pictures_and_refuse_bad_records_in_one_line(vision_folders, tmp_path):
    """GRPO's prompts in TRL's vision layout: rendered by the processor with the generation prompt (image tokens expanded,
    as a prompt of the SFT path), the image files and the rendered text kept for generate and training, the other columns
    (image paths included) for the rewards; a text prompt beside them; a prompt whose image parts and images disagree: one line."""
    from transformers import AutoProcessor

    from litft.data import Prompts
    from tests.vision_models import write_shape_prompts

    path = write_shape_prompts(tmp_path, 3, 0, text_only=1)
    tokenizer = load_tokenizer(str(vision_folders["paddleocr-vl"]))
    prepared = Prompts(path=str(path), val_path=str(path)).tokenize(tokenizer, 0)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    processor = AutoProcessor.from_pretrained(vision_folders["paddleocr-vl"])
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    for sample, record in zip(prepared.train, records):
        text = processor.apply_chat_template(record["prompt"], tokenize=False, add_generation_prompt=True)
        assert sample["text"] == text and len(sample["images"]) == len(record.get("images", []))
        assert int((sample["input_ids"] == image_token).sum() > 0) == int("images" in record)
        assert json.loads(sample["columns"]["answer"]) == record["answer"] and json.loads(sample["messages"]) == record["prompt"]
        if "images" in record:
            assert json.loads(sample["columns"]["images"]) == [str(tmp_path / p) for p in record["images"]]
    assert prepared.scoring == []  # scoring by generation reads text prompts
    # Told before the model is built (a Qwen3.5 folder builds its image-text model for them); text prompts name none.
    from litft.data import Mix, TinyPrompts

    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"prompt": "Name a colour.", "answer": "red"}) + "\n")
    assert Prompts(path=str(path)).names_images() and not Prompts(path=str(text)).names_images() and not TinyPrompts().names_images()
    assert Mix(sources=[Prompts(path=str(text)), Prompts(path=str(path))]).names_images()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(dict(records[0], images=records[0]["images"] * 2)) + "\n")
    with pytest.raises(LitftError, match=r"record 0 of .*1 image part\(s\) in its turns and 2 image\(s\)"):
        Prompts(path=str(bad), val_path=str(bad)).tokenize(tokenizer, 0)


def test_a_datasets_image_column_gives_the_samples_of_the_same_jsonl(vision_folders, shapes, tmp_path):
    """--data HF on a dataset whose ``images`` column holds ``datasets`` Image values (saved with save_to_disk) tokenizes to the
    very samples the JSON file gives, read whole or streamed."""
    import datasets

    from litft.data import HF

    folder, _, val, records = shapes
    rows = [dict(r, images=[str(folder / p) for p in r.get("images", [])]) for r in records if r.get("images") and "messages" in r]
    table = datasets.Dataset.from_list(rows).cast_column("images", datasets.List(datasets.Image()))
    datasets.DatasetDict({"train": table, "validation": table}).save_to_disk(str(tmp_path / "hf"))
    (tmp_path / "text.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "an image?"}, {"role": "assistant", "content": "no"}]}) + "\n")
    path = tmp_path / "some.jsonl"
    path.write_text("".join(json.dumps(dict(r, images=[str(folder / p) for p in r["images"]])) + "\n" for r in rows))
    tokenizer = load_tokenizer(str(vision_folders["idefics3"]))
    ours = HF(path=str(tmp_path / "hf")).load_or_tokenize(tokenizer, 0).val
    theirs = JSON(json_path=path, val_path=path).tokenize(tokenizer, 0).val
    assert len(ours) == len(theirs) == len(rows) > 1

    def same(a, b):
        return torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"]) and a["images"] == b["images"]

    assert all(same(a, b) for a, b in zip(ours, theirs))
    assert HF(path=str(tmp_path / "hf")).names_images() and HF(path=str(tmp_path / "hf"), streaming=True).names_images()
    assert JSON(json_path=path).names_images() and not JSON(json_path=tmp_path / "text.jsonl").names_images()
    # Streamed (--data.streaming true): validation records from the head of the split, training records encoded as reached,
    # the same samples; one longer than --data.max_seq_length with its image tokens (never cut) carries no target.
    streamed = HF(path=str(tmp_path / "hf"), streaming=True, val_samples=len(rows)).load_or_tokenize(tokenizer, 0)
    assert streamed.train.images and streamed.scoring == [] and all(same(a, b) for a, b in zip(streamed.val, theirs))
    records = list(streamed.train.stream.records(0, 0))
    assert all(same(streamed.train.encode(row, i), theirs[i]) for i, row in records)
    longest = max(len(s["input_ids"]) for s in theirs)
    short = HF(path=str(tmp_path / "hf"), streaming=True, val_samples=0, max_seq_length=longest - 1).load_or_tokenize(tokenizer, 0)
    cut = [short.train.encode(row, i) for i, row in records]
    assert any(s["images"] == [] and (s["labels"] == -100).all() and len(s["input_ids"]) == 1 for s in cut)
    assert any(same(s, theirs[i]) for s, (i, _) in zip(cut, records))
    # A run on the stream alone (no validation records to tell): its batches get their image tensors from the processor, and
    # one resumed from its step-2 checkpoint trains steps 3 and 4 on the same records to the same losses, bitwise.
    from litft.cli.jobs import JOBS
    from litft.config import EvalArgs, TrainArgs

    def run(out, **kw):
        JOBS["finetune_lora"](str(vision_folders["idefics3"]), out_dir=out, accelerator="cpu", logger_name="csv",
                              data=HF(path=str(tmp_path / "hf"), streaming=True, val_samples=0),
                              train=TrainArgs(global_batch_size=2, micro_batch_size=1, max_steps=4, save_interval=2, record_sample_ids=True),
                              eval=EvalArgs(interval=10**6, initial_validation=False, final_validation=False), **kw)
        ids = [json.loads(line)["ids"] for line in (out / "logs" / "samples" / "rank-00000.jsonl").read_text().splitlines()]
        return {int(r["step"]): r["loss"] for r in read_metrics(out) if "loss" in r}, ids

    whole, whole_ids = run(tmp_path / "run")
    resumed, resumed_ids = run(tmp_path / "resumed", resume=str(tmp_path / "run" / "checkpoints" / "step-00000002"))
    assert sorted(whole) == [1, 2, 3, 4] and sorted(resumed) == [3, 4] and resumed_ids == whole_ids[2:]
    assert [resumed[s] for s in (3, 4)] == [whole[s] for s in (3, 4)]


def test_qlora_keeps_the_image_encoder_and_projector_in_16_bits(vision_folders):
    """A 4-bit base quantizes the language model's linear layers only; LoRA adapts those, and the encoder's stay as they were."""
    import bitsandbytes as bnb

    from litft.config import LoraArgs
    from litft.model.loading import load_config
    from litft.run.build import build_model

    for name in ("paddleocr-vl", "idefics3"):
        model = build_model(load_config(str(vision_folders[name])), "bf16-true", LoraArgs(quantize="bnb.nf4"), False).get_base_model()
        quantized = {n.removesuffix(".base_layer") for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
        linear = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
        assert quantized and all(".language_model." in n or ".text_model." in n for n in quantized), name
        assert any(".vision_model." in n for n in linear) and not any(n.endswith("lm_head") for n in quantized), name
        adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_modules() if ".lora_A." in n}
        assert adapted and adapted <= quantized, name


def test_zero3_readies_trained_projectors_to_gather_once_a_forward(vision_folders):
    """ZeRO-3 gathers at every call of a layer: PaddleOCR-VL's projector runs its layers once over all images, giving what
    transformers' image-by-image loop gives (images of different sizes); a layer called twice in a forward is refused."""
    from transformers import AutoModelForImageTextToText

    from litft.model.vision import ready_for_zero3

    model = AutoModelForImageTextToText.from_pretrained(vision_folders["paddleocr-vl"], dtype=torch.float32)
    projector = model.model.projector
    grids = torch.tensor([[1, 4, 6], [1, 8, 4], [1, 2, 2]])
    features = torch.randn(int(grids.prod(dim=1).sum()), projector.pre_norm.normalized_shape[0], requires_grad=True,
                           generator=torch.Generator().manual_seed(0))
    expected = projector(features, grids)
    (grad_expected,) = torch.autograd.grad(expected.square().sum(), features)
    ready_for_zero3(model)
    calls = []
    projector.linear_1.register_forward_pre_hook(lambda *_: calls.append(1))
    got = projector(features, grids)
    (grad_got,) = torch.autograd.grad(got.square().sum(), features)
    assert len(calls) == 1 and got.shape == expected.shape == (6 + 8 + 1, model.config.text_config.hidden_size)
    # One product of 15 rows where the loop makes three of 6, 8 and 1: the BLAS blocks differ, so each 128-term fp32 sum comes
    # in another order (seen: 1.8e-6 apart on one machine, 0 on another); bounded by 1e-5 of the largest value.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    torch.testing.assert_close(grad_got, grad_expected, rtol=1e-5, atol=1e-5 * float(grad_expected.abs().max()))
    # Calls are counted within each forward of the model (here made by a hook at its start), not a recompute's outside it.
    model.model.register_forward_pre_hook(lambda *_: [projector(features, grids)] and None)
    text = torch.tensor([[1, 2]])
    model.model(input_ids=text), model.model(input_ids=text)
    norm = projector.pre_norm
    projector.forward = lambda image_features, grid: norm(norm(image_features))  # a layer twice, as a loop per image would
    projector(features, grids)  # outside a forward of the model: a checkpointed layer's recompute, say
    with pytest.raises(LitftError, match=r"^model\.projector\.pre_norm runs more than once in a forward .*--strategy fsdp"):
        model.model(input_ids=text)


def image_step(folder, val, precision="32-true", lora=None, compile="false", **train):
    """One forward and backward of a vision-language model's module over the records of ``val`` (two micro-batches of two):
    the summed loss, the gradients and the module."""
    from litft.config import Layout, TrainArgs
    from litft.data.images import load_processor
    from litft.model.vision import ImageInputs
    from litft.parallel.strategies import SingleDevice
    from litft.run.build import build_module
    from litft.run.plan import Facts, RunPlan

    train = TrainArgs(**train)
    plan = RunPlan.decide(Facts(precision=precision, sees_images=True, compile=compile))
    lm, fill, _ = build_module(str(folder), plan, lora, train, 1, random_init=False, seed=0, device=torch.device("cpu"),
                               strategy=SingleDevice(Layout(), "cpu", precision, train))
    fill(lm)
    lm.train()
    lm.images = ImageInputs(load_processor(str(folder)), lm.hf_model)
    samples = JSON(json_path=val, val_path=val).tokenize(load_tokenizer(str(folder)), 0).val[:4]
    torch.manual_seed(2)  # the adapters' dropout masks
    total = 0.0
    for start in (0, 2):
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = lm.loss_sum(collate(samples[start : start + 2], pad_id=0))
        loss.backward()
        total += loss.detach()
    return total, {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}, lm


@pytest.mark.parametrize("name", ["gemma3", "paddleocr-vl"])
def test_activation_offload_and_tiled_mlp_on_images_give_the_plain_step(name, vision_folders, shapes):
    """Offloaded, the image encoder's saved tensors move too and the step is the plain one bit for bit (full fine-tuning in
    fp32; LoRA with dropout, checkpointed, in bf16-mixed); tiled, the MLPs (each token's own) give the untiled step."""
    from litft.config import LoraArgs

    folder, val = vision_folders[name], shapes[2]
    loss, grads, _ = image_step(folder, val)
    loss_off, grads_off, lm = image_step(folder, val, activation_offload=True)
    assert torch.equal(loss, loss_off) and grads.keys() == grads_off.keys() and lm.offloaded_bytes > 0
    assert all(torch.equal(grads[n], grads_off[n]) for n in grads)
    loss_tiled, grads_tiled, lm = image_step(folder, val, tiled_mlp=True)
    assert lm.model.tiled_mlps >= lm.hf_model.config.text_config.num_hidden_layers  # Gemma 3's encoder's (SigLIP's) too
    torch.testing.assert_close(loss_tiled, loss, rtol=1e-6, atol=0)
    for n in grads:  # summed chunk by chunk: float rounding apart
        assert torch.linalg.vector_norm(grads_tiled[n] - grads[n]) <= 1e-5 * torch.linalg.vector_norm(grads[n]), n
    lora = LoraArgs(r=4, alpha=8, dropout=0.1, target_modules="all-linear")
    loss, grads, _ = image_step(folder, val, "bf16-mixed", lora, gradient_checkpointing=True)
    loss_off, grads_off, _ = image_step(folder, val, "bf16-mixed", lora, gradient_checkpointing=True, activation_offload=True)
    assert torch.equal(loss, loss_off) and grads.keys() == grads_off.keys()
    assert all(torch.equal(grads[n], grads_off[n]) for n in grads)


@pytest.mark.parametrize("model", VISION_MODELS, ids=[m.name for m in VISION_MODELS])
def test_the_language_models_blocks_trace_as_one_graph_each(model, vision_folders, shapes):
    """--compile on a vision-language model compiles its language model's blocks (``language_model_blocks``; the image
    encoder's run eager): each traces whole (``fullgraph=True``; dynamo alone, no code generated) on padded rows with
    images, a row without one among them, and gives the eager blocks' loss and gradients."""
    from litft.model.weights import language_model_blocks
    from litft.model.recurrent import text_config

    folder = vision_folders[model.name]
    prepared = JSON(json_path=shapes[2], val_path=shapes[2]).tokenize(load_tokenizer(str(folder)), 0)
    lm = as_litft_builds_it(folder)
    blocks = language_model_blocks(lm.hf_model)
    assert len(blocks) == text_config(lm.hf_model.config).num_hidden_layers

    batches = [prepared.val[0:2], prepared.val[3:5], prepared.val[2:3]]  # the text-only record 4 beside image record 3

    def step():
        lm.zero_grad()
        losses = [lm.loss_sum(collate(batch, pad_id=0)) for batch in batches]
        sum(losses).backward()
        return [loss.item() for loss in losses], {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}

    from torch._dynamo.utils import counters

    eager_losses, eager_grads = step()
    torch._dynamo.reset()
    counters.clear()  # reset() leaves the process's counters
    try:
        for block in blocks:
            block.compile(fullgraph=True, backend="eager")
        losses, grads = step()  # a graph break raises here, naming the line that broke it
        assert counters["stats"]["unique_graphs"] >= 1  # these blocks ran through dynamo (fullgraph frames are not counted as frames)
    finally:
        torch._dynamo.reset()
    assert losses == pytest.approx(eager_losses, rel=1e-6) and grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        assert torch.linalg.vector_norm(grad - eager_grads[name]) <= 1e-5 * torch.linalg.vector_norm(eager_grads[name]) + 1e-8, name


def test_compiled_language_model_blocks_give_the_eager_step_on_images(vision_folders, shapes):
    """--compile true on a vision-language model (inductor's code, on the CPU): the step's loss and gradients as eager
    blocks give them."""
    folder, val = vision_folders["llava"], shapes[2]
    from torch._dynamo.utils import counters

    loss, grads, _ = image_step(folder, val)
    torch._dynamo.reset()
    counters.clear()  # reset() leaves the process's counters
    try:
        loss_compiled, grads_compiled, lm = image_step(folder, val, compile="true")
        assert counters["frames"]["ok"] >= 1
    finally:
        torch._dynamo.reset()
    assert lm.compiled_kinds == 1
    torch.testing.assert_close(loss_compiled, loss, rtol=1e-5, atol=0)
    assert grads_compiled.keys() == grads.keys()
    for n in grads:
        assert torch.linalg.vector_norm(grads_compiled[n] - grads[n]) <= 1e-4 * torch.linalg.vector_norm(grads[n]) + 1e-8, n


@pytest.mark.parametrize("name", ["llava", "qwen3.5"])
def test_generate_with_an_image_answers_as_transformers_generates(name, vision_folders, shapes):
    """litft generate --image: the picture in the first user turn through the model's processor and chat template; greedy,
    the same tokens as transformers' generate on what the processor makes of that conversation (a Qwen3.5 folder loads its
    image-text model for it). A text model refuses it."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from litft.cli.chat import Conversation

    folder, _, _, records = shapes
    image = folder / records[0]["images"][0]
    source = vision_folders[name]
    conversation = Conversation(str(source), None, 6, 0.0, 1.0, "chat", "cpu", 0, image=image)
    answer = conversation.answer("What colour is the shape?")
    processor = AutoProcessor.from_pretrained(source)
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}]
    text = processor.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[[Image.open(image).convert("RGB")]], return_tensors="pt", add_special_tokens=False)
    model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32).eval()
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=processor.tokenizer.eos_token_id,
                         pad_token_id=processor.tokenizer.pad_token_id)
    assert answer == processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    if name != "llava":
        return
    with pytest.raises(LitftError, match="reads text only"):
        Conversation("litft-tiny", None, 6, 0.0, 1.0, "chat", "cpu", 0, image=image)


def test_dpo_on_pairs_about_images_starts_at_log_2_as_its_reference(vision_folders, shapes, tmp_path):
    """DPO on TRL's image-pair layout: each pair's two rows carry the prompt's image; the reference scores the same model, so
    step 0's validation loss is -log sigmoid(0) = log 2, to float rounding, and the policy then moves off it."""
    import math

    from litft.cli.jobs import JOBS
    from litft.config import EvalArgs, TrainArgs
    from litft.data import Preferences
    from litft.objectives.args import ObjectiveArgs

    folder, train, _, _ = shapes
    pairs = []
    for line in train.read_text().splitlines()[:8]:
        record = json.loads(line)
        prompt = record["messages"][:1] if "messages" in record else record["prompt"]
        answer = (record["messages"][1] if "messages" in record else record["completion"][0])["content"][0]["text"]
        pairs.append({"prompt": prompt, "chosen": answer, "rejected": "purple" if answer != "purple" else "red",
                      "images": [str(folder / p) for p in record["images"]]})
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    result = JOBS["finetune_lora"](str(vision_folders["idefics3"]), out_dir=tmp_path / "run", objective=ObjectiveArgs(name="dpo"),
                                   data=Preferences(path=str(path), val_path=str(path)), accelerator="cpu", logger_name="csv",
                                   train=TrainArgs(global_batch_size=4, micro_batch_size=2, max_steps=2, save_interval=None, learning_rate=1e-2),
                                   eval=EvalArgs(interval=10**6, initial_validation=True))
    first, last = [h["val_loss"] for h in result.history if "val_loss" in h]
    assert abs(first - math.log(2)) <= 1e-6 and last != first


def test_a_resumed_image_run_matches_the_uninterrupted_one(vision_folders, shapes, tmp_path):
    """Four steps of full fine-tuning on image records, against two, a checkpoint, and two more resumed from it: the same
    losses (the same batches, images made again from the checkpointed order) and the same exported weights."""
    from safetensors.torch import load_file

    from litft.cli.jobs import JOBS
    from litft.config import EvalArgs, TrainArgs

    _, train, val, _ = shapes
    common = dict(data=JSON(json_path=train, val_path=val), accelerator="cpu", logger_name="csv", eval=EvalArgs(interval=10**6, final_validation=False))
    steps = lambda **kw: TrainArgs(global_batch_size=4, micro_batch_size=2, learning_rate=1e-2, warmup_steps=1, max_steps=4, **kw)  # noqa: E731
    source = str(vision_folders["gemma3"])
    whole = JOBS["finetune_full"](source, out_dir=tmp_path / "whole", train=steps(save_interval=2), **common)
    JOBS["finetune_full"](source, out_dir=tmp_path / "cut", train=steps(save_interval=2, stop_after_steps=2), **common)
    resumed = JOBS["finetune_full"](source, out_dir=tmp_path / "cut", train=steps(save_interval=2), resume="auto", **common)
    assert step_losses(tmp_path / "cut") == pytest.approx(step_losses(tmp_path / "whole"), rel=1e-6)
    assert len(step_losses(tmp_path / "whole")) == 4
    ours, theirs = load_file(str(resumed.final_dir / "model.safetensors")), load_file(str(whole.final_dir / "model.safetensors"))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_which_configs_train_as_vision_language_models(vision_folders):
    """A model trains as a VLM where its causal-LM class is the image-text-to-text model itself (Gemma 3), it has none
    (LLaVA...), or it is Mllama or Llama 4; where transformers' causal-LM class is the text model alone (Qwen3.5), litft trains
    that on text records and the image-text model on image records, the folder's config (which names the latter) read as the
    former. A VLM's rows are padded whatever attention is asked for: its own forward makes the positions and masks."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from litft.model.loading import load_config
    from litft.model.vision import auto_model_class, check_images_fit, sees_images
    from litft.run.plan import PADDED, Facts, RunPlan

    assert sees_images(load_config(str(vision_folders["gemma3"]))) and sees_images(load_config(str(vision_folders["llava"])))
    assert auto_model_class(load_config(str(vision_folders["llava"]))) is AutoModelForImageTextToText
    assert auto_model_class(load_config(str(vision_folders["gemma3"]))) is AutoModelForCausalLM  # its causal-LM class is the VLM
    mllama = load_config(str(vision_folders["mllama"]))  # its causal-LM class is the text model: built as the VLM all the same
    assert sees_images(mllama) and auto_model_class(mllama) is AutoModelForImageTextToText
    llama4 = transformers.Llama4Config()
    assert sees_images(llama4) and auto_model_class(llama4) is AutoModelForImageTextToText
    qwen = transformers.Qwen3_5Config()
    assert not sees_images(qwen) and auto_model_class(qwen) is AutoModelForCausalLM
    from litft.model.vision import reading_images

    hub = load_config(str(vision_folders["qwen3.5"]))  # saved as Qwen3_5ForConditionalGeneration, read as the text model
    assert hub.architectures == ["Qwen3_5ForCausalLM"] and not sees_images(hub) and auto_model_class(hub) is AutoModelForCausalLM
    images = reading_images(hub)
    assert sees_images(images) and auto_model_class(images) is AutoModelForImageTextToText and not sees_images(hub)
    assert reading_images(load_config(str(vision_folders["gemma3"]))).architectures == ["Gemma3ForConditionalGeneration"]
    # What a checkpoint records: the composite's image-text model only, not an ordinary VLM (whose older checkpoints lack the
    # field and must still resume).
    from litft.model.vision import reads_images_instead_of_text

    assert reads_images_instead_of_text(images) and not reads_images_instead_of_text(hub)
    assert not reads_images_instead_of_text(load_config(str(vision_folders["gemma3"])))
    # A composite of that kind whose image-text model is not checked: its text model, and image records refused in one line.
    dots = transformers.Dots3NoteConfig()
    assert reading_images(dots) is dots and not sees_images(dots)
    with pytest.raises(LitftError, match="dots3_note's text model: its image-text model .* is not checked against transformers yet"):
        check_images_fit(dots, True)
    # Image records on a model trained as text: one line, which says whether the model itself could see them.

    for config, says in ((qwen, "this run built qwen3_5's text model"), (transformers.LlamaConfig(), "llama models read text only")):
        with pytest.raises(LitftError, match=says):
            check_images_fit(config, True)
        check_images_fit(config, False)
    flash = Facts(sees_images=True, attention="flash_attention_2", installed=frozenset({"flash_attn"}), precision="bf16-mixed", accelerator="cuda")
    assert RunPlan.decide(flash).rows == PADDED


def test_lora_targets_by_short_name_stay_in_the_language_model(vision_folders):
    """--lora_target_modules [q_proj, v_proj] on a VLM: the language model's q and v projections (the encoder has its own),
    and the encoder's too once --train.vision_encoder trained."""
    from litft.config import LoraArgs
    from litft.model.loading import load_config
    from litft.model.lora import resolved_targets
    from litft.model.weights import skeleton

    model = skeleton(load_config(str(vision_folders["llava"])), torch.float32)
    lora = LoraArgs(target_modules=["q_proj", "v_proj"])
    names = resolved_targets(lora, model)
    assert names and all(".language_model." in n and n.rsplit(".", 1)[1] in ("q_proj", "v_proj") for n in names)
    assert any(".vision_tower." in n for n in resolved_targets(lora, model, adapt_encoder=True))


def test_tokens_past_a_rows_text_take_text_types_and_the_last_text_tokens_image_mask():
    """An RL rollout's completion (past the prompt the processor saw): its per-token types are text (0), and Mllama's
    cross-attention mask goes on as the prompt's last token has it, as generate extends it (by hand: GRPO on Mllama scores
    its samples within 5e-7 of the sampler's log-probs)."""
    from litft.model.vision import ImageInputs

    inputs = ImageInputs.__new__(ImageInputs)
    inputs.takes, inputs.encoder = {"token_type_ids", "cross_attention_mask"}, None
    mask = torch.tensor([[[[1, 0]], [[1, 1]], [[1, 1]]], [[[0, 0]], [[1, 0]], [[0, 0]]]])  # rows x tokens x images x tiles
    made = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "token_type_ids": torch.tensor([[0, 1, 1], [0, 1, 0]]), "cross_attention_mask": mask}
    out = inputs.kept(made, 5, "cpu", covered=[3, 2])
    assert out["token_type_ids"].tolist() == [[0, 1, 1, 0, 0], [0, 1, 0, 0, 0]]
    assert torch.equal(out["cross_attention_mask"][0], torch.cat([mask[0], mask[0, 2:].expand(2, 1, 2)]))
    assert torch.equal(out["cross_attention_mask"][1], torch.cat([mask[1, :2], mask[1, 1:2].expand(3, 1, 2)]))
    assert torch.equal(inputs.kept(made, 3, "cpu")["cross_attention_mask"], mask)  # rows whose text covers them: as made


def test_llama4s_complex_rotary_buffer_and_pixels_keep_the_dtypes_its_encoder_needs(vision_folders, shapes):
    """Llama 4's image encoder keeps its rotary frequencies in a complex buffer: a cast of the whole model to the run's dtype
    (Fabric's, under bf16-true and DeepSpeed) keeps only their real part, and so does a fill into a buffer cast on the meta
    device before it (FSDP's order): the trainer's repair after setup makes them whole again. And its encoder does not cast
    pixels itself: they come in its dtype."""
    from transformers import AutoModelForImageTextToText

    from litft.data.images import load_processor
    from litft.model.loading import keep_rotary_fp32, load_config
    from litft.model.vision import ImageInputs, answer_as_transformers_expects
    from litft.model.weights import Materializer, skeleton

    folder = vision_folders["llama4"]
    expected = AutoModelForImageTextToText.from_pretrained(folder).vision_model.rotary_embedding.freqs_ci
    model = skeleton(load_config(str(folder)), torch.float32)
    fill = Materializer(model, model, None, seed=0)
    model.to(torch.bfloat16)  # on the meta device, then the fill
    fill(model)
    assert not model.vision_model.rotary_embedding.freqs_ci.is_complex()
    assert keep_rotary_fp32(model) == 2 and torch.equal(model.vision_model.rotary_embedding.freqs_ci, expected)  # and the text's
    model.to(torch.bfloat16)  # the fill, then the cast
    assert keep_rotary_fp32(model) == 2 and torch.equal(model.vision_model.rotary_embedding.freqs_ci, expected)
    assert keep_rotary_fp32(model) == 0

    answer_as_transformers_expects(model)
    _, _, val, _ = shapes
    batch = collate(JSON(json_path=val, val_path=val).tokenize(load_tokenizer(str(folder)), 0).val[:2], pad_id=0)
    vision = ImageInputs(load_processor(str(folder)), model)(batch)
    assert vision["pixel_values"].dtype == torch.bfloat16
    assert model(input_ids=batch["input_ids"], **vision).logits.isfinite().all()


def test_the_estimate_counts_each_images_tokens_by_the_models_processor(vision_folders):
    """litft estimate --image_size: the processor's own count of an image's tokens joins each sample's row, and the trace runs
    that longer row (PaddleOCR-VL: a 32 x 32 image is 2 x 2 merged patches, a 48 x 48 one 3 x 3, each between its begin
    and end tokens). On a text model, or with a size that is not one, the flag is refused in one line."""
    from litft.estimate import memory_plan
    from litft.model.tiny import ensure_tiny_model

    folder = str(vision_folders["paddleocr-vl"])
    plans = {size: memory_plan(model=folder, accelerator="cpu", seq_len=64, image_size=size, images=2) for size in ("32", "48x48", None)}
    assert [plans[s]["tokens_per_image"] for s in ("32", "48x48", None)] == [4 + 2, 9 + 2, 0]
    assert [plans[s]["row_len"] for s in ("32", "48x48", None)] == [64 + 2 * 6, 64 + 2 * 11, 64]
    peaks = [plans[s]["activations"]["peak"] for s in (None, "32", "48x48")]
    assert peaks == sorted(peaks) and len(set(peaks)) == 3
    # A Qwen3.5 folder: its text model without the flag, its image-text model (the image encoder counted) with it.
    qwen = {size: memory_plan(model=str(vision_folders["qwen3.5"]), accelerator="cpu", seq_len=64, image_size=size) for size in ("32", None)}
    assert qwen["32"]["tokens_per_image"] == 4 + 2 and qwen["32"]["parameters"]["total"] > qwen[None]["parameters"]["total"]
    assert qwen["32"]["vision"] and not qwen[None]["vision"]
    for model, size, says in ((str(ensure_tiny_model()), "32", "is for vision-language models"), (folder, "big", "give WIDTHxHEIGHT")):
        with pytest.raises(LitftError, match=says):
            memory_plan(model=model, accelerator="cpu", image_size=size)


@pytest.mark.parametrize("name", ["idefics3", "qwen3.5"])
def test_the_estimates_image_encoder_trace_allocates_what_a_real_forward_allocates(name, vision_folders):
    """The images through the encoder on fake weights (the processor's tensors real, so that steps taken from their values
    run): the same peak of live bytes and the same bytes left for the step as the encoder's real forward on real weights,
    followed by the same ledger (Idefics3: tiles found empty from the pixels; Qwen3.5: patches per image from the grid).
    The estimate adds what is left to the language model's peak; Mllama, whose encoder runs only inside its forward, is
    estimated without it."""
    from transformers import AutoModelForImageTextToText

    from litft.data.images import load_processor
    from litft.estimate import memory_plan
    from litft.estimate.trace import LiveStorages, _with_layers, trace_image_encoder
    from litft.model.loading import load_config
    from litft.model.vision import encoder_inputs, freeze_encoder, image_features_owner, reading_images

    folder = str(vision_folders[name])
    config, processor = reading_images(load_config(folder)), load_processor(folder)
    build = {"precision": "32-true", "lora": None, "gradient_checkpointing": False}
    traced = trace_image_encoder(config, build, lambda p: torch.float32, None, processor, 48, 40, 2, 2)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(_with_layers(config, 1))
    freeze_encoder(model)  # as full fine-tuning: the projector trains and keeps its input
    owner = image_features_owner(model)
    inputs = encoder_inputs(owner, processor, 48, 40, 2, 2)
    ledger = LiveStorages(list(model.parameters()) + list(model.buffers()) + list(inputs.values()))
    with ledger.mode():
        features = owner.get_image_features(**inputs)
        ledger.mark("forward")
        del features
    peak, at = ledger.replay(set())
    assert (traced.peak, traced.saved) == (peak, at["forward"]) and traced.saved > 0
    plans = {size: memory_plan(model=folder, accelerator="cpu", job="finetune_full", seq_len=64, image_size=size, images=2)
             for size in ("48x40", None)}
    encoder = plans["48x40"]["image_encoder"]
    assert plans[None]["image_encoder"] is None and encoder["peak"] > encoder["kept"] > 0
    if name == "idefics3":
        mllama = memory_plan(model=str(vision_folders["mllama"]), accelerator="cpu", seq_len=64, image_size="32")
        assert mllama["image_encoder"] is None and mllama["activations"]["peak"] > 0
