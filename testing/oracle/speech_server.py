"""vllm-omni 0.30's speech serving layer around a stand-in engine client: its request building
(``OmniOpenAIServingSpeech._prepare_speech_generation`` with the model's TTS adapter), run as its
server runs it, for the differential tests of omnigen's request builders and the oracle chains.

Only what vllm-omni's server would get from a running engine is stood in for (``EngineStandIn``:
the model config, stage configs, default sampling and a ``generate`` that records its call); the
server's and the adapter's own code runs unmodified. vllm-omni is imported inside the functions
(it patches vLLM process-wide).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from omnigen.requests.base import SpeechInput
from omnigen_testing.real.cases.qwen3_tts_talker import ARCH, CODE2WAV_ARCH

CONFIGURED_MAX_TOKENS = 4096  # the talker's default sampling in vllm-omni's deploy/qwen3_tts.yaml


class EngineStandIn:
    """What ``OmniOpenAIServingSpeech`` reads of its engine client; ``generate`` records its call."""

    def __init__(self, model_config: Any, stage_configs: list[Any], sampling: list[Any]) -> None:
        self.model_config = model_config
        self.stage_configs = stage_configs
        self.default_sampling_params_list = sampling
        self.errored = False
        self.calls: list[dict[str, Any]] = []

    def generate(self, **kwargs: Any) -> object:
        self.calls.append(kwargs)
        return object()


def oracle_server(folder: Path, media_root: Path) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm_omni.model_executor.models.qwen3_tts.configuration_qwen3_tts import Qwen3TTSConfig

    model_config = SimpleNamespace(
        model=str(folder),
        hf_config=Qwen3TTSConfig.from_pretrained(str(folder)),
        allowed_local_media_path=str(media_root),
        allowed_media_domains=None,
        async_chunk=False,  # omnigen's conf/model/qwen3_tts.yaml
    )
    stages = [
        SimpleNamespace(
            engine_args=SimpleNamespace(model_stage="qwen3_tts", model_arch=ARCH, worker_type="ar")
        ),
        SimpleNamespace(
            engine_args=SimpleNamespace(
                model_stage="code2wav", model_arch=CODE2WAV_ARCH, worker_type="generation"
            )
        ),
    ]
    sampling = [
        SamplingParams(temperature=0.9, top_k=50, max_tokens=CONFIGURED_MAX_TOKENS, min_tokens=2),
        SamplingParams(temperature=0.0, max_tokens=65536),
    ]
    return serving_speech(EngineStandIn(model_config, stages, sampling), "qwen3_tts")


def serving_speech(engine: EngineStandIn, tts_model_type: str) -> Any:
    """vllm-omni's ``OmniOpenAIServingSpeech`` around ``engine``, as its ``__init__``
    (serving_speech.py:382-431) builds it less the OpenAIServing base, which wants a live engine:
    the same attributes in the same order. It must detect ``tts_model_type`` from the stages."""
    from vllm_omni.entrypoints.openai.serving_speech import OmniOpenAIServingSpeech

    server = OmniOpenAIServingSpeech.__new__(OmniOpenAIServingSpeech)
    server.engine_client = engine
    server.model_config = engine.model_config
    server._media_connector = None
    server._allowed_local_media_path = ""
    server.model_name = None
    server.forced_aligner_enabled = False
    server._init_speaker_storage()
    server._tts_stage = server._find_tts_stage()
    server._is_tts = server._tts_stage is not None
    server._tts_model_type = server._detect_tts_model_type()
    server._tts_executor = None
    server._adapter = None
    assert server._get_tts_adapter() is not None and server._tts_model_type == tts_model_type
    server._max_instructions_length = server._compute_max_instructions_length()
    server._tts_tokenizer = None
    server._speech_output_policies = {}
    server._batch_max_items = 32
    return server


def oracle_build(server: Any, request: SpeechInput) -> tuple[dict[str, Any], Any] | str:
    """vllm-omni's engine prompt and talker sampling for ``request``, or its refusal's text."""
    from vllm_omni.entrypoints.openai.protocol.audio import OpenAICreateSpeechRequest
    from vllm_omni.entrypoints.openai.serving_speech import _is_default_voice

    fields = {k: v for k, v in dataclasses.asdict(request).items() if v is not None}
    if "speaker_embedding" in fields:
        fields["speaker_embedding"] = list(fields["speaker_embedding"])
    try:
        speech = OpenAICreateSpeechRequest(**fields)
    except ValueError as exc:  # pydantic's ValidationError: the HTTP layer's 422
        return str(exc)
    # create_speech (serving_speech.py:2526), before _prepare_speech_generation.
    if speech.voice is not None and _is_default_voice(speech.voice.lower(), server._get_available_speakers()):
        speech.voice = None
    calls = server.engine_client.calls
    calls.clear()
    try:
        asyncio.run(server._prepare_speech_generation(speech, request_id="speech-oracle"))
    except ValueError as exc:
        return str(exc)
    [call] = calls
    return call["prompt"], call["sampling_params_list"][0]
