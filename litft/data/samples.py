"""What a sample is, and packing: whole samples side by side in rows of a fixed length."""

from typing import Dict, List

import torch

IGNORE_INDEX = -100  # a label that carries no loss

# A sample is {"input_ids": LongTensor[T], "labels": LongTensor[T], "id": int}; packed rows
# also carry "position_ids" that restart at 0 for every sample inside them.
Sample = Dict[str, torch.Tensor]

PACKING_WINDOW = 32


def pack(samples: List[Sample], max_length: int) -> List[Sample]:
    """Put whole samples side by side in rows of at most ``max_length`` tokens.

    Position ids restart at every sample; transformers turns such restarts into a
    block-diagonal causal mask, so packed samples do not attend to one another.
    Greedy first-fit in the given order keeps packing deterministic.
    """
    rows: List[List[Sample]] = []
    lengths: List[int] = []
    open_rows: List[int] = []  # the last few rows that still have room; a bounded search keeps packing linear
    for sample in samples:
        n = len(sample["input_ids"])
        for i in open_rows:
            if lengths[i] + n <= max_length:
                rows[i].append(sample)
                lengths[i] += n
                break
        else:
            rows.append([sample])
            lengths.append(n)
            open_rows = (open_rows + [len(rows) - 1])[-PACKING_WINDOW:]
    packed = []
    for row_id, row in enumerate(rows):
        labels = [s["labels"].clone() for s in row]
        for later in labels[1:]:
            # The first token of a sample is not predicted from the sample before it.
            later[0] = IGNORE_INDEX
        packed.append(
            {
                "input_ids": torch.cat([s["input_ids"] for s in row]),
                "labels": torch.cat(labels),
                "position_ids": torch.cat([torch.arange(len(s["input_ids"])) for s in row]),
                "id": torch.tensor(row_id),
            }
        )
    return packed
