"""``serve.mode=ray`` on this machine as a cluster: the tiny talker -> code2wav pipeline (issue 38).

One Ray cluster for the module (``ray.cluster_utils.Cluster``): a head node (the driver's) and two
worker nodes, each with a custom resource that pins a stage to it: both talker replicas on one
node, code2wav on the other, the edge's payload through the ``ray`` transport. So every request
crosses nodes: the talker's output to the driver, the code2wav payload from the driver's node to
code2wav's. Checked: the audio equals ``inproc``'s for the same seed; requests spread over the
talker's replicas; every payload object is freed; a talker replica killed under load fails its
in-flight requests with ``ReplicaDied`` (503 over HTTP), is restarted by Ray and serves again;
closing the pipeline leaves no actor and no reservation, and stopping the cluster no Ray process.
``omnigen run`` in ray mode (a local Ray of its own) closes the module: one request, WAV out, no
Ray process left.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import wave
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.e2e

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Fixtures of test_pipeline.py: the tiny stage models and the in-process pipeline, the reference
# for the same seeds.
from test_pipeline import ENGINE, check_outputs, inproc, prompts, sampling, stage_models  # noqa: E402, F401

REPO_ROOT = Path(__file__).resolve().parents[2]
LONG_TOKENS = 110  # a talker-only request long enough to be killed mid-way (prompt <= 8 tokens)


def ray_processes(pids: set[int]) -> set[int]:
    """Those of ``pids`` still alive (and not zombies)."""
    import psutil

    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def command_of(pid: int) -> str:
    """A process's command line ("" once it is gone), to name a survivor."""
    import psutil

    try:
        return " ".join(psutil.Process(pid).cmdline())[:300]
    except psutil.Error:
        return ""


def descendants(pid: int) -> set[int]:
    import psutil

    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_args(**args: Any) -> dict[str, Any]:
    """A node of the test cluster. Its agents' ports are chosen here: with port 0 each raylet
    waits for its agent to write the port it took, a wait a busy 2-core machine can outlast
    (the raylet then aborts: "Timed out waiting for file .../metrics_agent_port_...")."""
    return {
        "object_store_memory": 100 * 1024**2,
        "metrics_agent_port": free_port(),
        "metrics_export_port": free_port(),
        "dashboard_agent_listen_port": free_port(),
        "runtime_env_agent_port": free_port(),
        **args,
    }


@pytest.fixture(scope="module")
def cluster(tiny_engine_env):
    """Three Ray nodes on this machine; their processes are this test process's descendants."""
    from ray.cluster_utils import Cluster

    before = descendants(os.getpid())  # not Ray's: the tests' own engines and helpers
    ray_cluster = Cluster(initialize_head=True, head_node_args=node_args(num_cpus=1))
    talker_node = ray_cluster.add_node(**node_args(num_cpus=1, resources={"talker_host": 2}))
    code2wav_node = ray_cluster.add_node(**node_args(num_cpus=1, resources={"code2wav_host": 1}))
    ray_cluster.wait_for_nodes()
    started = descendants(os.getpid()) - before
    yield ray_cluster, talker_node.node_id, code2wav_node.node_id, started
    ray_cluster.shutdown()


@pytest.fixture(scope="module")
def on_cluster(cluster, stage_models):  # noqa: F811
    from omnigen import api
    from omnigen.serving.pipeline import Pipeline

    ray_cluster, *_ = cluster
    pipeline = Pipeline.from_model(
        api.served_model("omnigen_tiny", ["model.stages.talker.transport=ray"]),
        stage_models,
        mode="ray",
        engine_kwargs={"talker": ENGINE, "code2wav": ENGINE},
        # The committed edge is shm (one machine): across nodes, Ray's object store.
        ray={
            "address": ray_cluster.address,
            "env_vars": {"VLLM_CPU_KVCACHE_SPACE": 1},
            "replica": {"num_cpus": 0.25},
            "stages": {
                "talker": {"replicas": 2, "resources": {"talker_host": 1}, "max_restarts": 1},
                "code2wav": {"resources": {"code2wav_host": 1}},
            },
        },
    )
    yield pipeline
    if pipeline.loop.is_running():  # not closed by the test that closes it
        pipeline.close()


def test_stages_on_their_nodes_give_the_same_audio_as_in_process(cluster, on_cluster, inproc):  # noqa: F811
    import ray

    _, talker_node, code2wav_node, _ = cluster
    talker, code2wav = (stage.engine for stage in on_cluster.stages)
    assert {r.node for r in talker.replicas} == {talker_node}
    assert {r.node for r in code2wav.replicas} == {code2wav_node}
    assert ray.get_runtime_context().get_node_id() not in {talker_node, code2wav_node}

    requests = prompts(8)
    ours = on_cluster.generate(requests, sampling(seed=5))
    theirs = inproc.generate(requests, sampling(seed=5))
    check_outputs(ours, requests)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.payloads["talker"]["codes.audio"], b.payloads["talker"]["codes.audio"])
        torch.testing.assert_close(a.audio, b.audio, rtol=0, atol=1e-5)
    assert on_cluster.payload_bytes.get("ray", 0) > 0, "the code2wav payloads went through Ray"
    assert all(r.served >= 2 for r in talker.replicas), [r.served for r in talker.replicas]


def test_every_payload_object_is_freed(on_cluster):
    """The driver owns each payload object: an empty reference table means no node keeps one."""
    import ray

    from omnigen.serving import ray_transport

    on_cluster.generate(prompts(4), sampling())
    assert ray_transport.held() == []
    worker = ray._private.worker.global_worker
    deadline = time.monotonic() + 10
    while worker.core_worker.get_all_reference_counts() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker.core_worker.get_all_reference_counts() == {}
    # A worker learns which requests finished with the next step's batch: one more request per
    # replica first (one at a time, they alternate), then at most its own state is left (as
    # tests/e2e/test_pipeline.py checks inproc).
    for _ in range(len(on_cluster.stages[0].engine.replicas)):
        on_cluster.generate(prompts(1), sampling())
    for stage in on_cluster.stages:
        states = on_cluster.run(stage.engine.collective_rpc("omni_request_state")).result(60)
        assert len(states) == len(stage.engine.replicas)
        assert all(len(ids) <= 1 for state in states for ids in state.values()), (stage.plan.stage, states)


def test_a_replica_killed_under_load_fails_its_requests_and_comes_back(on_cluster):
    from vllm import SamplingParams
    from vllm.v1.engine.exceptions import EngineDeadError

    talker = on_cluster.stages[0].engine
    params = {
        "talker": SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    }
    futures = [on_cluster.submit(p, params, last_stage="talker") for p in prompts(8)]
    doomed = talker.replicas[0]
    deadline = time.monotonic() + 60
    while doomed.in_flight < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    old_pid = doomed.pid
    os.kill(old_pid, signal.SIGKILL)
    done, _ = concurrent.futures.wait(futures, timeout=180)
    assert len(done) == len(futures)
    failed = [f.exception() for f in futures if f.exception() is not None]
    served = [f.result() for f in futures if f.exception() is None]
    assert failed and served, (len(failed), len(served))
    for error in failed:
        assert isinstance(error, EngineDeadError) and "died while running request" in str(error), error
    assert all(len(out.token_ids["talker"]) == LONG_TOKENS for out in served)
    assert not talker.errored

    # Ray builds it again (max_restarts=1); meanwhile requests go to the other replica, and
    # once its new engine answers the next requests reach it.
    assert doomed.restarting
    check_outputs(on_cluster.generate(prompts(2), sampling()), prompts(2))
    deadline = time.monotonic() + 300
    while doomed.restarting and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not doomed.restarting and doomed.dead is None
    assert doomed.pid != old_pid
    before = doomed.served
    requests = prompts(6)
    check_outputs(on_cluster.generate(requests, sampling()), requests)
    assert doomed.served > before


def test_shm_is_refused_where_stages_can_land_on_other_nodes(cluster, on_cluster, stage_models):  # noqa: F811
    """The committed edge is shm: on this three-node cluster the start is refused before any
    replica starts, naming the key and the fix."""
    from omnigen.serving.pipeline import Pipeline
    from omnigen.serving.ray_stages import RayModeError

    ray_cluster, *_ = cluster
    with pytest.raises(RayModeError) as info:
        Pipeline.from_model("omnigen_tiny", stage_models, mode="ray", ray={"address": ray_cluster.address})
    message = str(info.value)
    assert "model.stages.talker.transport: shm is shared memory on one machine" in message
    assert "this Ray cluster has 3 nodes" in message and "set model.stages.talker.transport=ray" in message


def test_closing_leaves_no_actor_no_reservation_and_no_process(cluster, on_cluster):
    import ray

    ray_cluster, _, _, started = cluster
    replica_pids = {r.pid for stage in on_cluster.stages for r in stage.engine.replicas}
    total = None
    on_cluster.close()
    assert not ray.is_initialized(), "the pipeline joined the cluster, and left it"
    ray.init(address=ray_cluster.address)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            total, free = ray.cluster_resources(), ray.available_resources()
            if free == total and not ray.util.list_named_actors(all_namespaces=True):
                break
            time.sleep(0.2)
        assert ray.util.list_named_actors(all_namespaces=True) == []
        assert ray.available_resources() == total
    finally:
        ray.shutdown()
    deadline = time.monotonic() + 30  # a killed actor's process exits after Ray lets it go
    while ray_processes(replica_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_processes(replica_pids) == set()
    everything = started | {pid for pid in descendants(os.getpid()) if "ray" in command_of(pid)}
    ray_cluster.shutdown()
    deadline = time.monotonic() + 30
    while ray_processes(everything) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = {pid: command_of(pid) for pid in ray_processes(everything)}
    for pid in survivors:  # never left behind, whatever the verdict
        with contextlib.suppress(Exception):
            os.kill(pid, signal.SIGKILL)
    assert survivors == {}, "Ray processes outlived the cluster"


def test_omnigen_serve_in_ray_mode_answers_the_same_api_and_stops_clean(tmp_path):
    """``omnigen serve`` with a local Ray of its own: whole and streamed speech over HTTP, then
    SIGTERM stops the replicas and Ray (no process of the server's outlives it)."""
    import httpx
    import psutil
    from test_serve import SAMPLES, samples_of, start_server, stop_server

    base, process = start_server(
        tmp_path / "server.log",
        [
            "serve=omnigen_tiny",
            "serve.mode=ray",
            "model.stages.talker.transport=ray",
            "serve.ray.replica.num_cpus=0.5",
        ],
        {"VLLM_PLUGINS": "omnigen"},
    )
    try:
        under = psutil.Process(process.pid).children(recursive=True)
        assert any("raylet" in " ".join(_cmdline(p.pid)) for p in under), "the server started its own Ray"

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=base, timeout=120) as client:
                return await asyncio.gather(
                    *(client.post("/v1/audio/speech", json={"input": f"request {i}"}) for i in range(4)),
                    client.post(
                        "/v1/audio/speech",
                        json={"input": "streamed", "stream_format": "audio", "response_format": "pcm"},
                    ),
                )

        *whole, streamed = asyncio.run(run())
        for response in whole:
            assert response.status_code == 200, response.text
            assert samples_of(response.content) == SAMPLES
        assert streamed.status_code == 200 and len(streamed.content) == 2 * SAMPLES, streamed.text[:300]
        process.terminate()
        assert process.wait(120) == 128 + 15
    finally:
        stop_server(process)
    _, alive = psutil.wait_procs(under, timeout=30)
    for orphan in alive:  # never leave them to fill the machine's memory
        orphan.kill()
    assert not alive, [f"{p.pid} {_cmdline(p.pid)[:2]}" for p in alive]


def test_omnigen_run_in_ray_mode_leaves_no_ray_process(tmp_path):
    """The command a user runs: a local Ray of its own, one request, a WAV, nothing left."""
    import psutil

    output = tmp_path / "ray.wav"
    environment = {
        **{k: v for k, v in os.environ.items() if k not in ("VLLM_USE_V2_MODEL_RUNNER", "RAY_ADDRESS")},
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_PLUGINS": "omnigen",
        "PYTHONPATH": str(REPO_ROOT),
    }
    command = [
        sys.executable, "-m", "omnigen.cli", "run", "model=omnigen_tiny", "serve=omnigen_tiny",
        "serve.mode=ray", "model.stages.talker.transport=ray", "serve.ray.replica.num_cpus=0.5",
        "serve.seed=3", f"serve.output={output}",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment, start_new_session=True
    )
    seen: set[int] = set()
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        for pid in descendants(process.pid) - seen:
            _cmdline(pid)  # while it runs: afterwards it is gone
            seen.add(pid)
        time.sleep(0.2)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail("omnigen run in ray mode did not finish in 300 s")
    text = process.stdout.read().decode(errors="replace")
    assert process.returncode == 0, text[-4000:]
    assert "wrote" in text
    with wave.open(str(output)) as audio:
        assert audio.getnframes() == (12 - 1) * 4 * 4  # conf/serve/omnigen_tiny.yaml: 12 tokens
    assert any("raylet" in " ".join(_cmdline(pid)) for pid in seen), "Ray ran under omnigen run"
    deadline = time.monotonic() + 30
    while ray_processes(seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = ray_processes(seen)
    assert left == set(), [psutil.Process(p).cmdline() for p in left]


_CMDLINES: dict[int, list[str]] = {}


def _cmdline(pid: int) -> list[str]:
    import psutil

    if pid not in _CMDLINES:
        try:
            _CMDLINES[pid] = psutil.Process(pid).cmdline()
        except psutil.Error:
            _CMDLINES[pid] = []
    return _CMDLINES[pid]
