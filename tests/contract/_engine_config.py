"""A real ``VllmConfig`` for a tiny checkpoint, built in the test process.

Building it loads vLLM's general plugins (once per process): only omnigen's, as everywhere both
are installed, since vllm-omni's plugin patches vLLM and the default process must stay unpatched
(``tests/test_isolation.py``).
"""

from __future__ import annotations

from typing import Any

import pytest


def engine_config(checkpoint: str, **engine_args: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = {
        "model": checkpoint,
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "max_num_seqs": 4,
        "max_model_len": 64,
        **engine_args,
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_PLUGINS", "omnigen")
        return EngineArgs(**args).create_engine_config()
