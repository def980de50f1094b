"""Several data sources in one run, each drawn in proportion to its weight, the same way for every run with the same seed."""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from litft.config import positive
from litft.data.base import DataModule, PreparedData
from litft.data.samples import Sample
from litft.errors import LitftError


def mixed_counts(sizes: List[int], weights: List[float]) -> List[int]:
    """Samples from each source in one epoch of the mix: its weight's share of all the sources' samples, rounded so they add up."""
    total, scale = sum(sizes), sum(weights)
    exact = [total * w / scale for w in weights]
    counts = [math.floor(x) for x in exact]
    # The rounding left over goes to the largest remainders (the first source on a tie).
    for i in sorted(range(len(sizes)), key=lambda i: (counts[i] - exact[i], i))[: total - sum(counts)]:
        counts[i] += 1
    return counts


def drawn(size: int, count: int, seed: int, source: int) -> List[int]:
    """``count`` positions of a source of ``size`` samples: seeded passes over it, each a new permutation, cut where the count ends."""
    picks: List[int] = []
    passes = 0
    while len(picks) < count:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + source * 1009 + passes)
        picks += torch.randperm(size, generator=generator).tolist()
        passes += 1
    return sorted(picks[:count]) if count <= size else picks[:count]


class MixedSamples(Sequence):
    """The mix's samples: (source, position) pairs over the sources' own samples; ids are unique across sources."""

    def __init__(self, parts: List[Sequence], picks: List[Tuple[int, int]], first_id: int = 0):
        self.parts, self.picks = parts, picks
        self.offsets = [first_id + sum(len(p) for p in parts[:i]) for i in range(len(parts))]

    def __len__(self) -> int:
        return len(self.picks)

    def __getitem__(self, i) -> Sample:
        source, position = self.picks[int(i)]
        sample = dict(self.parts[source][position])
        sample["id"] = torch.tensor(self.offsets[source] + position)
        return sample

    @property
    def lengths(self):
        own = [getattr(part, "lengths", None) for part in self.parts]
        return [own[s][j] if own[s] is not None else len(self.parts[s][j]["input_ids"]) for s, j in self.picks]


@dataclass
class Mix(DataModule):
    """Several data modules in one run: each epoch draws from each in proportion to its weight (repeating a small source, subsampling a large one)."""

    sources: List[DataModule] = field(default_factory=list)
    """The data modules to mix, each as --data would take it (class_path and init_args; easiest in a YAML file)."""
    weights: Optional[List[float]] = None
    """Each source's share of the mix, in the order of sources (default: in proportion to their sizes, i.e. all of each)."""

    def check(self) -> None:
        if not self.sources:
            raise LitftError("--data Mix needs --data.sources: a list of data modules")
        if self.weights is not None and len(self.weights) != len(self.sources):
            raise LitftError(f"--data.weights has {len(self.weights)} values for {len(self.sources)} sources; give one per source")
        for weight in self.weights or []:
            positive(weight, "--data.weights", "each source's share of the mix")
        for source in self.sources:
            if getattr(source, "streaming", False):
                raise LitftError("--data Mix mixes map-style data; a streamed source (streaming true) cannot be mixed yet")
            source.check()

    def names_images(self) -> bool:
        return any(source.names_images() for source in self.sources)

    def load_or_tokenize(self, tokenizer, seed: int) -> PreparedData:
        """Each source tokenized and cached on its own; the mix is only an order over their samples."""
        parts = [source.load_or_tokenize(tokenizer, seed) for source in self.sources]
        sizes = [len(p.train) for p in parts]
        counts = mixed_counts(sizes, self.weights or sizes)
        empty = [type(source).__name__ for source, size, count in zip(self.sources, sizes, counts) if count and not size]
        if empty:
            raise LitftError(f"the mixed source(s) {', '.join(empty)} hold no training sample; fix them or give them no weight")
        picks = [(s, j) for s, (size, count) in enumerate(zip(sizes, counts)) for j in drawn(size, count, seed, s)]
        val_picks = [(s, j) for s, p in enumerate(parts) for j in range(len(p.val))]
        return PreparedData(
            train=MixedSamples([p.train for p in parts], picks),
            val=MixedSamples([p.val for p in parts], val_picks, first_id=sum(sizes)),
            scoring=[prompt for p in parts for prompt in p.scoring],
        )
