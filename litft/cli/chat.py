"""``litft chat`` and ``litft generate``: talk to what was trained, prompts rendered as training rendered them.

A model is a Hugging Face folder (a run's ``final/``), a peft adapter folder (a
run's ``final-adapter/``, put on the base it names), a training checkpoint or a
run's folder (its model made in memory a block at a time, a LoRA adapter merged),
litft-tiny or a hub id. Prompts go through the rendering of training data
(``litft.data.sft``), so the model sees its chat template, or the Alpaca headers
it was trained with, exactly as it did in training.
"""

import json
import sys
from pathlib import Path
from typing import Callable, List, Optional

import torch
from transformers import TextStreamer

from litft.checkpoint.convert import model_from_checkpoint
from litft.checkpoint.format import CHECKPOINTS, META, CheckpointMeta, resolve_resume
from litft.data.sft import JSON
from litft.device import resolve_accelerator
from litft.errors import LitftError
from litft.model.generation import stop_tokens
from litft.cli.flags import GENERATION, PROMPT, TRAINED_MODEL, command
from litft.data.images import load_processor, open_image, processor_call
from litft.model.loading import load_config, load_tokenizer, resolve_model
from litft.model.vision import answer_as_transformers_expects, from_pretrained_as, reading_images, sees_images

ANSWER_STAND_IN = "x"  # the answer's turn is rendered with a stand-in, to find where the prompt ends
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # what str.splitlines splits on
HELP = "Ctrl-D or /exit quits, /reset starts a new conversation, Ctrl-C stops an answer"


def _from_pretrained(source: str, dtype: torch.dtype, images: bool = False):
    """``images``: a composite folder (Qwen3.5) as its image-text model, where litft would read it as its text model."""
    config = reading_images(load_config(source)) if images else load_config(source)
    try:
        model = from_pretrained_as(config, source, dtype=dtype).eval()
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise LitftError(f"could not load '{source}' ({first}); pass a model folder, a litft run or checkpoint, or a hub id") from None
    answer_as_transformers_expects(model)
    return model


def _with_adapter(adapter: Path, dtype: torch.dtype):
    """A peft adapter folder on the base model its config names, built as the class it adapted: litft names a
    vision-language model's targets in full (``model.language_model.layers.0.self_attn.q_proj``), a text model's by short
    name, so a composite folder (Qwen3.5) gets its image-text model for the first and its text model for the second."""
    from peft import PeftModel  # here, not at the top: litft.model.lora says why

    config = json.loads((adapter / "adapter_config.json").read_text())
    targets = config.get("target_modules") or []
    full_names = any("." in target for target in ([targets] if isinstance(targets, str) else targets))
    return PeftModel.from_pretrained(_from_pretrained(resolve_model(config["base_model_name_or_path"]), dtype, full_names), str(adapter)).eval()


def load_for_chat(name: str, dtype: torch.dtype, images: bool = False):
    """The model, its tokenizer and a few words on what was loaded, for every form the module docstring lists; ``images``:
    the conversation shows the model a picture."""
    path = Path(name).expanduser()
    if path.is_dir() and not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        if (path / CHECKPOINTS).is_dir() and (path / "final" / "config.json").is_file():
            path = path / "final"  # a finished run: what it exported
        elif (path / CHECKPOINTS).is_dir() and (path / "final-adapter" / "adapter_config.json").is_file():
            path = path / "final-adapter"  # a finished LoRA run that exported its adapter alone
        elif (path / META).is_file() or (path / CHECKPOINTS).is_dir():
            return _from_checkpoint(resolve_resume(str(path), path), dtype)
    if (path / "adapter_config.json").is_file():
        return _with_adapter(path, dtype), load_tokenizer(str(path)), f"adapter {path} on its base"
    source = resolve_model(str(path) if path.exists() else name)
    return _from_pretrained(source, dtype, images), load_tokenizer(source), source


def _from_checkpoint(checkpoint: Path, dtype: torch.dtype):
    """A checkpoint's model in memory, a block at a time (LoRA merged into its base): nothing written to disk."""
    model, tokenizer = model_from_checkpoint(checkpoint, dtype)
    answer_as_transformers_expects(model)
    lora = CheckpointMeta.read(checkpoint).job == "finetune_lora"
    return model, tokenizer, f"checkpoint {checkpoint}" + (" (its adapter merged into its base)" if lora else "")


class PieceWriter(TextStreamer):
    """Hands each finished piece of an answer to ``write`` as generation makes it."""

    def __init__(self, tokenizer, write: Callable[[str], None]):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.write = write

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.write(text)


class Conversation:
    """A loaded model with its generation settings: renders turns as training did and answers them."""

    def __init__(self, model: str, system: Optional[str], max_new_tokens: int, temperature: float, top_p: float, prompt_style: str, accelerator: str, seed: int,
                 image: Optional[Path] = None):
        if max_new_tokens < 1:
            raise LitftError("--max_new_tokens must be at least 1")
        if temperature < 0:
            raise LitftError("--temperature must be 0 (greedy) or more")
        if not 0 < top_p <= 1:
            raise LitftError("--top_p must be in (0, 1]")
        if system and prompt_style != "chat":
            raise LitftError("--system needs --prompt_style chat (a chat template has a place for it)")
        device = torch.device(resolve_accelerator(accelerator))
        dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
        self.model, self.tokenizer, self.loaded = load_for_chat(model, dtype, images=image is not None)
        self.model.to(device)
        if prompt_style == "chat" and not getattr(self.tokenizer, "chat_template", None):
            raise LitftError(f"{self.loaded} has no chat template; pass --prompt_style alpaca or plain, as the model was trained")
        self.device, self.system, self.style = device, system, prompt_style
        self.renderer = JSON(prompt_style=prompt_style)
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False)
        self.settings = dict(max_new_tokens=max_new_tokens, pad_token_id=self.tokenizer.pad_token_id, **sampling)
        self.history: List[dict] = []
        self.image = self.processor = None
        if image is not None:
            self.take_image(Path(image))
        torch.manual_seed(seed)

    def take_image(self, image: Path) -> None:
        """The picture the conversation is about, and the processor that renders it with the prompts (a VLM's own)."""
        config = getattr(self.model, "config", None)
        if config is None or not sees_images(config):
            raise LitftError(f"--image needs a vision-language model; {self.loaded} reads text only")
        if self.style != "chat":
            raise LitftError("--image needs --prompt_style chat (the processor's chat template places the picture)")
        if not image.is_file():
            raise LitftError(f"--image {image} does not exist; pass a picture file")
        self.image = open_image(image.read_bytes(), f"--image {image}")
        self.processor = load_processor(self.tokenizer.name_or_path)

    def prompt_ids(self, user: str) -> List[int]:
        """The conversation so far and the new turn, as the training data of this prompt style renders them."""
        if self.style == "chat":
            system = [{"role": "system", "content": self.system}] if self.system else []
            turns = [*system, *self.history, {"role": "user", "content": user}, {"role": "assistant", "content": ANSWER_STAND_IN}]
            record = {"messages": turns}
        else:
            record = {"instruction": user, "output": ANSWER_STAND_IN}
        return self.renderer.prompted(self.tokenizer, record, "the prompt").prompt_ids

    def image_inputs(self, user: str) -> dict:
        """The conversation with its picture (in the first user turn) as the processor makes it for the model."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        turns = [*self.history, {"role": "user", "content": user}]
        first = next(i for i, turn in enumerate(turns) if turn["role"] == "user")
        turns[first] = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": turns[first]["content"]}]}
        text = self.processor.apply_chat_template([*system, *turns], tokenize=False, add_generation_prompt=True)
        return {key: value.to(self.device) for key, value in processor_call(self.processor, [text], [[self.image]]).items()}

    @torch.no_grad()
    def answer(self, user: str, write: Callable[[str], None] = lambda text: None, remember: bool = False) -> str:
        """The model's answer to ``user``, each piece handed to ``write`` as it is generated."""
        if self.image is not None:
            inputs = self.image_inputs(user)
        else:
            ids = torch.tensor([self.prompt_ids(user)], device=self.device)
            inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
        ids = inputs["input_ids"]
        out = self.model.generate(
            **inputs, streamer=PieceWriter(self.tokenizer, write), eos_token_id=stop_tokens(self.model, self.tokenizer), **self.settings,
        )
        text = self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        if remember and self.style == "chat":
            self.history += [{"role": "user", "content": user}, {"role": "assistant", "content": text}]
        return text


def _to_terminal(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def one_line(text: str) -> str:
    """An answer on one line of output: line breaks written as Python escapes (\\n), backslashes doubled, so it reads back."""
    text = text.replace("\\", "\\\\")
    for breaks in LINE_BREAKS:
        text = text.replace(breaks, breaks.encode("unicode_escape").decode())
    return text


def interactive(conversation: Conversation) -> None:
    print(f"litft chat: {conversation.loaded} ({HELP})", flush=True)
    while True:
        try:
            user = input(">> ")
        except EOFError:
            print()
            return
        command_word = user.strip()
        if command_word in ("/exit", "/quit"):
            return
        if command_word == "/reset":
            conversation.history.clear()
            print("(a new conversation)")
            continue
        if not command_word:
            continue
        try:
            conversation.answer(user, _to_terminal, remember=True)
        except KeyboardInterrupt:
            print(" (stopped)", end="")
        print(flush=True)


@command([TRAINED_MODEL, *GENERATION])
def chat(**flags) -> None:
    """Chat with a model in the terminal, tokens shown as they come; with stdin not a terminal, each of its lines is one prompt and gets one line of answer."""
    conversation = Conversation(**flags)
    if sys.stdin.isatty():
        interactive(conversation)
        return
    for line in sys.stdin:  # independent prompts: answers do not depend on the lines before
        print(one_line(conversation.answer(line.rstrip("\n"))), flush=True)


@command([TRAINED_MODEL, PROMPT, *GENERATION])
def generate(prompt: Optional[str], **flags) -> None:
    """Answer one prompt, streamed to stdout."""
    if prompt is None:
        raise LitftError("litft generate needs --prompt TEXT (litft chat answers many)")
    Conversation(**flags).answer(prompt, _to_terminal)
    print(flush=True)
