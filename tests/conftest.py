"""Shared fixtures: one litft home per test session, the tiny model, and a CLI runner."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Tests never reach the hub; offline mode makes a hub id fail at once instead of after retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def litft_home(tmp_path_factory):
    """Caches (tokenized data, litft-tiny) live in one temp folder, shared with subprocesses."""
    home = tmp_path_factory.mktemp("litft_home")
    os.environ["LITFT_HOME"] = str(home)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return home


@pytest.fixture(scope="session")
def tiny_dir(litft_home):
    from litft.model.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    from litft.model.loading import load_tokenizer

    return load_tokenizer(str(tiny_dir))


def run_cli(*args, timeout=300, check=True, env=None):
    """Run ``python -m litft`` in a fresh process, as a user would (``env``: variables added to this one's)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.run(
        [sys.executable, "-m", "litft", *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"litft {' '.join(map(str, args))} exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


# Runs litft with deepspeed.initialize patched to record, on every rank, how much of each
# parameter the rank holds when ZeRO is handed the model (after the fill).
RECORD_PARTITIONS = """
import json, os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed
import torch.distributed as dist
from deepspeed.runtime.zero.partition_parameters import GatheredParameters
gathered = []
gather = GatheredParameters.__init__
def counting(self, params, *args, **kwargs):
    gathered.extend(p.ds_numel for p in params if hasattr(p, "ds_id"))
    gather(self, params, *args, **kwargs)
GatheredParameters.__init__ = counting
initialize = deepspeed.initialize
def recording(*args, model=None, **kwargs):
    held = {n: [p.numel(), getattr(p, "ds_numel", None), p.ds_tensor.numel() if hasattr(p, "ds_tensor") else None, type(p).__name__]
            for n, p in model.named_parameters()}
    with open(os.path.join(os.environ["PARTITIONS"], f"rank-{dist.get_rank()}.json"), "w") as f:
        json.dump({"held": held, "gathered": sum(gathered)}, f)
    return initialize(*args, model=model, **kwargs)
deepspeed.initialize = recording
from litft.__main__ import main
main(sys.argv[1:])
"""


def run_recording_zero3_partitions(root: Path, *args, timeout=300):
    """Run litft with RECORD_PARTITIONS (its records in ``root``); per rank: ``{"held": {name: [numel, ds_numel, partition numel, type]}, "gathered": numel}``."""
    script = root / "record_partitions.py"
    script.write_text(RECORD_PARTITIONS)
    env = dict(os.environ, PARTITIONS=str(root), PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = sorted(root.glob("rank-*.json"))
    return [json.loads(path.read_text()) for path in ranks]


def read_metrics(out_dir):
    """Rows of the run's CSV log, as dicts of floats (empty cells dropped)."""
    with open(Path(out_dir) / "logs" / "csv" / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def step_losses(out_dir):
    return [row["loss"] for row in read_metrics(out_dir) if "loss" in row]


def final_value(out_dir, key):
    return [row[key] for row in read_metrics(out_dir) if key in row][-1]


def slurm_available() -> bool:
    """Whether a SLURM controller answers here; under LITFT_REQUIRE_SLURM=1 (CI starts one with .ci/slurm.sh) its absence fails."""
    import shutil

    if shutil.which("srun") and subprocess.run(["sinfo", "-h"], capture_output=True, timeout=30).returncode == 0:
        return True
    if os.environ.get("LITFT_REQUIRE_SLURM") == "1":
        raise AssertionError("LITFT_REQUIRE_SLURM=1 but no SLURM controller answers; run .ci/slurm.sh")
    return False
