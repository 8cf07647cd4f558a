#!/usr/bin/env bash
# Set up (if needed) and serve the default model on http://127.0.0.1:8000 (OpenAI API).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# kvreuse serve's defaults (int4 weights from the Q4 GGUF, bf16 activations; they pass the quality guard:
# tests/models/test_quant.py), and a 4 GiB host tier below the KV pool (evicted prefixes are
# kept in RAM, not dropped). Flags given to this script come after and win.
exec .venv/bin/kvreuse serve --host-cache-memory 4 "$@"
