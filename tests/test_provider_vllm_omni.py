"""What omnigen's vllm-omni provider adapts for a CPU-only process (``omnigen/providers/vllm_omni.py``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("vllm_omni") is None, reason="vllm-omni is not installed")
def test_a_torch_build_without_cuda_answers_that_no_stream_captures() -> None:
    """Higgs Audio v3's code2wav asks ``torch.cuda.is_current_stream_capturing()`` before every
    decode; torch's CPU build raises there. After the provider's ``after_import`` it answers False,
    and vllm-omni's package (its patch of vLLM) was never imported. In a child process: the
    answer is process-wide."""
    code = "\n".join(
        [
            "import torch",
            "assert not torch.backends.cuda.is_built(), 'this test is about a torch build without CUDA'",
            "try:",
            "    torch.cuda.is_current_stream_capturing()",
            "except RuntimeError as exc:",
            "    print('before:', exc)",
            "from omnigen.providers import vllm_omni as provider",
            "provider.prepare()",
            "provider.after_import()",
            "print('after:', torch.cuda.is_current_stream_capturing())",
            "print('bare:', provider.is_bare(), 'patched:', provider.vllm_patched())",
        ]
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "before: Tried to instantiate dummy base class _cuda_isCurrentStreamCapturing" in lines, out.stdout
    assert "after: False" in lines and "bare: True patched: False" in lines, out.stdout
