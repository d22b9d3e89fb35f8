#!/usr/bin/env bash
# The install step of the GitHub Action (action.yml at the repository root): torch first, pinned,
# then shardcheck from its spec. torch goes first because an open torch range asked for alone
# pulls a CUDA build of several GB; shardcheck's own range is then already met.
#
# Inputs, as the action's step sets them (the environment, never interpolated into this text):
#   SHARDCHECK_ACTION_TORCH  auto (default): the CUDA build where nvidia-smi works, else the CPU
#                            build; cpu; cuda; none (leave the torch the runner has)
#   SHARDCHECK_ACTION_SPEC   what pip installs shardcheck from (a version, a git URL, a folder);
#                            empty: the action's own folder ($GITHUB_ACTION_PATH)
#   SHARDCHECK_ACTION_PYTHON the python to install into (default: python, setup-python's)
set -euo pipefail
TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
python=${SHARDCHECK_ACTION_PYTHON:-python}
torch=${SHARDCHECK_ACTION_TORCH:-auto}
spec=${SHARDCHECK_ACTION_SPEC:-${GITHUB_ACTION_PATH:-}}

case "$torch" in
  auto | cpu | cuda | none) ;;
  *) echo "shardcheck action: torch must be auto, cpu, cuda or none, got '$torch'" >&2; exit 2 ;;
esac
if [ -z "$spec" ]; then
  echo "shardcheck action: no shardcheck-spec, and not run as an action (GITHUB_ACTION_PATH unset)" >&2
  exit 2
fi
if [ "$torch" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    torch=cuda why="nvidia-smi works"
  else
    torch=cpu why="no working nvidia-smi"
  fi
  echo "shardcheck action: torch's $torch build ($why)"
fi
pip=("$python" -m pip install --disable-pip-version-check)
case "$torch" in
  cpu) "${pip[@]}" --index-url "$CPU_INDEX" "torch==$TORCH_VERSION" ;;
  cuda) "${pip[@]}" "torch==$TORCH_VERSION" ;;
  none) "$python" -c 'import torch; print("shardcheck action: the runner'"'"'s torch", torch.__version__)' ;;
esac
"${pip[@]}" "$spec"
