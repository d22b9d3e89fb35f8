#!/usr/bin/env bash
# Sets up .venv with shardcheck and its test tools, from nothing. Used by README and .ci/run.
# torch==2.13.0 goes first: an open torch range asked for alone pulls a CUDA build of several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
