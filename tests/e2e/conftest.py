"""What every engine run of the tiny models needs in its environment (the pipeline modules)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_engine_env(request):
    """vLLM on a small CPU with only omnigen's plugin; a module adds its own in ``EXTRA_ENV``.

    - ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB): the default takes minutes and most of the memory;
    - no ``VLLM_USE_V2_MODEL_RUNNER``: the generated worker and scheduler choose vLLM's V1 runner;
    - ``VLLM_PLUGINS=omnigen``: vllm-omni (installed as the oracle) ships a plugin that patches vLLM;
    - ``PYTHONPATH``: every process vLLM starts imports omnigen from this checkout.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
        mp.setenv("VLLM_PLUGINS", "omnigen")
        root = str(REPO_ROOT)
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        for name, value in getattr(request.module, "EXTRA_ENV", {}).items():
            mp.setenv(name, value)
        yield
