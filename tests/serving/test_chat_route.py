"""``POST /v1/chat/completions`` on the real app (``make_app``) over Qwen3-Omni's plan and request
builder, with a pipeline that answers at once (no engines): the answer's OpenAI shape, what each
stage is asked to do, and every refusal by name. A speech model answers the route 404; a chat model
answers the speech route 400."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import wave
from types import SimpleNamespace

import httpx
import pytest
import torch

from omnigen import api
from omnigen import pipeline as omnigen_pipeline
from omnigen.glue import qwen3_omni as glue
from omnigen.glue.types import next_prompt_bound
from omnigen.pipeline_commands import serve_overrides
from omnigen.serving.http import make_app
from omnigen.serving.limits import StageLimits
from omnigen.serving.pipeline import PipelineOutput
from omnigen.serving.settings import read_settings


class AnsweringPipeline:
    """Records each submission and answers it at once (a plan, no engines)."""

    def __init__(self, plan, talker_room: int = 511):
        self.plan = plan
        talker_config = SimpleNamespace(num_code_groups=16)
        self.stages = [
            SimpleNamespace(plan=stage, engine=None, hf_config=SimpleNamespace(talker_config=talker_config))
            for stage in plan.stages
        ]
        self.limits = [
            StageLimits("thinker", False, 152064, 512, 511),
            StageLimits(
                "talker",
                False,
                3072,
                512,
                talker_room,
                prompt_bound=next_prompt_bound(glue.thinker2talker),
                bound_reads_producer_prompt=True,
            ),
            StageLimits(
                "code2wav", True, None, 65536, 65536, prompt_bound=next_prompt_bound(glue.talker2code2wav)
            ),
        ]
        self.payload_bytes = {}
        self.submitted: list[dict] = []

    def submit(self, prompt, sampling, request_id=None, payload=None, last_stage=None):
        self.submitted.append(
            {"prompt": prompt, "sampling": sampling, "payload": payload, "last_stage": last_stage}
        )
        out = PipelineOutput(
            request_id=request_id or "r",
            text={"thinker": "it is a song"},
            token_ids={"thinker": [5, 6, 7, 8]},
            finish_reasons={"thinker": "length"},
            audio=None if last_stage == "thinker" else torch.linspace(-0.5, 0.5, 160),
            seconds={"thinker": 0.1},
        )
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(out)
        return future


def _app(model: str, overrides: list[str]):
    overrides = serve_overrides(model, overrides)
    cfg = omnigen_pipeline.compose_config(model, overrides)
    plan = api.served_model(model, overrides)
    fake = AnsweringPipeline(plan)
    return make_app(fake, read_settings(cfg, plan)), fake


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from omnigen_testing.checkpoints import write_qwen3_omni

    return write_qwen3_omni(tmp_path_factory.mktemp("q3omni"), weights=False)


@pytest.fixture()
def omni(checkpoint):
    return _app("qwen3_omni", [f"serve.checkpoint={checkpoint}"])


def post(app, path: str, body: dict) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


HELLO = [{"role": "user", "content": "hello world"}]


def test_text_and_audio_in_openais_shape(omni):
    app, fake = omni
    response = post(
        app,
        "/v1/chat/completions",
        {
            "messages": HELLO,
            "modalities": ["text", "audio"],
            "audio": {"voice": "Ethan", "format": "wav"},
            "seed": 3,
            "temperature": 0.5,
            "max_completion_tokens": 9,
        },
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "chat.completion" and answer["model"] == "qwen3_omni"
    assert answer["id"].startswith("chatcmpl-")
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "it is a song"
    audio = choice["message"]["audio"]
    assert audio["id"].startswith("audio-") and audio["expires_at"] > 0 and audio["transcript"] == ""
    with wave.open(io.BytesIO(base64.b64decode(audio["data"]))) as wav:
        assert (wav.getframerate(), wav.getnframes(), wav.getnchannels()) == (24000, 160, 1)
    assert answer["usage"] == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
    (sent,) = fake.submitted
    assert sent["last_stage"] is None and sent["payload"] == {"speaker": ["ethan"]}
    thinker, talker = sent["sampling"]["thinker"], sent["sampling"]["talker"]
    # The request's seed, budget and temperature are the thinker's; the talker keeps its own.
    assert (thinker.seed, thinker.max_tokens, thinker.temperature, thinker.detokenize) == (3, 9, 0.5, True)
    assert (talker.seed, talker.max_tokens, talker.temperature, talker.top_k) == (42, 4096, 0.9, 50)
    assert talker.stop_token_ids == [2150] and not talker.ignore_eos and talker.extra_args is None


def test_text_only_stops_after_the_thinker_and_audio_only_has_no_content(omni):
    app, fake = omni
    text = post(app, "/v1/chat/completions", {"messages": HELLO, "modalities": ["text"]})
    assert text.status_code == 200, text.text
    message = text.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "it is a song"}
    assert fake.submitted[-1]["last_stage"] == "thinker"
    audio = post(app, "/v1/chat/completions", {"messages": HELLO, "modalities": ["audio"]})
    message = audio.json()["choices"][0]["message"]
    assert message["content"] is None and message["audio"]["data"]
    # No modalities: every output the model has (vllm-omni's default), no voice: the model's default.
    both = post(app, "/v1/chat/completions", {"messages": HELLO})
    assert both.json()["choices"][0]["message"]["audio"] and fake.submitted[-1]["payload"] == {}


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"stream": True}, 400, "stream: streaming chat completions are not built yet"),
        ({"n": 2}, 400, "n: 2; this server answers one choice per request"),
        (
            {"modalities": ["video"]},
            400,
            "modalities: 'video' is not an output of qwen3_omni (allowed: text, audio)",
        ),
        ({"modalities": []}, 400, "modalities: none is an output"),
        ({"modalities": ["text", "text"]}, 400, "names an output twice"),
        ({"audio": {"voice": "ethan", "format": "mp3"}}, 400, "audio.format: 'mp3'; this server writes wav"),
        (
            {"modalities": ["text"], "audio": {"voice": "ethan"}},
            400,
            'audio: the audio parameters need "audio"',
        ),
        (
            {"audio": {"voice": "ethan"}, "voice": "chelsie"},
            400,
            "audio.voice 'ethan' and voice 'chelsie' disagree",
        ),
        ({"audio": {"voice": "alloy"}}, 400, "voice: unknown voice 'alloy' (allowed: aiden, chelsie, ethan)"),
        ({"language": "English"}, 400, "language: Qwen3-Omni's talker takes no language"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, 400, "name the same budget"),
        ({"model": "gpt-4o"}, 404, "this server serves 'qwen3_omni', not 'gpt-4o'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            "messages[0].content[0].type: 'image_url' content is not served",
        ),
        ({"messages": [{"role": "user", "content": "hi", "name": "me"}]}, 400, "messages[0].name"),
        ({"tools": []}, 422, "extra_forbidden"),
        ({"audio": {"voice": "ethan", "speed": 2}}, 422, "extra_forbidden"),
        ({"temperature": -1}, 422, "greater_than_equal"),
    ],
)
def test_refusals_name_the_field(omni, body, status, says):
    app, fake = omni
    response = post(app, "/v1/chat/completions", {"messages": HELLO, **body})
    assert response.status_code == status, response.text
    assert says in str(response.json())
    assert not fake.submitted  # nothing reached the pipeline


def test_a_prompt_the_talker_cannot_take_is_refused_before_the_thinker_runs(checkpoint):
    app, fake = _app("qwen3_omni", [f"serve.checkpoint={checkpoint}"])
    fake.limits[1] = StageLimits(
        "talker",
        False,
        3072,
        512,
        15,
        prompt_bound=next_prompt_bound(glue.thinker2talker),
        bound_reads_producer_prompt=True,
    )
    # hello world: its user turn is 7 ids, with the reply's 9 positions 16 > 15.
    response = post(app, "/v1/chat/completions", {"messages": HELLO})
    assert response.status_code == 400
    assert (
        "messages: the request becomes at least 16 prompt tokens of stage 'talker'"
        in response.json()["detail"]
    )
    assert not fake.submitted
    # Text only: the talker never runs, so its context does not matter.
    assert post(app, "/v1/chat/completions", {"messages": HELLO, "modalities": ["text"]}).status_code == 200


def test_the_speech_routes_point_a_chat_model_to_chat_completions(omni):
    app, fake = omni
    for path in ("/v1/audio/speech", "/v1/omnigen/generate"):
        response = post(app, path, {"input": "hello", "voice": "ethan"})
        assert response.status_code == 400
        assert "qwen3_omni is a chat model" in response.json()["detail"]
        assert "POST /v1/chat/completions" in response.json()["detail"]
    assert not fake.submitted


def test_a_speech_model_answers_chat_completions_404(tmp_path):
    from omnigen_testing.checkpoints import write_qwen3_tts

    folder = write_qwen3_tts(tmp_path / "tts", "custom_voice")
    app, fake = _app("qwen3_tts", [f"serve.checkpoint={folder}"])
    response = post(app, "/v1/chat/completions", {"messages": HELLO})
    assert response.status_code == 404
    assert response.json()["detail"] == (
        "qwen3_tts is not a chat model (it has no chat request builder): send POST /v1/audio/speech"
    )
    tiny, _ = _app("omnigen_tiny", [])
    assert post(tiny, "/v1/chat/completions", {"messages": HELLO}).status_code == 404
    assert not fake.submitted
