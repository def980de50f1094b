"""A micro-batch's layout: the rows (padding-free or padded), where each sample starts, and the targets the loss reads."""

from typing import Dict, List

import torch

from litft.data.samples import IGNORE_INDEX, Sample

def collate(samples: List[Sample], pad_id: int, padding_free: bool = False) -> Dict[str, torch.Tensor]:
    """One micro-batch: its samples end to end in one row (``padding_free``), or right-padded rows (a pair's answers apart).

    Every batch carries position ids and no attention mask. A padding-free row's
    positions restart at every sample and its attention keeps the samples apart
    (``litft.model.attention``); a sample's first token is not trained on the sample before
    it. Padding carries no loss, and its positions count on from the row's last
    sample: a reset would read as a packed row and cost a dense S x S mask. Beside the
    tokens: where each sample starts (varlen), and the flat positions of the tokens
    that carry loss with the tokens they predict (for the loss on targets only).
    """
    lengths = torch.cat([attended_lengths(s) for s in samples])
    images = "images" in samples[0]  # samples that see images (litft.data.images): a padded row each, as transformers batches them
    if padding_free and not images:
        labels = [s["labels"].clone() for s in samples]
        for later in labels[1:]:
            later[0] = IGNORE_INDEX
        input_ids = torch.cat([s["input_ids"] for s in samples])[None]
        labels = torch.cat(labels)[None]
        position_ids = torch.cat([positions_of(s) for s in samples])[None]
    else:
        # A preference pair's chosen and rejected answers get a row each, so no layer that carries state (litft.model.recurrent)
        # reads one into the other and attention needs no block-diagonal mask; a packed row stays one row.
        pieces = [piece for s in samples for piece in (sequences_of(s) if "rejected_start" in s else [whole(s)])]
        width = max(len(ids) for ids, _, _ in pieces)
        input_ids = torch.full((len(pieces), width), pad_id, dtype=torch.long)
        labels = torch.full((len(pieces), width), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros((len(pieces), width), dtype=torch.long)
        real = torch.zeros((len(pieces), width), dtype=torch.bool)
        for row, (ids, targets, positions) in enumerate(pieces):
            n = len(ids)
            input_ids[row, :n], labels[row, :n], position_ids[row, :n], real[row, :n] = ids, targets, positions, True
            position_ids[row, n:] = torch.arange(width - n) + position_ids[row, n - 1] + 1
    batch = {
        "input_ids": input_ids, "labels": labels, "position_ids": position_ids,
        "ids": torch.stack([torch.as_tensor(s["id"]) for s in samples]),
        "num_tokens": lengths.sum(), "lengths": lengths,  # what attends together, for the FLOPs
        "varlen": cumulative_lengths(position_ids),
        "targets": targets_of(labels),
    }
    if images:  # the processor makes the image tensors from these at the step (litft.model.vision.ImageInputs); a pair: two rows
        texts = [s.get("texts") or [s["text"]] for s in samples]
        batch["texts"] = [text for row in texts for text in row]
        batch["images"] = [s["images"] for s, row in zip(samples, texts) for _ in row]
        if "text_tokens" in samples[0]:  # the text is the prompt alone (RL's rollouts): how many of the row's tokens it gives
            batch["text_tokens"] = [int(s["text_tokens"]) for s in samples]
    if not padding_free or images:
        batch["real"] = real  # the tokens that are not padding, for counts that must not see it (litft.model.experts)
    if "rejected_start" in samples[0]:  # preference pairs (litft.data.preference): two sequences each, chosen then rejected
        batch["pairs"] = len(samples)  # what the loss is a mean over; under context parallel, counted by one rank of the group
        batch["targets"]["sequence"] = sequence_of(batch["targets"]["index"], position_ids)
        if "reference" in samples[0]:  # log-probs of the reference model, scored before training
            batch["reference"] = torch.stack([s["reference"] for s in samples])
    return batch


def positions_of(sample: Sample) -> torch.Tensor:
    """A sample's position ids: its own (restarting at each sequence it holds), else 0..length-1."""
    return sample.get("position_ids", torch.arange(len(sample["input_ids"])))


def whole(sample: Sample) -> tuple:
    return sample["input_ids"], sample["labels"], positions_of(sample)


def sequences_of(sample: Sample) -> List[tuple]:
    """A sample's sequences (more than one where its position ids restart: a preference pair), each as (ids, labels, positions)."""
    positions = positions_of(sample)
    bounds = sample_starts(positions[None])[0].nonzero().flatten().tolist() + [len(positions)]
    return [(sample["input_ids"][a:b], sample["labels"][a:b], positions[a:b]) for a, b in zip(bounds, bounds[1:])]


def sequence_of(index: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Which sequence of the batch (counted over the flattened rows, where position ids restart) each flat position belongs to."""
    return (sample_starts(position_ids).flatten().cumsum(0) - 1)[index]


def targets_of(labels: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The flat positions of the tokens that carry loss, and the tokens they predict: token t predicts label t + 1."""
    predicted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).flatten()
    index = (predicted != IGNORE_INDEX).nonzero().flatten()
    return {"index": index, "labels": predicted[index]}


def attended_lengths(sample: Sample) -> torch.Tensor:
    """The lengths of the documents a sample attends as (a packed row is several), so MFU counts attention as it runs."""
    if "position_ids" not in sample:
        return torch.tensor([len(sample["input_ids"])])
    return sample_lengths(sample["position_ids"][None])


def sample_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Where a sample begins, in every row: wherever the position id does not count on by one."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def sample_lengths(position_ids: torch.Tensor) -> torch.Tensor:
    """Lengths of the samples of every row, in order."""
    begins = sample_starts(position_ids).flatten().nonzero().flatten()
    return torch.diff(begins, append=torch.tensor([position_ids.numel()], device=begins.device))


def cumulative_lengths(position_ids: torch.Tensor) -> dict:
    """The varlen keyword arguments of a batch (on the CPU, where collate made it): cumulative sample lengths and the longest.

    transformers hands them to every attention call, and FlashAttention-2 takes them as they are. Computed
    once per micro-batch before the model, so no layer reads anything back from the device.
    """
    lengths = sample_lengths(position_ids)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    longest = int(lengths.max())
    # litft_bounds: the same boundaries as host integers, for litft_segments' call per sample (model.py passes it to that path only).
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest, "litft_bounds": tuple(cu.tolist())}
