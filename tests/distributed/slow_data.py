"""A data module whose tokenization outlasts a short process-group timeout, on the rank that tokenizes first."""

import time
from dataclasses import dataclass

from litft.data import TinyTasks


@dataclass
class SlowTinyTasks(TinyTasks):
    """TinyTasks that take ``delay`` seconds longer to tokenize (the cache, once written, is read at once)."""

    delay: float = 8.0

    def tokenize(self, tokenizer, seed: int):
        time.sleep(self.delay)
        return super().tokenize(tokenizer, seed)
