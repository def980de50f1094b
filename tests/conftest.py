"""Shared fixtures: one litft home per test session, the tiny model, and a CLI runner."""

import csv
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
    from litft.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    from litft.model import load_tokenizer

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


def read_metrics(out_dir):
    """Rows of the run's CSV log, as dicts of floats (empty cells dropped)."""
    with open(Path(out_dir) / "logs" / "csv" / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def step_losses(out_dir):
    return [row["loss"] for row in read_metrics(out_dir) if "loss" in row]


def final_value(out_dir, key):
    return [row[key] for row in read_metrics(out_dir) if key in row][-1]
