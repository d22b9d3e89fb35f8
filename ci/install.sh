#!/usr/bin/env bash
# Sets up .venv with shardcheck and its test tools, from nothing. Used by README and .ci/run.
# torch==2.13.0 goes first: an open torch range asked for alone pulls a CUDA build of several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# pip compiles each package's bytecode on one core (16 of torch's 22 s here): it is done after,
# on every core, by compileall (which, like pip, passes over files that do not compile).
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0
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
