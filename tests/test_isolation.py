"""The default group runs on unpatched vLLM (issue 7: nothing in the test path changes vLLM globally).

Importing vllm-omni (the comparison oracle) runs its ``patch.py``, which swaps vLLM's request and
output classes in every loaded ``vllm`` module. The oracle's own tests are marked ``oracle`` and run
in a pytest process of their own (``scripts/test``); the engine-level comparison imports vllm-omni
only in its oracle subprocess (``tests/e2e/real``). This module runs after the contract and
generator tests (pytest collects ``tests/`` packages first), so it sees whether any of them, or
the collection of ``tests/oracle``, imported it.
"""

from __future__ import annotations

import sys


def test_no_default_test_imported_vllm_omni():
    loaded = sorted(name for name in sys.modules if name == "vllm_omni" or name.startswith("vllm_omni."))
    assert not loaded, f"the default test process imported vllm-omni (patches vLLM): {loaded[:5]}"
