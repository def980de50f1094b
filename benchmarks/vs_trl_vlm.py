"""Vision-language SFT speed and memory of litft against TRL's SFTTrainer: the same model, image records, batches and LoRA.

The model is a LLaVA built here at a small size (a CLIP encoder on 64 x 64 pictures, 64 tokens a picture, a Llama of
``--hidden`` x ``--layers``; random weights: speed does not depend on them), the data the coloured-shapes task of
tutorials/images.md in the prompt/completion layout, so that both sides train on the completion tokens only. Both sides
train LoRA (r 8, alpha 16, no dropout) on the language model's linear layers with the image encoder and projector frozen,
AdamW, micro-batches of ``--micro_batch`` records, ``--global_batch`` a step; fp32 on the CPU (bf16-mixed on a GPU), each
side in a fresh process with the same torch threads. Printed per side, over the steps after the first ``--skip``: seconds
per step, tokens/s (every token of every row, images' tokens included; each side counts its own), and the process's peak
resident memory (on a GPU, the allocator's peak).

    python benchmarks/vs_trl_vlm.py                                  # CPU, micro-batch 4, global 8
    python benchmarks/vs_trl_vlm.py --micro_batch 8 --global_batch 16
    python benchmarks/vs_trl_vlm.py --accelerator cuda --hidden 2048 --layers 16 --micro_batch 16 --global_batch 32
"""

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tutorials" / "colour-shapes"))
sys.path.insert(0, str(ROOT))

from vs_hf_trainer import RESULT, clocked_train, peer_side, run_litft, steady_rates, step_clock  # noqa: E402

SIDES = ("litft", "trl")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--global_batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip", type=int, default=1, help="first steps left out of the rates")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work_dir", type=Path, default=None)
    parser.add_argument("--_side", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_model(args, folder: Path) -> None:
    """A LLaVA at the benchmark's size, with litft-tiny's tokenizer given an image token, and its processor."""
    import torch
    from transformers import AutoModelForImageTextToText, CLIPImageProcessorPil, LlavaConfig, LlavaProcessor

    from litft.model.tiny import IMAGE_TOKEN, VISION_CHAT_TEMPLATE, build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"extra_special_tokens": [IMAGE_TOKEN]})
    tokenizer._set_model_specific_special_tokens(special_tokens={"image_token": IMAGE_TOKEN})
    processor = LlavaProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}),
                               tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=VISION_CHAT_TEMPLATE)
    heads = max(4, args.hidden // 64)
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=1024,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    vision = dict(model_type="clip_vision_model", hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  image_size=64, patch_size=8, projection_dim=128)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_select_strategy="default", vision_feature_layer=-1)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    processor.save_pretrained(folder)


def write_records(args, folder: Path) -> Path:
    """The coloured-shapes task (tutorials/colour-shapes) in the prompt/completion layout, with a longer question."""
    from make_shapes import COLOURS, picture

    rng = random.Random(0)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(args.records):
        colour = rng.choice(sorted(COLOURS))
        picture(colour, rng).save(folder / "images" / f"{i}.png")
        question = "Look at the picture and say which colour the shape in it has, in one word."
        lines.append({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                      "completion": [{"role": "assistant", "content": [{"type": "text", "text": f"The shape is {colour}."}]}],
                      "images": [f"images/{i}.png"]})
    path = folder / "shapes.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def litft_side(args, model: Path, work: Path) -> dict:
    out = work / "run-litft"
    flags = [
        "finetune_lora", str(model), "--data", "JSON", "--data.json_path", str(work / "shapes.jsonl"), "--data.val_split_fraction", "0",
        "--precision", "bf16-mixed" if args.accelerator == "cuda" else "32-true", "--accelerator", args.accelerator,
        "--train.global_batch_size", str(args.global_batch), "--train.micro_batch_size", str(args.micro_batch),
        "--train.max_steps", str(args.steps), "--train.warmup_steps", "1", "--train.save_interval", "null", "--lora_r", "8",
        "--lora_alpha", "16", "--export", "none", "--eval.initial_validation", "false", "--eval.final_validation", "false",
        "--out_dir", str(out), "--overwrite", "true", "--logger_name", "csv",
    ]
    peak_rss = run_litft(flags, work, args.threads)
    rows, rates = steady_rates(out, args.skip)
    peak = max(r["peak_memory_gb"] for r in rows) if args.accelerator == "cuda" else peak_rss
    return {"s_per_step": rates["s_per_step"], "tokens_per_s": rates["tokens_per_s"], "peak_gb": peak, "steps": len(rows)}


def trl_side(args, model_path: Path, work: Path) -> dict:
    import torch
    from datasets import Dataset
    from PIL import Image
    from peft import LoraConfig
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(args.threads)
    cuda = args.accelerator == "cuda"
    processor = AutoProcessor.from_pretrained(model_path)
    records = [json.loads(line) for line in (work / "shapes.jsonl").read_text().splitlines()]
    for record in records:
        record["images"] = [Image.open(work / path).convert("RGB") for path in record["images"]]

    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    config = SFTConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=args.global_batch // args.micro_batch,
        max_steps=args.steps, learning_rate=3e-4, warmup_steps=1, lr_scheduler_type="cosine", logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=not cuda, bf16=cuda, max_length=None, dataloader_num_workers=0, gradient_checkpointing=False,
    )
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
                      task_type="CAUSAL_LM")
    clock = step_clock()
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(records), processing_class=processor, peft_config=lora,
                         callbacks=[clock])
    seconds, peak = clocked_train(trainer, clock, cuda)
    seen = [0.0] + [log["num_tokens"] for log in clock.logs]
    tokens = [b - a for a, b in zip(seen, seen[1:])]
    steady = seconds[args.skip :]
    result = {"s_per_step": sum(steady) / len(steady), "tokens_per_s": sum(tokens[args.skip :]) / sum(steady), "steps": len(seconds)}
    return result if peak is None else {**result, "peak_gb": peak}


def main(argv=None) -> None:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    unknown = sorted(set(args.sides.split(",")) - set(SIDES))
    if unknown:
        raise SystemExit(f"--sides: unknown {', '.join(unknown)}; choose from {', '.join(SIDES)}")
    if args.global_batch % args.micro_batch:
        raise SystemExit("--micro_batch must divide --global_batch")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="litft-vs-trl-vlm-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if args._side is not None:  # inside TRL's own process
        print(RESULT + json.dumps(trl_side(args, model, work)), flush=True)
        return
    if not (model / "config.json").is_file():
        build_model(args, model)
        write_records(args, work)
    results = {}
    for side in args.sides.split(","):
        results[side] = litft_side(args, model, work) if side == "litft" else peer_side(__file__, raw, work, side, args.threads)
        print(json.dumps({"side": side, **results[side]}), flush=True)
    if len(results) == 2:
        ours, theirs = results["litft"], results["trl"]
        print(f"litft over trl: {theirs['s_per_step'] / ours['s_per_step']:.2f}x steps/s, {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x "
              f"tokens/s, {ours['peak_gb'] / theirs['peak_gb']:.2f}x peak memory")


if __name__ == "__main__":
    main()
