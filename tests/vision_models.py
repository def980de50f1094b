"""Tiny random vision-language models, each a real transformers folder with its own processor, and a coloured-shapes image
task in TRL's vision layout: what litft's image path is checked against (tests/unit/test_vision.py).

Each model is its family's transformers classes at toy sizes, with litft-tiny's tokenizer given the family's image tokens
and a small chat template that writes the family's image placeholder where a turn has an image part.
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List

import torch

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}PLACEHOLDER{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            initializer_range=0.2, max_position_embeddings=512)
SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)


# Qwen3.5's language model: a gated delta rule layer (its state carried from token to token) before an attention layer.
GATED_DELTA = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                   linear_value_head_dim=8, linear_conv_kernel_dim=4)


def tokenizer_with(specials: Dict[str, str]):
    """litft-tiny's tokenizer with a family's image tokens, by the names its processor reads (``tokenizer.image_token``...)."""
    from litft.model.loading import load_tokenizer
    from litft.model.tiny import ensure_tiny_model

    tokenizer = load_tokenizer(str(ensure_tiny_model()))
    tokenizer.add_special_tokens({"extra_special_tokens": list(specials.values())})
    tokenizer._set_model_specific_special_tokens(special_tokens=specials)
    return tokenizer


def gemma3(folder: Path):
    import transformers

    tok = tokenizer_with({"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"})
    processor = transformers.Gemma3Processor(image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
                                             tokenizer=tok, image_seq_length=4, chat_template=TEMPLATE.replace("PLACEHOLDER", "<start_of_image>"))
    text = dict(TEXT, vocab_size=len(tok), head_dim=8, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                query_pre_attn_scalar=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=SIGLIP, mm_tokens_per_image=4, boi_token_index=tok.boi_token_id,
                                       eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"), image_token_index=tok.image_token_id)
    return config, processor


def idefics3(folder: Path):
    import transformers

    tok = tokenizer_with({"image_token": "<image>", "fake_image_token": "<fake_token_around_image>", "global_image_token": "<global-img>",
                          "end_of_utterance_token": "<end_of_utterance>"})
    tok.add_special_tokens({"extra_special_tokens": [f"<row_{r}_col_{c}>" for r in range(1, 4) for c in range(1, 4)]},
                           replace_extra_special_tokens=False)
    images = transformers.Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    processor = transformers.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4,
                                               chat_template=TEMPLATE.replace("PLACEHOLDER", "<image>"))
    config = transformers.Idefics3Config(text_config=dict(TEXT, model_type="llama", vocab_size=len(tok)),
                                         vision_config=dict(SIGLIP, model_type="idefics3_vision"), scale_factor=2,
                                         image_token_id=tok.convert_tokens_to_ids("<image>"))
    return config, processor


def llava(folder: Path):
    import transformers

    tok = tokenizer_with({"image_token": "<image>"})
    processor = transformers.LlavaProcessor(image_processor=transformers.CLIPImageProcessorPil(size={"shortest_edge": 32},
                                                                                             crop_size={"height": 32, "width": 32}),
                                            tokenizer=tok, patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                            chat_template=TEMPLATE.replace("PLACEHOLDER", "<image>"))
    config = transformers.LlavaConfig(text_config=dict(TEXT, model_type="llama", vocab_size=len(tok)),
                                      vision_config=dict(SIGLIP, model_type="clip_vision_model", projection_dim=32),
                                      image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="default",
                                      vision_feature_layer=-1)
    return config, processor


def llava_next(folder: Path):
    import transformers

    tok = tokenizer_with({"image_token": "<image>"})
    pinpoints = [[32, 32], [32, 64], [64, 32]]  # "anyres": an image tiled into crops by its shape, beside its resized whole
    images = transformers.LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                                     image_grid_pinpoints=pinpoints)
    processor = transformers.LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=8, vision_feature_select_strategy="default",
                                                num_additional_image_tokens=1, chat_template=TEMPLATE.replace("PLACEHOLDER", "<image>"))
    config = transformers.LlavaNextConfig(text_config=dict(TEXT, model_type="llama", vocab_size=len(tok)),
                                          vision_config=dict(SIGLIP, model_type="clip_vision_model", projection_dim=32),
                                          image_token_index=tok.convert_tokens_to_ids("<image>"), image_grid_pinpoints=pinpoints,
                                          vision_feature_select_strategy="default", vision_feature_layer=-1)
    return config, processor


def paddleocr_vl(folder: Path):
    import transformers

    tok = tokenizer_with({"image_token": "<|IMAGE_PLACEHOLDER|>", "video_token": "<|video_pad|>", "vision_start": "<|IMAGE_START|>",
                          "vision_end": "<|IMAGE_END|>"})
    # 8-pixel patches merged 2 x 2: an image becomes 4 to 9 tokens as its size says, with a (t, h, w) grid each.
    images = transformers.PaddleOCRVLImageProcessorPil(patch_size=8, merge_size=2, size={"shortest_edge": 32 * 32, "longest_edge": 48 * 48})
    processor = transformers.PaddleOCRVLProcessor(image_processor=images, tokenizer=tok,
                                                  chat_template=TEMPLATE.replace("PLACEHOLDER", "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"))
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in (("image_token_id", "<|IMAGE_PLACEHOLDER|>"), ("video_token_id", "<|video_pad|>"),
                                                                    ("vision_start_token_id", "<|IMAGE_START|>"), ("vision_end_token_id", "<|IMAGE_END|>"))}
    text = dict(TEXT, vocab_size=len(tok), head_dim=8, pad_token_id=tok.pad_token_id, bos_token_id=None, eos_token_id=tok.eos_token_id,
                rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "mrope_section": [1, 1, 2]})
    vision = dict(SIGLIP, patch_size=8, image_size=48, spatial_merge_size=2)
    config = transformers.PaddleOCRVLConfig(text_config=text, vision_config=vision, **ids)
    return config, processor


def qwen_vl(config_class: str, **text_fields):
    """A Qwen-VL model (2, 2.5, 3 or 3.5; ``text_fields`` beside the common ones) with a stand-in processor: transformers
    builds every Qwen-VL processor with a video processor that needs torchvision, which these machines lack. PaddleOCR-VL's
    processor does what Qwen-VL's does for images (an image's tokens as its (t, h, w) grid says, one token a merged patch)
    around Qwen2-VL's own image processor, so the models' own code runs on what their processor would make of an image."""

    def build(folder: Path):
        import transformers

        tok = tokenizer_with({"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_start": "<|vision_start|>",
                              "vision_end": "<|vision_end|>"})
        images = transformers.Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=48 * 48)
        processor = transformers.PaddleOCRVLProcessor(image_processor=images, tokenizer=tok,
                                                      chat_template=TEMPLATE.replace("PLACEHOLDER", "<|vision_start|><|image_pad|><|vision_end|>"))
        ids = {f"{name}_id": tok.convert_tokens_to_ids(token) for name, token in (
            ("image_token", "<|image_pad|>"), ("video_token", "<|video_pad|>"), ("vision_start_token", "<|vision_start|>"),
            ("vision_end_token", "<|vision_end|>"))}
        text = dict(TEXT, vocab_size=len(tok), head_dim=8, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}, **text_fields)
        vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, patch_size=8, spatial_merge_size=2, temporal_patch_size=2,
                      in_chans=3, in_channels=3, intermediate_size=64, out_hidden_size=32, mlp_ratio=2, num_position_embeddings=64,
                      deepstack_visual_indexes=[1])
        return getattr(transformers, config_class)(text_config=text, vision_config=vision, **ids), processor

    return build


def mistral3(folder: Path):
    """Mistral 3 (Mistral Small 3.1) with a stand-in processor: Pixtral's processor needs torchvision, which these machines
    lack. LLaVA's processor around Pixtral's own image processor gives every shape image one size (its longest edge to 32,
    then up to whole 16-pixel cells: 32 x 32), so each image is its 2 x 2 merged patches' 4 tokens, as Pixtral's would be
    less its row-break and end tokens; the model's own code (Pixtral's 2-D rotary encoder cropped by ``image_sizes``, the
    patch merger) runs on it."""
    import transformers

    tok = tokenizer_with({"image_token": "[IMG]"})
    images = transformers.PixtralImageProcessorPil(size={"longest_edge": 32}, patch_size={"height": 16, "width": 16})
    processor = transformers.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=16, vision_feature_select_strategy="full",
                                            num_additional_image_tokens=0, chat_template=TEMPLATE.replace("PLACEHOLDER", "[IMG]"))
    return mistral3_config(tok, 32), processor


def mistral3_config(tok, image_size: int):
    """Mistral 3's tiny config: Pixtral's encoder (8-pixel patches, merged 2 x 2) before a Mistral language model."""
    import transformers

    text = dict(TEXT, model_type="mistral", vocab_size=len(tok), head_dim=8, sliding_window=None)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=image_size, patch_size=8)
    return transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids("[IMG]"),
                                       spatial_merge_size=2, vision_feature_layer=-1)


def llama4(folder: Path):
    """Llama 4 with a stand-in processor: Llama 4's image processor needs torchvision, which these machines lack. LLaVA's
    processor around SigLIP's resizes every image to one 32 x 32 tile and writes the tokens Llama 4's processor writes for a
    one-tile image (``<|image_start|><|image|>``, a ``<|patch|>`` per token, ``<|image_end|>``); the model's own code (the
    tile's patches, the class embedding dropped, the pixel shuffle to a quarter, the projector) runs on it."""
    import transformers

    tok = tokenizer_with({"image_token": "<|patch|>"})
    tok.add_special_tokens({"extra_special_tokens": ["<|image_start|>", "<|image|>", "<|image_end|>"]}, replace_extra_special_tokens=False)
    images = transformers.SiglipImageProcessorPil(size={"height": 32, "width": 32})
    # Patches of 8 pixels, shuffled 2 x 2 into one token: a token per 16 x 16 pixels.
    processor = transformers.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=16, vision_feature_select_strategy="full",
                                            num_additional_image_tokens=0,
                                            chat_template=TEMPLATE.replace("PLACEHOLDER", "<|image_start|><|image|><|patch|><|image_end|>"))
    return llama4_config(tok), processor


def llama4_config(tok):
    """Llama 4's tiny config: chunked attention and MoE in every other layer, as litft's text case, behind its vision model."""
    import transformers

    text = dict(TEXT, vocab_size=len(tok), head_dim=8, attention_chunk_size=6, intermediate_size_mlp=64, num_local_experts=4,
                interleave_moe_layer_step=2, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    # The pixel shuffle's 2 x 2 patches side by side: 128 wide, which the vision adapter's first layer (intermediate_size) reads.
    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8,
                  vision_output_dim=32, projector_input_dim=32, projector_output_dim=32, pixel_shuffle_ratio=0.5)
    return transformers.Llama4Config(text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids("<|patch|>"))


def mllama(folder: Path):
    """Mllama (Llama 3.2 Vision) with its own processor: images in tiles by aspect ratio, read by cross-attention layers
    inside the language model (the processor's cross_attention_mask says which tokens see which image)."""
    import transformers

    tok = tokenizer_with({"image_token": "<|image|>", "bos_token": "<|begin_of_text|>"})
    tok.add_special_tokens({"extra_special_tokens": ["<|python_tag|>"]}, replace_extra_special_tokens=False)
    images = transformers.MllamaImageProcessorPil(size={"height": 32, "width": 32}, max_image_tiles=2)
    processor = transformers.MllamaProcessor(image_processor=images, tokenizer=tok, chat_template=TEMPLATE.replace("PLACEHOLDER", "<|image|>"))
    text = {k: v for k, v in TEXT.items() if k != "max_position_embeddings"}
    text.update(vocab_size=len(tok), cross_attention_layers=[0], rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=4, image_size=32,
                  patch_size=8, max_num_tiles=2, intermediate_layers_indices=[0], vision_output_dim=64,
                  supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
    config = transformers.MllamaConfig(text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids("<|image|>"))
    return config, processor


def qwen_vl_own_processor(config_class: str, processor_class: str, video_class: str, **text_fields):
    """A Qwen-VL model with its own processor, video processor included: where torchvision imports (not on the test
    machines: REAL_PROCESSORS)."""

    def build(folder: Path):
        import transformers

        config, stand_in = qwen_vl(config_class, **text_fields)(folder)
        images = transformers.Qwen2VLImageProcessor(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=48 * 48)
        video = getattr(transformers, video_class)(patch_size=8, merge_size=2, temporal_patch_size=2)
        processor = getattr(transformers, processor_class)(image_processor=images, tokenizer=stand_in.tokenizer, video_processor=video,
                                                           chat_template=stand_in.chat_template)
        return config, processor

    return build


def mistral3_own_processor(folder: Path):
    """Mistral 3 with Pixtral's own processor (row-break and end tokens), where torchvision imports."""
    import transformers

    tok = tokenizer_with({"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"})
    images = transformers.PixtralImageProcessor(size={"longest_edge": 48}, patch_size={"height": 8, "width": 8})
    processor = transformers.PixtralProcessor(image_processor=images, tokenizer=tok, patch_size=8, spatial_merge_size=2, image_token="[IMG]",
                                              image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]",
                                              chat_template=TEMPLATE.replace("PLACEHOLDER", "[IMG]"))
    return mistral3_config(tok, 48), processor


def llama4_own_processor(folder: Path):
    """Llama 4 with its own processor, where torchvision imports: an image larger than one tile is cut into 32 x 32 tiles
    (up to 4) beside its whole resized, with the tile separator tokens between them."""
    import transformers

    tok = tokenizer_with({"image_token": "<|image|>"})
    tok.add_special_tokens({"extra_special_tokens": ["<|image_start|>", "<|image_end|>", "<|patch|>", "<|tile_x_separator|>",
                                                     "<|tile_y_separator|>"]}, replace_extra_special_tokens=False)
    images = transformers.Llama4ImageProcessor(size={"height": 32, "width": 32}, max_patches=4)
    processor = transformers.Llama4Processor(image_processor=images, tokenizer=tok, patch_size=8, pixel_shuffle_ratio=0.5,
                                             chat_template=TEMPLATE.replace("PLACEHOLDER", "<|image|>"))
    config = llama4_config(tok)
    config.image_token_index = tok.convert_tokens_to_ids("<|patch|>")
    return config, processor


def torchvision_imports() -> bool:
    import importlib

    try:
        importlib.import_module("torchvision.transforms.v2.functional")
    except Exception:  # noqa: BLE001 - absent, or a build that does not load beside this torch
        return False
    return True


@dataclass(frozen=True)
class VisionModel:
    name: str
    build: Callable
    features: str = ""


VISION_MODELS = [
    VisionModel("gemma3", gemma3, "bidirectional attention over an image's tokens, sliding layers, a fixed token count per image"),
    VisionModel("idefics3", idefics3, "images split into tiles by size, a 5-D pixel batch padded with empty images"),
    VisionModel("llava", llava, "CLIP encoder, a fixed token count per image"),
    VisionModel("llava-next", llava_next, "anyres: an image tiled into crops by its shape, a 5-D pixel batch and each image's size"),
    VisionModel("qwen2-vl", qwen_vl("Qwen2VLConfig"), "3-D rotary positions, tokens per image by its size (a stand-in processor)"),
    VisionModel("qwen2.5-vl", qwen_vl("Qwen2_5_VLConfig"), "windowed vision attention, 3-D rotary positions (a stand-in processor)"),
    VisionModel("qwen3-vl", qwen_vl("Qwen3VLConfig"), "deepstack features into the language model's layers, 3-D rotary (a stand-in processor)"),
    VisionModel("mistral3", mistral3, "Pixtral's encoder: 2-D rotary patches cropped by each image's size, merged 2 x 2 (a stand-in processor)"),
    VisionModel("llama4", llama4, "chunked attention, MoE layers, pixel-shuffled tile patches (a stand-in processor)"),
    VisionModel("mllama", mllama, "cross-attention layers read the image tiles (aspect-ratio tiling, a cross-attention mask)"),
    VisionModel("qwen3.5", qwen_vl("Qwen3_5Config", **GATED_DELTA), "gated delta rule layers (state) beside attention, 3-D rotary (a stand-in processor)"),
    VisionModel("qwen3.5-moe", qwen_vl("Qwen3_5MoeConfig", **GATED_DELTA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                       shared_expert_intermediate_size=16), "gated delta rule layers and MoE with a shared expert (a stand-in processor)"),
    VisionModel("paddleocr-vl", paddleocr_vl, "dynamic resolution: tokens per image by its size, 3-D rotary positions (Qwen-VL's mechanisms)"),
]


# The processors the stand-ins above replace, checked where torchvision imports (by hand here: torch 2.14.1 with torchvision
# 0.29.1, whose CUDA build runs on the CPU; CI's CPU torch has no torchvision, so these do not run there).
REAL_PROCESSORS = [
    VisionModel("qwen2-vl-own-processor", qwen_vl_own_processor("Qwen2VLConfig", "Qwen2VLProcessor", "Qwen2VLVideoProcessor")),
    VisionModel("qwen2.5-vl-own-processor", qwen_vl_own_processor("Qwen2_5_VLConfig", "Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor")),
    VisionModel("qwen3-vl-own-processor", qwen_vl_own_processor("Qwen3VLConfig", "Qwen3VLProcessor", "Qwen3VLVideoProcessor")),
    VisionModel("qwen3.5-own-processor", qwen_vl_own_processor("Qwen3_5Config", "Qwen3VLProcessor", "Qwen3VLVideoProcessor", **GATED_DELTA)),
    VisionModel("mistral3-own-processor", mistral3_own_processor),
    VisionModel("llama4-own-processor", llama4_own_processor),
] if torchvision_imports() else []


def save_vision_model(model: VisionModel, folder: Path, seed: int = 0) -> Path:
    """The tiny model, random, saved with its processor as save_pretrained saves them."""
    from transformers import AutoModelForImageTextToText

    config, processor = model.build(folder)
    torch.manual_seed(seed)
    built = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    for name, param in built.named_parameters():
        if name.endswith("mm_input_projection_weight"):  # Gemma 3 starts it at zero: the image would reach the loss as nothing
            torch.nn.init.normal_(param, std=0.2)
        if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):  # Mllama's gates start closed, as Gemma 3's projection
            torch.nn.init.constant_(param, 0.7)
    built.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}


def shape_image(colour: str, rng: random.Random):
    """A shape of one colour on a grey ground, at a random place and size (and image size: tiling and resizing differ)."""
    from PIL import Image, ImageDraw

    width, height = rng.choice([(32, 32), (48, 32), (40, 56)])
    image = Image.new("RGB", (width, height), (128, 128, 128))
    x, y, r = rng.randint(8, width - 8), rng.randint(8, height - 8), rng.randint(4, 8)
    draw = ImageDraw.Draw(image)
    (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x - r, y - r, x + r, y + r), fill=COLOURS[colour])
    return image


def write_shapes(folder: Path, count: int, seed: int, name: str = "train.jsonl", layouts=("messages", "prompt"), text_only: int = 0) -> Path:
    """``count`` records asking for a shape's colour, alternating TRL's two vision layouts (and text before or after the image);
    images as PNG files beside the JSONL, named relatively. Then ``text_only`` records without an image (a mixed dataset)."""
    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(count):
        colour = rng.choice(sorted(COLOURS))
        path = f"images/{name.split('.')[0]}-{i}.png"
        shape_image(colour, rng).save(folder / path)
        question = {"type": "text", "text": "What colour is the shape?"}
        user = [{"type": "image"}, question] if i % 3 else [question, {"type": "image"}]
        answer = [{"type": "text", "text": colour}]
        if layouts[i % len(layouts)] == "messages":
            lines.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}], "images": [path]})
        else:
            lines.append({"prompt": [{"role": "user", "content": user}], "completion": [{"role": "assistant", "content": answer}], "images": [path]})
    for i in range(text_only):
        colour = rng.choice(sorted(COLOURS))
        lines.append({"messages": [{"role": "user", "content": [{"type": "text", "text": f"Say the word {colour}."}]},
                                   {"role": "assistant", "content": [{"type": "text", "text": colour}]}]})
    out = folder / name
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return out


def write_shape_prompts(folder: Path, count: int, seed: int, name: str = "prompts.jsonl", text_only: int = 0) -> Path:
    """RL prompts about the shapes in TRL's layout (``prompt`` messages with an image part, ``images``, an ``answer``
    column for the rewards), then ``text_only`` text prompts without an image."""
    shapes = write_shapes(folder, count, seed, f"shapes-{name}", text_only=text_only)
    rows = []
    for record in map(json.loads, shapes.read_text().splitlines()):
        prompt = record["messages"][:-1] if "messages" in record else record["prompt"]
        answer = (record["messages"][-1] if "messages" in record else record["completion"][0])["content"][0]["text"]
        rows.append({"prompt": prompt, "answer": answer, **({"images": record["images"]} if "images" in record else {})})
    out = folder / name
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


def reference_loss(folder: Path, records: List[dict], base: Path, model=None):
    """transformers' own summed loss over the records' completion tokens, one record at a time, the number of those tokens,
    and the gradients: the model from ``from_pretrained`` (eager attention; or ``model``), the processor on the rendered
    prompt and conversation, targets every token past the prompt."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    from litft.model.vision import answer_as_transformers_expects

    if model is None:
        model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    answer_as_transformers_expects(model)  # Llama 4's forward fails without it (transformers 5.24)
    model.train()
    total, count = 0.0, 0
    for record in records:
        prompt = record["messages"][:-1] if "messages" in record else record["prompt"]
        whole = record["messages"] if "messages" in record else record["prompt"] + record["completion"]
        images = {"images": [[Image.open(base / p).convert("RGB") for p in record["images"]]]} if record.get("images") else {}
        prompt_ids = processor(text=[processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)], **images,
                               return_tensors="pt", add_special_tokens=False)["input_ids"]
        inputs = processor(text=[processor.apply_chat_template(whole, tokenize=False)], **images, return_tensors="pt", add_special_tokens=False)
        inputs.pop("attention_mask", None)
        inputs = {key: value.to(model.dtype) if value.is_floating_point() else value for key, value in inputs.items()}  # Llama 4's are bf16
        labels = inputs["input_ids"].clone()
        labels[:, : prompt_ids.shape[1]] = -100
        logits = model(**inputs).logits.float()
        total = total + torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")
        count += int((labels[0, 1:] != -100).sum())
    if total.requires_grad:  # an exported adapter loads frozen
        total.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return total.detach(), count, grads
