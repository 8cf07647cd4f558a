#!/usr/bin/env bash
# Set up (if needed) and serve the default model on http://127.0.0.1:8000 (OpenAI API).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# int4 weights with bf16 activations where the CPU has native bf16 (passes the quality guard:
# tests/models/test_quant.py), and a 4 GiB host tier below the KV pool (evicted prefixes are
# kept in RAM, not dropped). Flags given to this script come after and win.
exec .venv/bin/kvreuse serve --dtype auto --quantization int4 --host-cache-memory 4 "$@"
