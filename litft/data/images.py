"""Records that carry images, in TRL's vision layouts, tokenized by the model folder's own processor.

A record is chat ``messages``, or ``prompt`` and ``completion`` message lists; a turn's content is a string or a list of
parts, ``{"type": "text", "text": ...}`` and ``{"type": "image"}``, the image parts filled in order from the record's
``images`` (file paths, relative to the data file's folder or absolute). The processor's chat template renders the
conversation and the processor tokenizes it, image tokens expanded as the model expects. The targets are every token the
assistant's turns add past the prompt rendered with ``add_generation_prompt`` (the end of turn and what the template
writes after it included); image tokens never are. A sample keeps its rendered text and its images' file bytes: the
processor makes the pixels again from them at each step (litft.model.vision.ImageInputs), so nothing image-sized is cached.
"""

import functools
import io
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

from litft.data.samples import IGNORE_INDEX, Sample
from litft.errors import LitftError


def open_image(data: bytes, where: str = "an image"):
    """An image file's bytes as an RGB picture; one line naming it where they do not decode."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as err:
        raise LitftError(f"{where} does not decode as an image ({type(err).__name__}); replace or remove it") from None


@functools.lru_cache(maxsize=4)
def load_processor(source: str):
    """The model folder's own processor (tokenizer, image processor and chat template together)."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(source)
    except (OSError, ValueError, ImportError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise LitftError(f"could not load the processor of '{source}' ({first}); image records need the model folder's processor") from None
    if getattr(processor, "image_processor", None) is None:
        raise LitftError(f"'{source}' has no image processor (AutoProcessor gives {type(processor).__name__}); "
                         "image records need a vision-language model's folder")
    return processor


def processor_call(processor, texts: Sequence[str], images: Sequence[Sequence], padding_side: str = "right") -> dict:
    """The processor on rendered texts (templates write their own special tokens) and each text's images; rows padded right
    (training) or left (generation's prompts)."""
    kwargs = dict(text=list(texts), return_tensors="pt", add_special_tokens=False)
    if any(len(row) for row in images):
        kwargs["images"] = [list(row) for row in images]
    if len(texts) > 1:
        kwargs.update(padding=True, padding_side=padding_side)
    return processor(**kwargs)


def turns_of(record) -> list:
    if not isinstance(record, dict):
        return []
    if isinstance(record.get("messages"), list):
        return record["messages"]
    return [m for key in ("prompt", "completion") if isinstance(record.get(key), list) for m in record[key]]


def image_parts(messages) -> int:
    return sum(1 for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict) and part.get("type") == "image")


def carries_images(record) -> bool:
    """Whether a record is in a vision layout: it has ``images``, or an image part in a turn."""
    return isinstance(record, dict) and ("images" in record or image_parts(turns_of(record)) > 0)


def with_absolute_images(records: list, folder: Path) -> list:
    """The records with their relative image paths taken from ``folder`` (the data file's)."""
    for record in records:
        if isinstance(record, dict) and isinstance(record.get("images"), list):
            record["images"] = [str(folder / entry) if isinstance(entry, str) and not Path(entry).is_absolute() else entry
                                for entry in record["images"]]
    return records


def image_files(records: list) -> List[Path]:
    """The image files the records name, for the tokenized cache's key."""
    return sorted({Path(e) for r in records if isinstance(r, dict) and isinstance(r.get("images"), list)
                   for e in r["images"] if isinstance(e, str) and Path(e).is_file()})


def image_bytes(entry, where: str) -> bytes:
    """One image of a record as its file's bytes (a path, a ``datasets`` Image value, or a PIL image), checked to decode."""
    if isinstance(entry, dict) and entry.get("bytes") is not None:
        data, name = bytes(entry["bytes"]), f"an image of {where}"
    elif isinstance(entry, (str, Path)) or (isinstance(entry, dict) and entry.get("path")):
        path = Path(entry["path"] if isinstance(entry, dict) else entry)
        if not path.is_file():
            raise LitftError(f"{where} names the image {path}, which does not exist; fix the path (relative paths start at the data file's folder)")
        data, name = path.read_bytes(), f"the image {path} of {where}"
    elif hasattr(entry, "save"):  # a PIL image
        buffer = io.BytesIO()
        entry.save(buffer, format="PNG")
        data, name = buffer.getvalue(), f"an image of {where}"
    else:
        raise LitftError(f"{where} has an image entry of type {type(entry).__name__}; give a file path")
    open_image(data, name)
    return data


def conversation(record: dict, where: str) -> Tuple[list, List[Tuple[int, int]]]:
    """The record's messages, and the (start, end) message ranges whose tokens are targets: each assistant turn of a chat,
    or the completion after the prompt."""
    if "messages" in record:
        messages = record["messages"]
        spans = [(t, t + 1) for t, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"]
        if not spans:
            raise LitftError(f"{where} has no assistant message to train on")
    elif isinstance(record.get("prompt"), list) and isinstance(record.get("completion"), list):
        messages = record["prompt"] + record["completion"]
        spans = [(len(record["prompt"]), len(messages))]
    else:
        raise LitftError(f"{where} carries images but no 'messages' list, nor 'prompt' and 'completion' message lists; "
                         "an image record is a conversation whose turns hold {'type': 'image'} parts")
    if not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise LitftError(f"{where} has a turn that is not a {{'role', 'content'}} object")
    return messages, spans


def image_token_ids(tokenizer) -> List[int]:
    """Special tokens that stand for or frame an image: never targets."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return sorted(i for i, token in added.items() if any(word in str(token).lower() for word in ("image", "vision", "img")))


class ImageRecords:
    """Tokenizes image records (and a vision dataset's text-only ones) with the processor of the tokenizer's folder."""

    def __init__(self, tokenizer, mask_prompt: bool):
        self.processor = load_processor(tokenizer.name_or_path)
        self.mask_prompt = mask_prompt
        self.never_targets = torch.tensor(image_token_ids(self.processor.tokenizer), dtype=torch.long)
        if not getattr(self.processor, "chat_template", None):
            raise LitftError(f"the processor of {tokenizer.name_or_path} has no chat template; image records are rendered with it")

    def render(self, messages: list, prompt: bool) -> str:
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)

    def tokens(self, text: str, images: list, where: str) -> torch.Tensor:
        if not text:
            return torch.zeros(0, dtype=torch.long)
        try:
            return processor_call(self.processor, [text], [images])["input_ids"][0]
        except ValueError as error:  # as the processors check a text against its images: a placeholder without a picture...
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            marks = [m for m in (getattr(self.processor, name, None) for name in ("image_token", "video_token")) if isinstance(m, str) and m]
            hint = (f"; a text that writes {' or '.join(repr(m) for m in marks)} (the model's image placeholder) is taken for a picture, "
                    "so write it another way" if any(text.count(m) > len(images) for m in marks) else "")
            raise LitftError(f"{where}: the processor refuses it ({reason}){hint}") from None

    def pair(self, record: dict, index: int, where: str, max_len: int) -> Optional[Sample]:
        """A preference pair about images (TRL's layout: ``prompt`` messages with image parts, ``chosen`` and ``rejected``
        responses as text or messages, ``images``) as one sample of two sequences (litft.data.preference's layout), each
        with the prompt's images; None where a sequence is longer than ``max_len``."""
        prompt = record.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            raise LitftError(f"{where} carries images, and its 'prompt' is not a list of {{'role', 'content'}} messages with the image parts")
        stored = self.images_of(record, prompt, where)
        images = [open_image(data) for data in stored]
        before = self.tokens(self.render(prompt, prompt=True), images, where)
        rows, texts = [], []
        for key in ("chosen", "rejected"):
            response = record.get(key)
            response = [{"role": "assistant", "content": response}] if isinstance(response, str) else response
            if not response or not isinstance(response, list) or image_parts(response):
                raise LitftError(f"{where}: '{key}' must be a non-empty text or list of assistant messages without images")
            text = self.render(prompt + response, prompt=False)
            ids = self.tokens(text, images, where)
            if not torch.equal(ids[: len(before)], before) or len(ids) == len(before):
                raise LitftError(f"the processor's chat template does not render {where} with its prompt first, so the responses cannot be told apart")
            rows.append(ids)
            texts.append(text)
        if max(len(ids) for ids in rows) > max_len:
            return None
        labels = [torch.cat([torch.full((len(before),), IGNORE_INDEX), ids[len(before):]]) for ids in rows]
        for row, ids in zip(labels, rows):
            row[torch.isin(ids, self.never_targets)] = IGNORE_INDEX
        return {"input_ids": torch.cat(rows), "labels": torch.cat(labels), "position_ids": torch.cat([torch.arange(len(ids)) for ids in rows]),
                "rejected_start": torch.tensor(len(rows[0])), "id": torch.tensor(index), "texts": texts, "images": stored}

    def images_of(self, record: dict, messages: list, where: str) -> List[bytes]:
        """The record's images, one per image part of ``messages``, as checked file bytes."""
        entries = record.get("images") or []
        if not isinstance(entries, list):
            raise LitftError(f"{where} has an 'images' field that is not a list")
        wanted = image_parts(messages)
        if wanted != len(entries):
            raise LitftError(f"{where} has {wanted} image part(s) in its turns and {len(entries)} image(s) in 'images'; "
                             "give one image per {'type': 'image'} part, in order")
        return [image_bytes(entry, where) for entry in entries]

    def prompt(self, record: dict, index: int, where: str, max_len: int, system: Optional[str] = None) -> Optional[Sample]:
        """An RL prompt about images (TRL's layout: ``prompt`` messages with the image parts, and ``images``), rendered with the
        generation prompt, as a sample; None where it leaves no room for a completion within ``max_len``."""
        prompt = record.get("prompt")
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) and "images" not in record else prompt  # a text prompt beside image ones
        if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            raise LitftError(f"{where} carries images, and its 'prompt' is not a list of {{'role', 'content'}} messages with the image parts")
        messages = ([{"role": "system", "content": system}] if system else []) + prompt
        stored = self.images_of(record, messages, where)
        text = self.render(messages, prompt=True)
        ids = self.tokens(text, [open_image(data) for data in stored], where)
        if len(ids) >= max_len:
            return None
        return {"input_ids": ids, "id": torch.tensor(index), "text": text, "images": stored}

    def encode(self, record: dict, index: int, where: str, max_len: int) -> Optional[Sample]:
        """The record as a sample, or None where it is longer than ``max_len`` (an image's tokens are never cut)."""
        messages, spans = conversation(record, where)
        stored = self.images_of(record, messages, where)
        images = [open_image(data) for data in stored]
        text = self.render(messages, prompt=False)
        ids = self.tokens(text, images, where)
        labels = ids.clone() if not self.mask_prompt else torch.full_like(ids, IGNORE_INDEX)
        for start, end in spans if self.mask_prompt else ():
            before = self.tokens(self.render(messages[:start], prompt=True) if start else "", images[: image_parts(messages[:start])], where)
            after = self.tokens(self.render(messages[:end], prompt=False), images[: image_parts(messages[:end])], where)
            if not (torch.equal(ids[: len(after)], after) and torch.equal(after[: len(before)], before)):
                raise LitftError(f"the processor's chat template does not render {where} incrementally, so its prompt cannot be "
                                 "masked; set --data.mask_prompt false")
            labels[len(before) : len(after)] = ids[len(before) : len(after)]
        labels[torch.isin(ids, self.never_targets)] = IGNORE_INDEX
        if len(ids) > max_len:
            return None
        return {"input_ids": ids, "labels": labels, "id": torch.tensor(index), "text": text, "images": stored}
