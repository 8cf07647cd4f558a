#!/usr/bin/env bash
# Set up (if needed) and serve the default model on http://127.0.0.1:8000 (OpenAI API).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# a 4 GiB host tier below the KV pool: evicted prefixes are kept in RAM, not dropped
exec .venv/bin/kvreuse serve --host-cache-memory 4 "$@"
