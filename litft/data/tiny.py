"""The task data of litft-tiny, generated from a seed so that no file needs to ship."""

import random
from dataclasses import dataclass
from typing import Dict, List, Optional

from litft.config import at_least
from litft.data.sft import InstructionData, PromptStyle
from litft.errors import LitftError

LETTERS = "abcdefghijklmnop"

# name -> (instruction, how the answer follows from the letters or numbers)
TASKS = ("reverse", "sort", "add", "count")
INSTRUCTIONS = {
    "reverse": "Reverse the letters.",
    "sort": "Sort the letters.",
    "add": "Add the numbers.",
    "count": "Count the letters.",
}


def task_record(rng: random.Random, task: str) -> Dict[str, str]:
    """One instruction record of a task; answers are exact, so a model can be scored by exact match."""
    if task == "add":
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        return {"instruction": INSTRUCTIONS[task], "input": f"{a} + {b}", "output": str(a + b)}
    letters = [rng.choice(LETTERS) for _ in range(rng.randint(3, 6))]
    answer = {
        "reverse": " ".join(reversed(letters)),
        "sort": " ".join(sorted(letters)),
        "count": str(len(letters)),
    }[task]
    return {"instruction": INSTRUCTIONS[task], "input": " ".join(letters), "output": answer}


def check_tiny(tasks, num_train: int, num_val: int) -> None:
    """The checks every generated TinyTasks set shares (instruction records, preference pairs, RL prompts)."""
    at_least(num_train, 1, "--data.num_train")
    at_least(num_val, 0, "--data.num_val")
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise LitftError(f"--data.tasks has unknown task(s) {unknown}; choose from {list(TASKS)}")


def task_records(n: int, seed: int, tasks=TASKS) -> List[Dict[str, str]]:
    rng = random.Random(seed)
    return [task_record(rng, tasks[i % len(tasks)]) for i in range(n)]


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

    def check(self) -> None:
        super().check()
        check_tiny(self.tasks, self.num_train, self.num_val)

    def records(self, seed: int):
        tasks = tuple(self.tasks)
        # Validation comes from another seed, so scores measure answers the model never saw.
        return task_records(self.num_train, seed, tasks), task_records(self.num_val, seed + 10_000, tasks), "TinyTasks"
