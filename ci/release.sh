#!/usr/bin/env bash
# Builds a release and checks it as a user gets it (docs/release.md):
#   1. `python -m build`: an sdist and a wheel into dist/ (the version: shardcheck/__init__.py);
#   2. `twine check --strict` on both;
#   3. a fresh venv in a scratch folder holding only the wheel and its dependencies (no clone on
#      its path, run from outside the clone): `shardcheck --version`, `shardcheck run` on the
#      built-in default, and the pytest plugin's test file (examples/pytest_multigpu/).
# The build tools live in .venv/release-tools (made once); the scratch folder is removed on exit.
# Exit 0 when all of it passed; the first failing step's status otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
tools=.venv/release-tools
if [ ! -x "$tools/bin/twine" ]; then
  "$PY" -m venv "$tools"
  "$tools/bin/python" -m pip install -q --disable-pip-version-check build twine
fi
rm -rf dist
"$tools/bin/python" -m build --outdir dist . >/dev/null
ls dist
"$tools/bin/twine" check --strict dist/*

scratch=$(mktemp -d -t shardcheck-release-XXXXXX)
trap 'rm -rf "$scratch"' EXIT
"$PY" -m venv "$scratch/venv"
# torch first, pinned (an open range asked for alone pulls a CUDA build of several GB)
"$scratch/venv/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
"$scratch/venv/bin/python" -m pip install -q --disable-pip-version-check dist/shardcheck-*.whl pytest
cp examples/pytest_multigpu/test_shardcheck_regressions.py "$scratch/"
cd "$scratch"
# nothing of the clone is importable from here: shardcheck comes from the wheel
venv/bin/python -c 'import shardcheck, sys; assert "site-packages" in shardcheck.__file__, shardcheck.__file__; print("imported from", shardcheck.__file__)'
venv/bin/shardcheck --version
venv/bin/shardcheck run
venv/bin/python -m pytest -q -p no:cacheprovider test_shardcheck_regressions.py
echo "release check: passed"
