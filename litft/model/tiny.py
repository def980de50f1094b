"""litft-tiny: a small Llama, its tokenizer and its task data, all generated here; litft-tiny-moe: its mixture-of-experts twin.

The machines litft is tested on cannot reach the Hugging Face hub, so the
default model is built locally: a byte-level BPE tokenizer trained on the task
text, and a randomly initialised Llama of about 0.8M parameters. It is a real
transformers model directory, so every code path (loading, LoRA, export) is the
one a hub model takes. litft-tiny-moe is a Qwen3-MoE of the same size class (8 experts,
2 per token), with the same tokenizer, for what only a MoE exercises (expert parallel). litft-tiny-vision is a LLaVA of the
same size class (a 2-layer CLIP encoder on 32 x 32 images, 16 tokens an image) with the tokenizer given an image token and
a processor, for the image tutorial.
"""

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

from litft.data.base import litft_home
from litft.data.sft import alpaca_prompt
from litft.data.tiny import task_records

TINY_NAME = "litft-tiny"
TINY_VERSION = 1
TINY_MOE_NAME = "litft-tiny-moe"
TINY_VISION_NAME = "litft-tiny-vision"
TINY_NAMES = (TINY_NAME, TINY_MOE_NAME, TINY_VISION_NAME)
# A build's version is in its folder's name, so that a machine's copy of an older build is not taken for the new one.
VERSIONS = {TINY_NAME: TINY_VERSION, TINY_MOE_NAME: TINY_VERSION, TINY_VISION_NAME: 2}

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# The same turns with a turn's content as a list of parts, an image part written as the image placeholder.
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
IMAGE_TOKEN = "<image>"
# Words about pictures, merged into whole tokens as a real tokenizer has them, so that naming a colour or a shape is a
# token or two for the image tutorial's models (trained on the task corpus alone, "circle" is six letters).
PICTURE_WORDS = [
    f"What {noun} is the {thing}?\n{answer}"
    for noun, answers in (("colour", "red green blue yellow orange purple white black grey"), ("shape", "circle square triangle disc"))
    for thing in ("shape", "picture", "it") for answer in answers.split()
] * 40


def tiny_dir(name: str = TINY_NAME) -> Path:
    return litft_home() / "models" / f"{name}-v{VERSIONS[name]}"


def ensure_tiny_model(name: str = TINY_NAME) -> Path:
    """Build litft-tiny (or litft-tiny-moe) once per machine; concurrent builders race to one atomic rename."""
    target = tiny_dir(name)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.build{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    if name == TINY_VISION_NAME:
        build_tiny_vision_model(staging)
    else:
        build_tiny_model(staging, moe=name == TINY_MOE_NAME)
    try:
        os.rename(staging, target)
    except OSError:
        # Another process finished first; its build is identical (everything is seeded).
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_tokenizer(extra_text=(), vocab_size=384):
    corpus = list(extra_text)
    for record in task_records(4000, seed=1234):
        corpus.append(alpaca_prompt(record["instruction"], record["input"]) + record["output"])
    tokenizer = Tokenizer(models.BPE())
    # One token per digit makes arithmetic learnable; byte-level keeps every text encodable.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<|pad|>", eos_token="<|end|>", model_max_length=256
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_tiny_model(path: Path, moe: bool = False) -> None:
    tokenizer = build_tokenizer()
    common = dict(
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    if moe:
        config = Qwen3MoeConfig(**common, intermediate_size=384, moe_intermediate_size=96, num_experts=8, num_experts_per_tok=2, head_dim=32)
    else:
        config = LlamaConfig(**common, intermediate_size=384)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config) if moe else LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    save_tiny_folder(model, tokenizer, path)


def save_tiny_folder(model, processing, path: Path) -> None:
    """A built model and its tokenizer (or processor) as a transformers folder. Written directly: transformers' save_pretrained
    has accelerate import DeepSpeed (and log its accelerator) on a first run."""
    config = model.config
    path.mkdir(parents=True, exist_ok=True)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items() if name not in tied}
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.architectures, config.dtype = [type(model).__name__], torch.float32
    config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    processing.save_pretrained(path)


def build_tiny_vision_model(path: Path) -> None:
    """litft-tiny-vision: LLaVA's classes (a CLIP encoder, its 16 patch features an image projected by a two-layer MLP into a
    Llama) at litft-tiny's size, saved with its processor (the image processor needs PIL only)."""
    from transformers import AutoModelForImageTextToText, CLIPImageProcessorPil, LlavaConfig, LlavaProcessor

    tokenizer = build_tokenizer(PICTURE_WORDS, vocab_size=448)
    tokenizer.add_special_tokens({"extra_special_tokens": [IMAGE_TOKEN]})
    tokenizer._set_model_specific_special_tokens(special_tokens={"image_token": IMAGE_TOKEN})
    images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, chat_template=VISION_CHAT_TEMPLATE)
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    vision = dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  image_size=32, patch_size=8, projection_dim=64)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_select_strategy="default", vision_feature_layer=-1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    # A trained model's final norm spreads its logits over several units. At 1, random tied embeddings (std 0.02) cap
    # every logit near 2.5, so that no adapter on the linear layers could make a confident prediction (LoRA's val_loss
    # stalled near 4.7 on the colour task); full fine-tuning grows the embeddings themselves and never met the cap.
    model.model.language_model.norm.weight.data.fill_(4.0)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    save_tiny_folder(model, processor, path)
