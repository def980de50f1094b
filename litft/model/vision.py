"""Models that see images: transformers' image-text-to-text models with text out, trained as their own forward computes.

Which class builds them, which of their modules is the image encoder (frozen by default, as TRL's and LLaMA-Factory's
users expect: the projector and the language model learn), which linear layers LoRA adapts, and the image tensors of a
micro-batch, made at each step by the model's own processor from the texts and image files the samples keep.
"""

import copy
import functools
import inspect
import threading
import types
from typing import Dict, List, Optional

import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from litft.data.images import open_image, processor_call
from litft.errors import LitftError

# Where transformers' vision-language models keep their image encoder, and the names of projectors kept inside one
# (Qwen-VL's merger); a projector anywhere else is neither encoder nor language model, and trains with the latter.
ENCODER_NAMES = ("vision_tower", "vision_model", "visual", "vision_encoder", "image_encoder")
PROJECTOR_NAMES = ("merger", "projector", "connector")


# Models whose causal-LM class is their text model alone, trained by litft as the image-text-to-text model all the same:
# Mllama (Llama 3.2 Vision), whose images reach the language model through cross-attention layers inside it, and Llama 4.
SEEN_THROUGH_THEIR_OWN_CLASS = ("mllama", "llama4")


# Language models that carry state (litft.model.recurrent), by their text config's type, whose image-text models' loss and
# gradients on padded rows with images equal transformers' eager forward (tests/unit/test_vision.py): Qwen3.5 and its MoE.
STATE_CHECKED_WITH_IMAGES = ("qwen3_5_text", "qwen3_5_moe_text")


def _composite(config):
    """(the image-text class, the causal-LM class) of an image-text model's config with an image encoder; None otherwise."""
    kind = config.model_type
    if kind not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or getattr(config, "vision_config", None) is None:
        return None
    own = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[kind]
    return own, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind, own)


def sees_images(config) -> bool:
    """A vision-language model's config, as litft builds it: an image-text-to-text model with an image encoder, whose
    causal-LM class (where transformers has one) is that same model, or one of ``SEEN_THROUGH_THEIR_OWN_CLASS``. Where the
    causal-LM class is the text model alone (Qwen3.5), litft trains that unless the run reads images: ``reading_images``
    then names the image-text class in ``architectures``, which ``load_config`` set to the text model's."""
    classes = _composite(config)
    if classes is None:
        return False
    own, causal = classes
    return config.model_type in SEEN_THROUGH_THEIR_OWN_CLASS or causal == own or list(getattr(config, "architectures", None) or []) == [own]


def trained_as_text_model(config) -> Optional[str]:
    """transformers' causal-LM class, where litft trains it for a composite folder (a vision config beside the text one) as the
    text model alone (Qwen3.5's hub checkpoints, on text records); None for any other folder."""
    classes = _composite(config)
    return None if classes is None or sees_images(config) else classes[1]


# Composite folders whose causal-LM class is their text model and whose image-text model litft builds for image records,
# checked against transformers (tests/unit/test_vision.py); others of that kind (dots3_note...) train as their text model.
IMAGE_TEXT_CHECKED = ("qwen3_5", "qwen3_5_moe")


def _text_class_composite(config) -> bool:
    classes = _composite(config)
    return classes is not None and config.model_type not in SEEN_THROUGH_THEIR_OWN_CLASS and classes[1] != classes[0]


def reads_images_instead_of_text(config) -> bool:
    """Whether ``config`` is a composite folder's image-text model where litft would otherwise train its text model: what a
    checkpoint records, so that a resume, an export and a reload build the same class."""
    return _text_class_composite(config) and sees_images(config)


def as_text_model(config):
    """``config`` as litft reads a folder: a composite one whose causal-LM class is its text model names that class (the
    hub's Qwen3.5 folders name the image-text one), so that only a run that reads images builds the image-text model."""
    if _text_class_composite(config):
        config.architectures = [_composite(config)[1]]
    return config


def can_read_images(config) -> bool:
    """Whether image records would change what litft builds for ``config``: a composite folder read as its text model whose
    image-text model is checked (``IMAGE_TEXT_CHECKED``)."""
    return trained_as_text_model(config) is not None and config.model_type in IMAGE_TEXT_CHECKED


def reading_images(config):
    """``config`` for a run whose records carry images: a composite folder's image-text model (Qwen3.5's
    Qwen3_5ForConditionalGeneration), where litft would otherwise train its text model (``can_read_images``); any other
    config as it is."""
    if not can_read_images(config):
        return config
    config = copy.deepcopy(config)
    config.architectures = [_composite(config)[0]]
    return config


def from_pretrained_as(config, source: str, **kwargs):
    """``source``'s weights in the class litft builds for ``config`` (``auto_model_class``), the model's config naming that
    class: a composite folder's own config names its image-text class, also over the text model built from it."""
    model = auto_model_class(config).from_pretrained(source, **kwargs)
    model.config.architectures = [type(model).__name__]
    return model


def describe_text_model(config) -> Optional[str]:
    """The first screen's line for a composite folder trained as its text model: what is left out of the run and its export."""
    causal = trained_as_text_model(config)
    if causal is None:
        return None
    return (f"vision: this {MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[config.model_type]} folder trains as its text model, {causal} "
            "(transformers' causal-LM class) on these text records: its image encoder is not loaded, and final/ holds the text model "
            "alone (records with images train the image-text model)")


def auto_model_class(config):
    """transformers' auto class for ``config``: the causal LM's where it builds the model litft trains, else image-text-to-text
    for a model that sees images (LLaVA, Idefics3, PaddleOCR-VL have no causal-LM class at all; Mllama's is its text model)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    kind = config.model_type
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind)
    if sees_images(config) and causal != MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[kind]:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def _in_encoder(name: str) -> bool:
    parts = name.split(".")
    at = next((i for i, part in enumerate(parts) if part in ENCODER_NAMES), None)
    return at is not None and not any(word in part for part in parts[at + 1:] for word in PROJECTOR_NAMES)


def language_model_name(hf_model) -> str:
    """The name of the text decoder inside the model (``model.language_model``, ``model.text_model``...)."""
    decoder = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else None
    name = next((n for n, m in hf_model.named_modules() if m is decoder), None) if decoder is not None else None
    if not name:
        raise LitftError(f"litft cannot find the language model of {type(hf_model).__name__} (get_decoder); it cannot train it yet")
    return name


def beside_language_model(hf_model) -> List[str]:
    """The modules beside the language model under their common parent: the image encoder and the projector (QLoRA keeps
    them in 16 bits, as the language model's 4-bit layers would cost them more accuracy than memory)."""
    decoder = language_model_name(hf_model)
    parent, _, own = decoder.rpartition(".")
    holder = hf_model.get_submodule(parent) if parent else hf_model
    return [f"{parent}.{name}" if parent else name for name, child in holder.named_children()
            if name != own and any(True for _ in child.parameters())]


def answer_as_transformers_expects(hf_model) -> None:
    """transformers 5.24's Llama4ForConditionalGeneration.forward reads ``image_outputs`` from its language model's output,
    which has no such field, and fails on every call: the field is given (None, as the composite's own output would carry
    it when the encoder's outputs are not asked for). A transformers that fills it itself is left alone."""
    if type(hf_model).__name__ != "Llama4ForConditionalGeneration":
        return

    def with_field(module, args, output):
        if not hasattr(output, "image_outputs"):
            object.__setattr__(output, "image_outputs", None)
        return output

    hf_model.language_model.register_forward_hook(with_field)


def ready_for_zero3(hf_model) -> None:
    """The modules beside the language model made safe for ZeRO-3, which gathers a module's weights at each of its calls:
    one whose layers ran once per image would make as many gathers as its rank has images, and ranks holding different
    numbers would pair their collectives wrongly. A frozen module (the encoder; the projector under LoRA) becomes a ZeRO-3
    leaf, gathered whole once a forward. A trained one cannot (a leaf's weights were released before its backward: a
    gradient of 0 elements, DeepSpeed 0.19), so it must call each layer once a forward: PaddleOCR-VL's projector (the
    one that loops among the models litft's tests build) runs its layers once over every image's patches
    (``_paddleocr_projector_in_one_pass``), and any other layer called twice in one forward stops with one line at that
    call, before its gather (``LayerCalls``)."""
    parent = language_model_name(hf_model).rpartition(".")[0]
    calls = LayerCalls(hf_model.get_submodule(parent) if parent else hf_model)
    for name in beside_language_model(hf_model):
        module = hf_model.get_submodule(name)
        for part in module.modules():
            if type(part).__name__ == "PaddleOCRProjector":
                part.forward = types.MethodType(_paddleocr_projector_in_one_pass, part)
        if not any(p.requires_grad for p in module.parameters()):
            module._z3_leaf = True
            continue
        for layer_name, layer in module.named_modules(prefix=name):
            if any(True for _ in layer.parameters(recurse=False)):
                layer.register_forward_pre_hook(functools.partial(calls.first, layer_name, type(module).__name__), prepend=True)


class LayerCalls:
    """Which layers have run within the current forward of ``holder`` (the module holding the encoder and the language
    model); calls outside it (a checkpointed layer's recompute in the backward) are not counted."""

    def __init__(self, holder: torch.nn.Module):
        self.seen = None  # the layers run in this forward; None outside one
        holder.register_forward_pre_hook(self.start, prepend=True)
        holder.register_forward_hook(self.end, always_call=True)

    def start(self, *_) -> None:
        self.seen = set()

    def end(self, *_) -> None:
        self.seen = None

    def first(self, layer_name: str, owner: str, layer, args) -> None:
        if self.seen is None:
            return
        if layer_name in self.seen:
            raise LitftError(f"{layer_name} runs more than once in a forward (once per image?), and ZeRO-3 gathers its weights at "
                             f"each call, out of step across ranks; train {owner} with --strategy fsdp or --deepspeed.stage 2, or "
                             "train LoRA (which keeps it frozen)")
        self.seen.add(layer_name)


def _paddleocr_projector_in_one_pass(self, image_features: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
    """transformers' PaddleOCRProjector.forward with its layers run once: the norm, both linear layers and the activation
    act on each row alone, so running them over all images' rows gives each image's result; only the merge of each
    2 x 2 patch block into one row (a reshape) goes image by image."""
    m1, m2 = self.merge_kernel_size
    normed = self.pre_norm(image_features)
    width = normed.shape[-1]
    merged = [chunk.reshape(t, h // m1, m1, w // m2, m2, width).transpose(2, 3).reshape(-1, m1 * m2 * width)
              for chunk, (t, h, w) in zip(normed.split(image_grid_thw.prod(dim=1).tolist(), dim=0), image_grid_thw.tolist())]
    return self.linear_2(self.act(self.linear_1(torch.cat(merged))))


def freeze_encoder(hf_model) -> int:
    """The image encoder's parameters out of training (full fine-tuning's default); how many tensors were frozen."""
    frozen = 0
    for name, param in hf_model.named_parameters():
        if _in_encoder(name) and param.requires_grad:
            param.requires_grad_(False)
            frozen += 1
    return frozen


def lora_targets(hf_model, with_encoder: bool) -> List[str]:
    """``all-linear`` for a vision-language model: every linear layer of the language model (the head apart), and of the
    image encoder where it trains too. The projector keeps its weights, as the language model's embeddings do."""
    decoder = language_model_name(hf_model) + "."
    head = hf_model.get_output_embeddings()
    return [name for name, module in hf_model.named_modules() if isinstance(module, torch.nn.Linear) and module is not head
            and (name.startswith(decoder) or (with_encoder and _in_encoder(name)))]


def describe(hf_model, encoder: str, lora: bool) -> str:
    """The first screen's line on what of a vision-language model learns."""
    encoder_params = sum(getattr(p, "ds_numel", p.numel()) for n, p in hf_model.named_parameters() if _in_encoder(n))  # ZeRO-3: whole counts
    decoder = language_model_name(hf_model)
    if lora:
        where = "the language model's and the image encoder's linear layers" if encoder == "trained" else "the language model's linear layers"
        return f"vision: LoRA on {where}; the image encoder ({encoder_params:,} parameters) and projector frozen" + (
            "" if encoder == "trained" else " (--train.vision_encoder trained adapts the encoder too)")
    if encoder == "trained":
        return f"vision: the image encoder ({encoder_params:,} parameters), projector and language model ({decoder}) all trained"
    return (f"vision: the image encoder ({encoder_params:,} parameters) frozen, the projector and language model ({decoder}) trained "
            "(--train.vision_encoder trained trains it too)")


class ImageInputs:
    """A micro-batch's image tensors (``pixel_values``, ``image_grid_thw``, ``pixel_attention_mask``...) and per-token inputs
    (``token_type_ids``, ``mm_token_type_ids``): the processor called on the batch's texts and images, so every tensor is
    batched exactly as the processor batches it for the model; only what the model's forward takes is kept. The token ids
    it gives must be the samples' own (tokenized once, before training), or the run stops.
    """

    def __init__(self, processor, hf_model):
        self.processor = processor
        self.lock = threading.Lock()  # the collate thread and validation share the processor (and its tokenizer's padding state)
        self.takes = set(inspect.signature(hf_model.forward).parameters) - {"input_ids", "attention_mask", "labels", "position_ids"}
        # Pixels reach the encoder in its own dtype, as transformers' users send them (``.to(model.dtype)``): Llama 4's encoder
        # does not cast them itself, and fails on float32 pixels under bf16-true.
        self.encoder = next((m for n, m in hf_model.named_modules() if n.rpartition(".")[2] in ENCODER_NAMES), None)

    def ahead(self, batch: dict) -> dict:
        """The batch with its image tensors made (``batch["vision"]``), where the loop's batches are collated a step ahead."""
        batch["vision"] = self(batch)
        return batch

    def __call__(self, batch: dict) -> Dict[str, torch.Tensor]:
        images = [[open_image(data, f"an image of the batch's row {r}") for data in row] for r, row in enumerate(batch["images"])]
        with self.lock:
            made = processor_call(self.processor, batch["texts"], images)
        ids, width = made["input_ids"], batch["input_ids"].shape[1]
        # A row's text covers its tokens but its padding, or only its prompt (an RL rollout: the completion is the model's own
        # tokens, which its decoded text need not give back); the per-token inputs of those further tokens are 0, as for text.
        covered = batch.get("text_tokens") or [width] * len(ids)
        for row, (mine, theirs) in enumerate(zip(batch["input_ids"], ids)):
            n = min(int(batch["real"][row].sum()) if "real" in batch else width, covered[row])
            if theirs.shape[0] < n or not torch.equal(theirs[:n].to(mine.device), mine[:n]):
                raise LitftError(CHANGED_PROCESSOR)
        return self.kept(made, width, batch["input_ids"].device, covered)

    def prompts(self, texts: List[str], images: List[List[bytes]], ids: torch.Tensor, mask: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The image tensors and per-token inputs of a generate call's left-padded prompts (``ids``, ``mask``)."""
        pictures = [[open_image(data, f"an image of prompt {r}") for data in row] for r, row in enumerate(images)]
        with self.lock:
            made = processor_call(self.processor, texts, pictures, padding_side="left")
        kept = mask.bool()
        if made["input_ids"].shape != ids.shape or not torch.equal(made["input_ids"][kept], ids[kept]):
            raise LitftError(CHANGED_PROCESSOR)
        return self.kept(made, ids.shape[1], ids.device)

    def kept(self, made: dict, width: int, device, covered: Optional[List[int]] = None) -> Dict[str, torch.Tensor]:
        """What of the processor's output the model's forward takes, per-token values at the batch's own width: a token past
        its row's text (``covered``: an RL rollout's completion) takes 0 (text) for a per-token type, and for a per-token
        mask over the images (Mllama's cross_attention_mask) what the row's last text token has, as generate extends it."""
        out = {}
        params = self.encoder.parameters() if self.encoder is not None else iter(())
        pixels = next((p.dtype for p in params if p.is_floating_point()), None)
        for key, value in made.items():
            if key not in self.takes or not isinstance(value, torch.Tensor):
                continue
            if value.dim() >= 2 and value.shape[:2] == made["input_ids"].shape:  # one value (or a row of them) per token
                grown = value.new_zeros((value.shape[0], width, *value.shape[2:]))
                for row in range(value.shape[0]):
                    n = min(covered[row] if covered is not None else width, value.shape[1], width)
                    grown[row, :n] = value[row, :n]
                    if value.dim() > 2 and 0 < n < width:
                        grown[row, n:] = value[row, n - 1]
                value = grown
            out[key] = value.to(device, pixels if value.is_floating_point() else None, non_blocking=True)
        return out


CHANGED_PROCESSOR = ("the processor now tokenizes a sample differently from when the data was prepared (a changed processor or tokenizer?); "
                     "remove the tokenized cache in $LITFT_HOME/datasets and run again")


class EncoderStandIn:
    """Where the image encoder's weights are sharded (FSDP, ZeRO-3), every rank must run it in every forward: its units
    gather their weights collectively, so a rank whose micro-batch has no image (a text record of a mixed dataset, a
    text-only rollout prompt) would leave the others waiting on it, or pair their gathers with the wrong ones. Such a rank
    runs the encoder on a small grey stand-in image, its output times zero added to the language model's input embeddings:
    the loss and every gradient are unchanged, and each rank makes the same collectives (LLaMA-Factory feeds a blank image
    for the same reason under ZeRO-3). ``pending`` is set by the caller for one forward."""

    def __init__(self, processor, hf_model):
        self.owner = image_features_owner(hf_model)
        self.inputs = encoder_inputs(self.owner, processor, 32, 32, 1, 1)
        self.pending = False
        # Llama 4's forward runs its projector on what get_image_features gives (a trained projector must run here too). Read
        # before FSDP renames the class.
        self.projects_after = type(self.owner).__name__ == "Llama4ForConditionalGeneration"
        hf_model.get_decoder().register_forward_pre_hook(self.before_language_model, with_kwargs=True)

    def before_language_model(self, module, args, kwargs):
        if not self.pending:
            return None
        self.pending = False
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            raise LitftError(f"{type(self.owner).__name__} calls its language model without inputs_embeds, where litft adds the image "
                             "encoder's stand-in output; train it with ddp or zero2 (the encoder unsharded)")
        kwargs["inputs_embeds"] = embeds + (self.run(embeds.device) * 0).to(embeds.dtype)
        return args, kwargs

    def run(self, device) -> torch.Tensor:
        """The encoder on the stand-in image: the sum of its outputs."""
        encoder_dtype = next(p.dtype for p in self.owner.parameters() if p.is_floating_point())
        inputs = {key: value.to(device, encoder_dtype if value.is_floating_point() else value.dtype) for key, value in self.inputs.items()}
        features = self.owner.get_image_features(**inputs)
        if self.projects_after:
            hidden = features.last_hidden_state
            features = self.owner.multi_modal_projector(hidden.reshape(-1, hidden.shape[-1]))
        return sum(t.float().sum() for t in float_tensors(features))

    def before_generate(self, model) -> None:
        """A generate call without images: the encoder run where transformers runs it on pictures, before the model's forward
        where the model takes precomputed image features (transformers 5), else inside it (``pending``)."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if "mm_encoder_outputs" in inspect.signature(base.forward).parameters:
            with torch.no_grad():
                self.run(next(base.parameters()).device)
        else:
            self.pending = True


def image_features_owner(hf_model):
    """The module whose ``get_image_features`` runs the image encoder (and the projector, where it does) on a batch's image
    tensors; None where the model has none (Mllama's encoder runs inside its forward)."""
    return next((m for m in (getattr(hf_model, "model", None), hf_model) if hasattr(m, "get_image_features")), None)


def encoder_inputs(owner, processor, width: int, height: int, per_sample: int, samples: int) -> Dict[str, torch.Tensor]:
    """The image tensors the processor makes for ``samples`` user turns of ``per_sample`` grey images of width x height each,
    as ``owner.get_image_features`` takes them."""
    from PIL import Image

    takes = set(inspect.signature(owner.get_image_features).parameters)
    picture = Image.new("RGB", (width, height), (128, 128, 128))
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}] * per_sample}], tokenize=False,
                                         add_generation_prompt=False)
    made = processor_call(processor, [text] * samples, [[picture] * per_sample] * samples)
    return {key: value for key, value in made.items() if key in takes and isinstance(value, torch.Tensor)}


def float_tensors(value):
    """Every floating tensor in a model output, tuple or list (an encoder's features, pooled outputs, deep-stack layers)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else []
    return [t for item in items for t in float_tensors(item)]


def tokens_per_image(processor, width: int, height: int) -> int:
    """The tokens one image of this size adds to a sample, by the processor's own count: a user turn rendered and
    tokenized with the image and without it (placeholders, tiles and begin/end markers alike)."""
    from PIL import Image

    question = {"type": "text", "text": "What is in the picture?"}
    turn = lambda parts: processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)  # noqa: E731
    picture = Image.new("RGB", (width, height), (128, 128, 128))
    with_image = processor_call(processor, [turn([{"type": "image"}, question])], [[picture]])["input_ids"]
    without = processor_call(processor, [turn([question])], [[]])["input_ids"]
    return with_image.shape[1] - without.shape[1]


def image_marker_tokens(config) -> List[int]:
    """The token ids a vision-language model's config gives its images (and videos): placeholders and begin/end markers
    (``image_token_id``, Gemma 3's ``boi_token_index``, Qwen-VL's ``vision_start_token_id``...), which its forward reads as
    where pictures go; the sampler never draws them."""
    marks = ("image", "video", "vision", "boi", "eoi")
    return sorted({value for key, value in vars(config).items() if key.endswith(("_token_id", "_token_index"))
                   and any(mark in key for mark in marks) and isinstance(value, int) and value >= 0})


def has_pixels(vision) -> bool:
    return bool(vision) and any("pixel" in key and value.numel() for key, value in vision.items())


# Models whose record computes otherwise beside a record with another number of images than alone: Mllama's
# cross-attention lets a token that sees no image yet (a text record's, or those before a record's first image) attend
# over every image slot of the batch, padded ones included (only the layers' MLP part is masked for it).
IMAGE_IN_EVERY_RECORD = ("mllama",)


def check_images_fit(config, has_images: bool, data=None) -> None:
    """Image records need a model that sees images; Mllama needs the same number of images, at least one, in every record
    (``data``: the prepared data)."""
    if has_images and config.model_type in IMAGE_IN_EVERY_RECORD and data is not None:
        lists = [samples for samples in (data.train, data.val) if isinstance(samples, list)]
        if len(lists) < 2:
            raise LitftError(f"{config.model_type} needs the same number of images in every record, which a stream cannot promise; "
                             "set --data.streaming false")
        counts = sorted({len(sample.get("images") or []) for samples in lists for sample in samples})
        if len(counts) > 1 or counts[0] == 0:
            raise LitftError(f"the data's records carry {' to '.join(map(str, counts[:: max(1, len(counts) - 1)]))} images, and "
                             f"{config.model_type} computes a record beside one with another number of images otherwise than alone "
                             "(its cross-attention reads the batch's padded image slots); give every record the same number of images, "
                             "at least one (Llama 3.2 Vision takes one), and train text records in a run of their own")
    if has_images and not sees_images(config):
        if trained_as_text_model(config) and not can_read_images(config):
            raise LitftError(f"the data's records carry images, and litft trains {config.model_type}'s text model: its image-text model "
                             f"({MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[config.model_type]}) is not checked against transformers "
                             "yet; drop the images or train another vision-language model")
        if trained_as_text_model(config):
            raise LitftError(f"the data's records carry images, and this run built {config.model_type}'s text model: litft builds its "
                             "image-text model where the data files name images before the run starts (JSON's records, a dataset's "
                             "images column); put the images there, or drop them")
        raise LitftError(f"the data's records carry images, and {config.model_type} models read text only; train a vision-language "
                         "model (an AutoModelForImageTextToText folder) or drop the images")

