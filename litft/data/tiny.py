"""The task data of litft-tiny, generated from a seed so that no file needs to ship."""

from dataclasses import dataclass
from typing import List, Optional

from litft.data.sft import InstructionData, PromptStyle
from litft.errors import LitftError
from litft.tiny import TASKS, task_records


@dataclass
class TinyTasks(InstructionData):
    """Generated letter and number tasks (reverse, sort, add, count) with exact answers."""

    tasks: List[str] = TASKS
    """Which of reverse, sort, add, count to generate."""
    num_train: int = 4000
    """Training records."""
    num_val: int = 200
    """Validation records (also the prompts scored by --eval.score_samples)."""
    prompt_style: PromptStyle = "alpaca"
    """How records become text: alpaca headers, the tokenizer's chat template, or plain."""
    mask_prompt: bool = True
    """Train only on the answer tokens."""
    max_seq_length: Optional[int] = 64
    """Truncate samples to this many tokens."""
    packing: bool = False
    """Put several samples in one row of max_seq_length tokens, kept apart by position ids."""

    def records(self, seed: int):
        unknown = sorted(set(self.tasks) - set(TASKS))
        if unknown:
            raise LitftError(f"--data.tasks has unknown task(s) {unknown}; choose from {list(TASKS)}")
        if self.num_train < 1:
            raise LitftError("--data.num_train must be at least 1")
        tasks = tuple(self.tasks)
        # Validation comes from another seed, so scores measure answers the model never saw.
        return task_records(self.num_train, seed, tasks), task_records(self.num_val, seed + 10_000, tasks), "TinyTasks"
