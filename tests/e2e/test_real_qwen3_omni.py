"""Differential pipeline test: Qwen3-Omni chat completions through ``omnigen run``/``omnigen serve``
against vllm-omni's own pieces chained by hand.

One tiny real-shaped Qwen3-Omni checkpoint (``testing/checkpoints/qwen3_omni.py``: one folder for
the thinker, talker and code2wav, safetensors weights, a tokenizer with a chat template, voices
chelsie, ethan and aiden; three of its tensors scaled, ``SHARPENED``) serves a handful of chat
requests (one or several turns, string or list content, a system message, three voices or none)
two ways, and the text and the audio must be equal, sample for sample:

* omnigen: ``omnigen run`` (``serve.mode=inproc``, a subprocess) for one request given as
  ``serve.request.messages``, and ``omnigen serve`` (``mp``: an engine-core process per stage) on
  a free loopback port for every request, one at a time over HTTP (``POST /v1/chat/completions``
  with ``modalities: ["text", "audio"]``; the WAV is ``message.audio.data``, base64), then stopped
  with SIGTERM (it must exit 128 + 15 and leave no engine process behind).
* oracle: one subprocess (this module run as ``python -m tests.e2e.test_real_qwen3_omni oracle``)
  that imports vllm_omni (its patch.py runs) and chains vllm-omni 0.30's own pieces on vLLM's CPU
  engine, in the full-payload form omnigen runs (``async_chunk: false``):

  1. the request: vllm-omni's chat serving layer, ``OmniOpenAIServingChat._preprocess_chat`` on
     vLLM's ``ChatCompletionRequest`` (the messages rendered by vLLM's renderer with the
     checkpoint's chat template; the voice checked against ``talker_config.speaker_id`` and put
     in ``additional_information``), and ``_build_sampling_params_list_from_request`` over the
     deployment's default sampling (deploy/qwen3_omni_moe.yaml and pipeline.py: the thinker
     greedy, the talker at temperature 0.9, top_k 50, repetition_penalty 1.05, seed 42; the stop
     id is this checkpoint's codec EOS, which is the released 2150 that pipeline.py hard-codes);
  2. the thinker: ``vllm.LLM`` whose worker builds vllm-omni's ``GPUARModelRunner`` composed onto
     vLLM's ``CPUModelRunner`` (as ``testing/real/harness.py`` composes it), with vllm-omni's
     model_config fields of the stage (pipeline.py stage 0, ``custom_process_next_stage_input_func``
     = ``thinker2talker_full_payload``). The runner's own full-payload producer path runs and, once
     the request finished, builds the payload with vllm-omni's function; only the connector's
     transport is replaced (the payload is kept);
  3. the talker's prompt: vllm-omni's ``thinker2talker_token_only`` on the finished thinker output;
     the talker gets the thinker's payload over the prompt's ``additional_information``;
  4. the talker (stage 1, ``talker2code2wav_full_payload``), the same way;
  5. code2wav's prompt: the orchestrator's default (the talker's output ids), replaced as
     code2wav's scheduler replaces it when the payload arrives (``_extract_scheduling_metadata``
     and ``OmniSchedulingCoordinator.update_request_metadata``: the payload's flat codes);
  6. code2wav: vllm-omni's ``GPUGenerationModelRunner``; its ``model_outputs`` are the audio.

Both sides run the same engine arguments (``ChainSettings``: conf/serve/qwen3_omni.yaml's values,
vllm-omni's deploy values where it has them, with this test's small lengths and budgets), eager,
each request alone, and in the same order per process (``SEQUENCES``: the talker's code predictor
samples from the process-wide torch RNG). The text is vLLM's detokenization of the thinker's
tokens on both sides.

What is compared: each request's text and token counts (the served ``usage``); its 16-bit WAV
samples against the oracle's float audio written with omnigen's rule (``round(clip(x) * 32767)``),
exactly. ``modalities: ["text"]`` answers the same text with no audio. Negative controls: the oracle
also runs the first request with another voice and with another text, and omnigen's audio must
differ from each.

    .venv/bin/python -m pytest -q -m e2e tests/e2e/test_real_qwen3_omni.py
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

# Both import-light (vLLM and vllm-omni are imported in the oracle process only).
from omnigen_testing.oracle import runners
from omnigen_testing.qwen3_tts_chain import (  # the Qwen3-TTS oracle's helpers
    REPO_ROOT,
    ServerEnd,
    _b64,
    _nested,
    _unb64,
    finished_run,
    first_difference,
    free_port,
    kill_all,
    omnigen_environment,
    oracle_results,
    pcm16,
    require_vllm_omni,
    sharpen,
    stop_server,
    wait_healthy,
    wav_samples,
)

pytestmark = pytest.mark.e2e
require_vllm_omni()

MODULE = "tests.e2e.test_real_qwen3_omni"
ARCH = "Qwen3OmniMoeForConditionalGeneration"
MODEL_CLASS = f"vllm_omni.model_executor.models.qwen3_omni.qwen3_omni.{ARCH}"
GLUE = "vllm_omni.model_executor.stage_input_processors.qwen3_omni"
STAGES = ("thinker", "talker", "code2wav")

# deploy/qwen3_omni_moe.yaml stage 1 (and pipeline.py's sampling constraints).
TALKER_SAMPLING = {"temperature": 0.9, "top_k": 50, "repetition_penalty": 1.05, "seed": 42}

ORACLE_TIMEOUT_S = 900
SERVE_TIMEOUT_S = 420


@dataclasses.dataclass(frozen=True)
class ChainSettings:
    """The engine arguments and token budgets both sides run with (omnigen reads the rest from
    conf/serve/qwen3_omni.yaml; the oracle states the same values in ``oracle_engine``)."""

    max_num_seqs: int = 4
    max_model_len: int = 512
    thinker_max_tokens: int = 8
    """The thinker's configured budget (deploy: 2048), what a request that names none gets."""
    talker_max_tokens: int = 16
    """The talker's configured budget (deploy: 4096)."""

    def omnigen_overrides(self, checkpoint: Path) -> list[str]:
        found = [
            "model=qwen3_omni",
            f"serve.checkpoint={checkpoint}",
            f"serve.engine.max_num_seqs={self.max_num_seqs}",
            "serve.engine.dtype=bfloat16",
            "serve.engine.enforce_eager=true",
            f"serve.sampling.thinker.max_tokens={self.thinker_max_tokens}",
            f"serve.sampling.talker.max_tokens={self.talker_max_tokens}",
        ]
        for stage in STAGES:
            found += [
                f"serve.stage_engine.{stage}.max_model_len={self.max_model_len}",
                f"serve.stage_engine.{stage}.max_num_batched_tokens={self.max_model_len}",
            ]
        return found

    def oracle_engine(self, stage: str) -> dict[str, Any]:
        kwargs = {
            "trust_remote_code": True,
            "enable_prefix_caching": False,
            "max_num_seqs": self.max_num_seqs,
            "language_model_only": True,
            "dtype": "bfloat16",
            "enforce_eager": True,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_model_len,
            "skip_tokenizer_init": stage != "thinker",
        }
        if stage == "code2wav":
            kwargs |= {"enable_chunked_prefill": False, "async_scheduling": False}
        return kwargs


# The requests (the tiny tokenizer's words; a word outside it is [UNK], as any text may be).
# ``max_tokens`` None: the configured thinker budget, as ``omnigen run`` sends it.
REQUESTS: list[dict[str, Any]] = [
    {
        "id": "ethan",
        "messages": [{"role": "user", "content": "hello world what is your name"}],
        "voice": "ethan",
        "seed": 3,
        "max_tokens": 6,
    },
    {
        # A system message and list content (the template iterates parts), another voice.
        "id": "chelsie-system-parts",
        "messages": [
            {"role": "system", "content": "you are good"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "tell me a short story"},
                    {"type": "text", "text": "about sea and sky"},
                ],
            },
        ],
        "voice": "Chelsie",
        "seed": 5,
        "max_tokens": 8,
    },
    {
        # Several turns, no voice: the talker's default speaker (the first of speaker_id).
        "id": "default-turns",
        "messages": [
            {"role": "user", "content": "what is this"},
            {"role": "assistant", "content": "it is a song"},
            {"role": "user", "content": "sing the song please"},
        ],
        "max_tokens": 5,
    },
]
RUN_REQUEST = {**REQUESTS[1], "id": "run:chelsie-system-parts", "max_tokens": None, "seed": None}
CONTROLS = [
    {**REQUESTS[0], "id": "control:voice", "voice": "aiden"},
    {
        **REQUESTS[0],
        "id": "control:text",
        "messages": [{"role": "user", "content": "tell me a short story about sea and sky"}],
    },
]
SEQUENCES = [REQUESTS, [RUN_REQUEST], CONTROLS]
"""What each omnigen process's talker samples, in order (the server's requests; ``omnigen run``'s
one), and the negative controls: the oracle starts each from its start-up RNG state."""

# Tensors of the tiny checkpoint scaled by SHARPEN after it is written: the thinker's embeddings,
# so that its text depends on the prompt (with the writer's N(0, 0.05) weights most prompts give
# one repeated word); names and shapes stay the released ones.
SHARPENED = ("thinker.model.embed_tokens.weight",)
SHARPEN = 40.0

# The talker's code predictor samples its 15 residual codes of a frame from the process-wide torch
# RNG (vllm-omni's stored sampling mode: top-k 50, top-p 0.8, Gumbel noise from torch's default
# generator; its talker_mtp takes no generator), so a request's audio depends on the requests that
# process's talker sampled before it. vLLM seeds that RNG when each engine starts, and neither
# runner draws from it elsewhere: each omnigen process (the server's talker engine, ``omnigen
# run``'s one process) starts its requests from the state its start-up leaves, and the oracle
# replays each such sequence from the state its own start-up left (``SEQUENCES``).


def write_checkpoint(folder: Path) -> Path:
    """The tiny checkpoint (testing/checkpoints), its SHARPENED tensors scaled."""
    from omnigen_testing.checkpoints import write_qwen3_omni

    return sharpen(write_qwen3_omni(folder, seed=0), SHARPENED, SHARPEN)


def chat_body(spec: dict[str, Any], modalities: list[str] | None = None) -> dict[str, Any]:
    modalities = modalities or ["text", "audio"]
    body: dict[str, Any] = {"messages": spec["messages"], "modalities": modalities}
    if spec.get("voice") is not None and "audio" in modalities:
        body["audio"] = {"voice": spec["voice"], "format": "wav"}
    for key in ("seed", "max_tokens"):
        if spec.get(key) is not None:
            body[key] = spec[key]
    return body


# =========================================================================== oracle side

FLUSHED: dict[str, dict[str, Any]] = {}
CODE2WAV_OUTPUTS: dict[str, dict[str, Any]] = {}
_NUMBERS = itertools.count(1)


def _omni_fields(stage: str) -> dict[str, Any]:
    """vllm-omni's OmniModelConfig fields of each stage (qwen3_omni/pipeline.py, full payload)."""
    from omnigen_testing.real.harness import OMNI_MODEL_CONFIG_DEFAULTS

    common = {"model_arch": ARCH, "async_chunk": False}
    own = {
        "thinker": {
            "stage_id": 0,
            "model_stage": "thinker",
            "worker_type": "ar",
            "engine_output_type": "latent",
            "final_output": True,
            "hf_config_name": "thinker_config",
            "custom_process_next_stage_input_func": f"{GLUE}.thinker2talker_full_payload",
        },
        "talker": {
            "stage_id": 1,
            "model_stage": "talker",
            "worker_type": "ar",
            "engine_output_type": "latent",
            "hf_config_name": "talker_config",
            "custom_process_next_stage_input_func": f"{GLUE}.talker2code2wav_full_payload",
        },
        "code2wav": {
            "stage_id": 2,
            "model_stage": "code2wav",
            "worker_type": "generation",
            "engine_output_type": "audio",
            "final_output": True,
            "hf_config_name": "thinker_config",
        },
    }[stage]
    return {**OMNI_MODEL_CONFIG_DEFAULTS, **common, **own}


def _oracle_classes() -> dict[str, dict[str, Any]]:
    """Each stage's worker (qualified name) and scheduler class; the thinker and the talker share
    one runner class (each stage's fields, its hf_config_name among them, come with its worker)."""
    ar = runners.full_payload_ar_runner("OmniOracleARRunner", FLUSHED)
    code2wav = runners.generation_runner("OmniOracleCode2WavRunner", CODE2WAV_OUTPUTS)
    return {
        stage: runners.engine_classes(
            code2wav if stage == "code2wav" else ar,
            _omni_fields(stage),
            worker_name=f"OmniOracle_{stage}_Worker",
            scheduler_name=stage,
        )
        for stage in STAGES
    }


class EngineStandIn:
    """What ``OmniOpenAIServingChat`` reads of its engine client to build a request."""

    def __init__(self, model_config: Any, sampling: list[Any]) -> None:
        self.model_config = model_config
        self.default_sampling_params_list = sampling
        # pipeline.py: the thinker is the comprehension stage (its sampling takes the request's).
        self.stage_configs = [SimpleNamespace(is_comprehension=i == 0) for i in range(len(STAGES))]
        self.errored = False


class OmniOracleChain:
    """vllm-omni's chat serving layer, its three stage runners and its glue, chained by hand."""

    def __init__(self, checkpoint: Path, settings: ChainSettings) -> None:
        runners.load_vllm_omni(checkpoint, {ARCH: MODEL_CLASS})
        from vllm import LLM, SamplingParams
        from vllm_omni.entrypoints.openai.serving_chat import OmniOpenAIServingChat

        classes = _oracle_classes()
        self.settings = settings
        self.engines = {
            stage: LLM(model=str(checkpoint), **settings.oracle_engine(stage), **classes[stage])
            for stage in STAGES
        }
        thinker = self.engines["thinker"]
        eos = thinker.llm_engine.model_config.hf_config.talker_config.codec_eos_token_id
        sampling = [
            SamplingParams(temperature=0.0, max_tokens=settings.thinker_max_tokens, detokenize=True),
            SamplingParams(
                **TALKER_SAMPLING,
                max_tokens=settings.talker_max_tokens,
                detokenize=False,
                stop_token_ids=[eos],
            ),
            SamplingParams(
                temperature=0.0,
                top_p=1.0,
                top_k=-1,
                max_tokens=65536,
                repetition_penalty=1.1,
                detokenize=True,
            ),
        ]
        # OmniOpenAIServingChat less the OpenAIServing base, which wants a live engine client: the
        # attributes _preprocess_chat and the sampling builder read.
        server = OmniOpenAIServingChat.__new__(OmniOpenAIServingChat)
        server.engine_client = EngineStandIn(thinker.llm_engine.model_config, sampling)
        server.model_config = thinker.llm_engine.model_config
        server.renderer = thinker.renderer
        server._supported_speakers = None
        self.server = server
        import torch

        self.rng_after_start = torch.get_rng_state()

    def build(self, spec: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        """vllm-omni's thinker prompt and each stage's SamplingParams for one request."""
        import asyncio

        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        fields: dict[str, Any] = {"model": "qwen3_omni", "messages": spec["messages"]}
        fields |= {key: spec[key] for key in ("voice", "seed", "max_tokens") if spec.get(key) is not None}
        request = ChatCompletionRequest(**fields)
        request.modalities = ["text", "audio"]
        _, (prompt,) = asyncio.run(
            self.server._preprocess_chat(
                request,
                request.messages,
                default_template=None,
                default_template_content_format="auto",
                default_template_kwargs=None,
                renderer=self.server.renderer,
                add_generation_prompt=True,
                continue_final_message=False,
                add_special_tokens=False,
            )
        )
        return dict(prompt), self.server._build_sampling_params_list_from_request(request)

    def run(self, sequences: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """Every request, each sequence from the RNG state the engines' start-up left (see SEQUENCES)."""
        import torch

        results = []
        for sequence in sequences:
            torch.set_rng_state(self.rng_after_start)
            results += [{"id": spec.get("id"), **self._chain(*self.build(spec))} for spec in sequence]
        return results

    def _chain(self, prompt: dict[str, Any], params: list[Any]) -> dict[str, Any]:
        import numpy as np
        from vllm_omni.core.sched.omni_scheduling_coordinator import OmniSchedulingCoordinator
        from vllm_omni.distributed.omni_connectors.model_runner.omni_connector_payload_transport import (
            _OmniConnectorPayloadTransportMixin,
        )
        from vllm_omni.model_executor.stage_input_processors.qwen3_omni import thinker2talker_token_only

        from omnigen_testing.real.harness import ORACLE_PAYLOAD_KEY

        rid = f"oracle-{next(_NUMBERS)}"
        # 1. the thinker: the rendered ids; the request's additional_information (the speaker).
        thinker_params = params[0].clone()
        info = prompt.get("additional_information")
        if info:
            thinker_params.extra_args = {**(thinker_params.extra_args or {}), ORACLE_PAYLOAD_KEY: dict(info)}
        (thinker_out,) = runners.generate(
            self.engines["thinker"],
            [{"prompt_token_ids": list(prompt["prompt_token_ids"])}],
            [thinker_params],
            [rid],
        )
        (thinker_flushed,) = runners.flushed_payloads(self.engines["thinker"], FLUSHED, [rid])
        completion = thinker_out.outputs[0]

        # 2. the talker: the orchestrator's token-only prompt, the thinker's payload over its info.
        thinker_output = SimpleNamespace(
            request_id=rid,
            finished=True,
            prompt_token_ids=list(thinker_out.prompt_token_ids),
            outputs=[
                SimpleNamespace(
                    token_ids=list(completion.token_ids), cumulative_token_ids=list(completion.token_ids)
                )
            ],
        )
        (talker_prompt,) = thinker2talker_token_only([thinker_output], prompt)
        talker_info = {**(talker_prompt.get("additional_information") or {}), **thinker_flushed["payload"]}
        talker_params = params[1].clone()
        talker_params.extra_args = {**(talker_params.extra_args or {}), ORACLE_PAYLOAD_KEY: talker_info}
        talker_rid = f"{rid}-talker"
        (talker_out,) = runners.generate(
            self.engines["talker"],
            [{"prompt_token_ids": list(talker_prompt["prompt_token_ids"])}],
            [talker_params],
            [talker_rid],
        )
        (talker_flushed,) = runners.flushed_payloads(self.engines["talker"], FLUSHED, [talker_rid])
        payload = talker_flushed["payload"]

        # 3. code2wav: the orchestrator's default prompt (the talker's output ids), replaced in
        # code2wav's scheduler by the payload's codes when the payload arrives.
        request = SimpleNamespace(
            prompt_token_ids=list(talker_out.outputs[0].token_ids),
            num_prompt_tokens=len(talker_out.outputs[0].token_ids),
            _all_token_ids=[],
            _output_token_ids=[],
            num_computed_tokens=0,
        )
        metadata = _OmniConnectorPayloadTransportMixin._extract_scheduling_metadata(payload)
        OmniSchedulingCoordinator.update_request_metadata(
            SimpleNamespace(
                input_terminal_req_ids=set(),
                _stage_id=2,
                _flatten_prompt_token_ids=OmniSchedulingCoordinator._flatten_prompt_token_ids,
            ),
            {"c": request},
            {"c": metadata},
            "generation",
        )
        code2wav_params = params[2].clone()
        code2wav_params.max_tokens = 1
        code2wav_params.extra_args = {ORACLE_PAYLOAD_KEY: payload}
        code2wav_rid = f"{rid}-code2wav"
        runners.generate(
            self.engines["code2wav"],
            [{"prompt_token_ids": list(request.prompt_token_ids)}],
            [code2wav_params],
            [code2wav_rid],
        )
        audio, sample_rate = runners.code2wav_audio(CODE2WAV_OUTPUTS, code2wav_rid)
        return {
            "prompt_token_ids": [int(t) for t in prompt["prompt_token_ids"]],
            "speaker": (info or {}).get("speaker"),
            "text": completion.text,
            "thinker_token_ids": [int(t) for t in completion.token_ids],
            "finish_reason": completion.finish_reason,
            "talker_prompt_len": len(talker_prompt["prompt_token_ids"]),
            "talker_token_ids": [int(t) for t in talker_out.outputs[0].token_ids],
            "codes": [int(c) for c in request.prompt_token_ids],
            "audio": _b64(np.asarray(audio, dtype=np.float32)),
            "sample_rate": sample_rate,
            "nested_keys": sorted(_nested(dict(thinker_flushed["accumulated"]))),
        }

    def close(self) -> None:
        runners.shutdown(self.engines)


def oracle_main(argv: list[str]) -> int:
    """The oracle process: runs the sequences of requests of ``--requests`` (JSON) and prints one
    JSON line."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE} oracle")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--requests", required=True)
    parser.add_argument("--settings", default="{}")
    args = parser.parse_args(argv)
    answers = runners.oracle_answers(REPO_ROOT)
    started = time.time()
    chain = OmniOracleChain(args.checkpoint, ChainSettings(**json.loads(args.settings)))
    try:
        try:
            reply: dict[str, Any] = {"results": chain.run(json.loads(args.requests))}
        except Exception as exc:  # answered, so the caller reports it
            reply = runners.error_reply(exc)
    finally:
        chain.close()
    reply["wall_s"] = time.time() - started
    answers.write(json.dumps(reply) + "\n")
    return 0


# =========================================================================== pytest side

SETTINGS = ChainSettings()


def start_oracle(checkpoint: Path, sequences: list[list[dict[str, Any]]], log: Path) -> subprocess.Popen:
    args = ["--checkpoint", str(checkpoint), "--requests", json.dumps(sequences)]
    args += ["--settings", json.dumps(dataclasses.asdict(SETTINGS))]
    return runners.start_oracle_process(MODULE, args, log, REPO_ROOT)


def omnigen_command(command: str, checkpoint: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "omnigen.cli", command, *SETTINGS.omnigen_overrides(checkpoint), *extra]


def _hydra_messages(messages: list[dict[str, Any]]) -> str:
    """``serve.request.messages`` in Hydra's override grammar (the test's texts need no quoting)."""

    def value(item: Any) -> str:
        if isinstance(item, dict):
            return "{" + ", ".join(f"{k}: {value(v)}" for k, v in item.items()) + "}"
        if isinstance(item, list):
            return "[" + ", ".join(value(v) for v in item) + "]"
        return str(item)

    return f"serve.request.messages={value(messages)}"


def start_run(checkpoint: Path, spec: dict[str, Any], wav: Path, log: Path) -> subprocess.Popen:
    extra = ["serve.mode=inproc", f"serve.output={wav}", _hydra_messages(spec["messages"])]
    if spec.get("voice") is not None:
        extra.append(f"serve.request.voice={spec['voice']}")
    with log.open("w") as out:
        return subprocess.Popen(
            omnigen_command("run", checkpoint, *extra),
            cwd=REPO_ROOT,
            env=omnigen_environment(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def start_serve(checkpoint: Path, port: int, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            omnigen_command("serve", checkpoint, f"serve.port={port}"),
            cwd=REPO_ROOT,
            env=omnigen_environment(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop_session(process: subprocess.Popen) -> None:
    """A server the test did not stop: SIGTERM, then its whole session (its engine-core processes
    outlive a SIGKILLed server) killed."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


@dataclasses.dataclass
class Runs(ServerEnd):
    voices: dict[str, Any]
    oracle: dict[str, dict[str, Any]]
    served: dict[str, dict[str, Any]]
    """request id -> the chat completion's JSON (``text:ID``: the same request, text only)."""
    refusals: dict[str, Any]
    run_log: str
    run_wav: bytes


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """The oracle process, ``omnigen serve`` and ``omnigen run`` side by side; once the server is
    up every request goes to it, one at a time."""
    import httpx

    root = tmp_path_factory.mktemp("real_qwen3_omni")
    checkpoint = write_checkpoint(root / "checkpoint")
    oracle = start_oracle(checkpoint, SEQUENCES, root / "oracle.log")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    serve = start_serve(checkpoint, port, root / "serve.log")
    wav = root / "run.wav"
    run = start_run(checkpoint, RUN_REQUEST, wav, root / "run.log")
    try:
        wait_healthy(serve, base, root / "serve.log", SERVE_TIMEOUT_S)
        served: dict[str, dict[str, Any]] = {}
        refusals: dict[str, Any] = {}
        with httpx.Client(base_url=base, timeout=300) as client:
            voices = client.get("/v1/audio/voices").json()
            for spec in REQUESTS:
                response = client.post("/v1/chat/completions", json=chat_body(spec))
                assert response.status_code == 200, (
                    f"{spec['id']}: {response.status_code} {response.text[:2000]}"
                )
                served[spec["id"]] = response.json()
            text_only = client.post("/v1/chat/completions", json=chat_body(REQUESTS[0], ["text"]))
            assert text_only.status_code == 200, text_only.text[:2000]
            served[f"text:{REQUESTS[0]['id']}"] = text_only.json()
            speech = client.post("/v1/audio/speech", json={"input": "hello world", "voice": "ethan"})
            refusals["speech"] = (speech.status_code, speech.json())
            voice = client.post(
                "/v1/chat/completions", json={**chat_body(REQUESTS[0]), "audio": {"voice": "alloy"}}
            )
            refusals["voice"] = (voice.status_code, voice.json())
        end = stop_server(serve, root / "serve.log")
        run_wav = finished_run(run, wav, root / "run.log")
        out, _ = oracle.communicate(timeout=ORACLE_TIMEOUT_S)
    finally:
        _stop_session(serve)
        kill_all(oracle, run)
    return Runs(
        oracle=oracle_results(out, root / "oracle.log"),
        served=served,
        refusals=refusals,
        run_log=(root / "run.log").read_text(),
        run_wav=run_wav,
        voices=voices,
        **vars(end),  # ServerEnd: serve_exit, orphans, serve_log
    )


def oracle_pcm(runs: Runs, request_id: str) -> Any:
    return pcm16(_unb64(runs.oracle[request_id]["audio"]))


def served_pcm(runs: Runs, request_id: str) -> tuple[Any, int]:
    audio = runs.served[request_id]["choices"][0]["message"]["audio"]
    return wav_samples(base64.b64decode(audio["data"]))


def test_the_oracle_made_real_text_and_audio(runs: Runs):
    """The oracle's thinker wrote text, its talker codes reached code2wav (16 codes a frame, 8
    samples a frame), the audio is not silence, and each request's codes are its own: the
    equalities below are not those of empty or constant outputs."""
    import numpy as np

    for spec in [*REQUESTS, RUN_REQUEST, *CONTROLS]:
        result = runs.oracle[spec["id"]]
        assert result["text"].strip() and result["thinker_token_ids"], spec["id"]
        assert result["sample_rate"] == 24000
        assert result["codes"] and len(result["codes"]) % 16 == 0, spec["id"]
        assert len(np.unique(oracle_pcm(runs, spec["id"]))) > 10, spec["id"]
        assert len(result["thinker_token_ids"]) <= (spec["max_tokens"] or SETTINGS.thinker_max_tokens)
        assert len(result["talker_token_ids"]) <= SETTINGS.talker_max_tokens
    codes = [tuple(runs.oracle[spec["id"]]["codes"]) for spec in [*REQUESTS, *CONTROLS]]
    assert len(set(codes)) == len(codes)
    texts = {runs.oracle[spec["id"]]["text"] for spec in REQUESTS}
    assert len(texts) == len(REQUESTS), texts
    # vllm-omni's serving layer normalized the voice as the talker reads it.
    assert runs.oracle["chelsie-system-parts"]["speaker"] == ["chelsie"]


def test_served_text_equals_vllm_omni(runs: Runs):
    for spec in REQUESTS:
        answer, theirs = runs.served[spec["id"]], runs.oracle[spec["id"]]
        choice = answer["choices"][0]
        assert choice["message"]["content"] == theirs["text"], spec["id"]
        assert choice["finish_reason"] == theirs["finish_reason"]
        assert answer["usage"]["prompt_tokens"] == len(theirs["prompt_token_ids"])
        assert answer["usage"]["completion_tokens"] == len(theirs["thinker_token_ids"])
        assert answer["object"] == "chat.completion" and answer["model"] == "qwen3_omni"


def test_served_audio_equals_vllm_omni(runs: Runs):
    problems = []
    for spec in REQUESTS:
        ours, rate = served_pcm(runs, spec["id"])
        assert rate == runs.oracle[spec["id"]]["sample_rate"]
        problem = first_difference(ours, oracle_pcm(runs, spec["id"]))
        if problem:
            problems.append(f"{spec['id']}: {problem}")
    assert not problems, "omnigen serve's audio differs from vllm-omni's:\n" + "\n".join(problems)


def test_text_only_runs_the_thinker_alone(runs: Runs):
    answer = runs.served[f"text:{REQUESTS[0]['id']}"]
    message = answer["choices"][0]["message"]
    assert message["content"] == runs.oracle[REQUESTS[0]["id"]]["text"]
    assert "audio" not in message or message["audio"] is None


def test_run_text_and_audio_equal_vllm_omni(runs: Runs):
    """``omnigen run`` (inproc, messages from serve.request.messages, the configured thinker
    budget) prints the oracle's text and writes its audio."""
    theirs = runs.oracle[RUN_REQUEST["id"]]
    assert f"thinker: {theirs['text']}" in runs.run_log, runs.run_log[-3000:]
    ours, rate = wav_samples(runs.run_wav)
    assert rate == 24000
    assert first_difference(ours, oracle_pcm(runs, RUN_REQUEST["id"])) is None


def test_negative_controls_differ(runs: Runs):
    """Another voice or another text on the oracle side gives other audio: the comparison can
    fail, and would for a port that lost the voice or the text."""
    ours, _ = served_pcm(runs, REQUESTS[0]["id"])
    for control in CONTROLS:
        assert first_difference(ours, oracle_pcm(runs, control["id"])) is not None, control["id"]


def test_refusals_voices_and_shutdown(runs: Runs):
    """The speech route points to chat completions, an unknown voice is a 400 naming the voices,
    the server lists the checkpoint's voices, and SIGTERM stops it with no engine left behind."""
    status, body = runs.refusals["speech"]
    assert status == 400 and "/v1/chat/completions" in body["detail"]
    status, body = runs.refusals["voice"]
    assert status == 400 and "aiden, chelsie, ethan" in body["detail"]
    assert runs.voices["voices"] == ["aiden", "chelsie", "ethan"] and runs.voices["default"] == "aiden"
    assert runs.serve_exit == 128 + signal.SIGTERM, runs.serve_log[-3000:]
    assert not runs.orphans, runs.orphans
    assert "qwen3_omni: shutting down 3 stage engine(s)" in runs.serve_log


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "oracle":
        from tests.e2e import test_real_qwen3_omni as _self

        sys.exit(_self.oracle_main(sys.argv[2:]))
    sys.exit(f"usage: python -m {MODULE} oracle --checkpoint DIR --requests JSON")
