# Sourced by scripts/setup.sh, scripts/test and .ci/run: where each supported vLLM version lives.
# The default version keeps .venv (what the README's commands use); another gets .venv-VERSION.
DEFAULT_VLLM=0.30

supported_vllm_versions() {
  ls requirements | sed -n 's/^vllm-//p'
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
