"""Differential test: omnigen's Higgs Audio v3 request builder against vllm-omni 0.30's speech
serving layer.

The tiny Higgs checkpoint's config and tokenizer (``testing/real/cases/higgs_audio_v3.py``)
serve the same requests to omnigen's ``HiggsAudioV3RequestBuilder`` and to vllm-omni's own path:
``OmniOpenAIServingSpeech`` with its ``HiggsAudioV3Adapter``, driven through
``_prepare_speech_generation`` (validate, build, the sampling overrides) after ``create_speech``'s
``default`` voice step, around the stand-in engine client of ``tests/oracle/test_request_builders.py``
(its model config, stage configs, default sampling params and a ``generate`` that records its
call). Where both accept a request, the talker's prompt ids must be equal, neither sends a
payload (``additional_information``) or a cache salt, and the talker's ``max_tokens`` is the
same. Where one refuses and the other does not, the request must fall under a difference named
in ``DIFFERENCES`` in the direction it states, and omnigen's ``RequestError`` must name the field
it states.

vllm-omni is imported only inside these tests (it patches vLLM process-wide): the oracle group
runs in a pytest process of its own (``-m oracle``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnigen.requests.base import BuiltRequest, RequestError, SpeechInput
from omnigen.requests.higgs_audio_v3 import UNUSED_OPTIONS, HiggsAudioV3RequestBuilder
from omnigen_testing.real.cases import higgs_audio_v3 as tiny
from tests.request_builders import data_uri, wav_bytes

if importlib.util.find_spec("vllm_omni") is None:
    pytest.skip(
        "vllm-omni (the comparison oracle) is not installed: it is tied to vLLM 0.30 (requirements/vllm-0.30)",
        allow_module_level=True,
    )
pytestmark = pytest.mark.oracle

CONFIGURED_MAX_TOKENS = (
    2048  # the talker's default sampling in vllm-omni's deploy/higgs_multimodal_qwen3.yaml
)
# vllm-omni's higgs_audio_v3/pipeline.py: the talker's sampling constraints (the released ids).
RELEASED_STOP_TOKEN_IDS = [151643, 151671]

# Each: (which side refuses, the field omnigen names, why).
DIFFERENCES: dict[str, tuple[str, str | None, str]] = {
    "options_the_adapter_never_reads": (
        "omnigen",
        None,  # the option's own name (one of UNUSED_OPTIONS)
        "vllm-omni's Higgs adapter accepts language, instructions, task_type, x_vector_only_mode, "
        "speaker_embedding and non_streaming_mode and drops them; omnigen refuses each, naming it",
    ),
    "ref_text_without_ref_audio": (
        "omnigen",
        "ref_text",
        "without ref_audio vllm-omni's prompt builder drops ref_text; omnigen refuses it",
    ),
}


def higgs_oracle_server(
    folder: Path, media_root: Path, default_max_tokens: int = CONFIGURED_MAX_TOKENS
) -> Any:
    """vllm-omni's speech serving object for a Higgs Audio v3 deployment of ``folder`` (both stages),
    its engine client stood in (``omnigen_testing.oracle.speech_server``'s ``EngineStandIn``), its
    default sampling list vllm-omni's deploy values (stop ids: the released ones, as its pipeline
    hard-codes them)."""
    from vllm.sampling_params import SamplingParams
    from vllm_omni.transformers_utils.configs.higgs_audio_v3 import HiggsAudioV3Config

    from omnigen_testing.oracle.speech_server import EngineStandIn, serving_speech

    model_config = SimpleNamespace(
        model=str(folder),
        hf_config=HiggsAudioV3Config.from_pretrained(str(folder)),
        allowed_local_media_path=str(media_root),
        allowed_media_domains=None,
        async_chunk=False,  # omnigen's conf/model/higgs_audio_v3.yaml
    )
    stages = [
        SimpleNamespace(
            engine_args=SimpleNamespace(
                model_stage="higgs_audio_v3", model_arch=tiny.ARCH, worker_type="ar", model=str(folder)
            )
        ),
        SimpleNamespace(
            engine_args=SimpleNamespace(
                model_stage="code2wav",
                model_arch=tiny.CODE2WAV_ARCH,
                worker_type="generation",
                model=str(folder),
            )
        ),
    ]
    sampling = [
        SamplingParams(
            temperature=1.0,
            top_p=0.95,
            top_k=50,
            max_tokens=default_max_tokens,
            seed=42,
            repetition_penalty=1.0,
            detokenize=False,
            stop_token_ids=list(RELEASED_STOP_TOKEN_IDS),
        ),
        SamplingParams(
            temperature=0.0, top_p=1.0, top_k=-1, max_tokens=65536, seed=42, repetition_penalty=1.0
        ),
    ]
    return serving_speech(EngineStandIn(model_config, stages, sampling), "higgs_audio_v3")


def oracle_build(server: Any, request: SpeechInput) -> tuple[dict[str, Any], Any] | str:
    """vllm-omni's engine prompt and talker sampling, or its refusal's text (for a reference clip
    here: its failure, torchaudio being absent)."""
    from omnigen_testing.oracle.speech_server import oracle_build as build

    try:
        return build(server, request)
    except Exception as exc:  # noqa: BLE001  (the clone path's torchaudio failure)
        if request.ref_audio is None:
            raise
        found: BaseException | None = exc
        chain = []
        while found is not None:  # vllm-omni re-raises the ImportError as a RuntimeError
            chain.append(f"{type(found).__name__}: {found}".strip())
            found = found.__cause__
        return " <- ".join(chain)


def differences(request: SpeechInput) -> dict[str, set[str | None]]:
    """The named differences ``request`` falls under, each with the fields omnigen may name."""
    named: dict[str, set[str | None]] = {}
    unused = {name for name in UNUSED_OPTIONS if getattr(request, name) is not None}
    if unused:
        named["options_the_adapter_never_reads"] = set(unused)
    if request.ref_text is not None and request.ref_audio is None:
        named["ref_text_without_ref_audio"] = {"ref_text"}
    return named


def check(builder: HiggsAudioV3RequestBuilder, server: Any, request: SpeechInput) -> str:
    """Compares both sides on ``request``; returns how it went."""
    try:
        built: BuiltRequest | RequestError = builder.build(request)
    except RequestError as exc:
        built = exc
    theirs = oracle_build(server, request)
    if isinstance(built, RequestError) and isinstance(theirs, str):
        return "both refuse"
    if isinstance(built, BuiltRequest) and not isinstance(theirs, str):
        prompt, sampling = theirs
        assert built.prompt["prompt_token_ids"] == prompt["prompt_token_ids"], request
        assert "additional_information" not in prompt and built.payload == {}, request
        assert "cache_salt" not in prompt and "cache_salt" not in built.prompt, request
        budget = built.max_tokens if built.max_tokens is not None else CONFIGURED_MAX_TOKENS
        assert budget == sampling.max_tokens, request
        return "both accept"
    refuser = "omnigen" if isinstance(built, RequestError) else "vllm-omni"
    explained = [
        name
        for name, fields in differences(request).items()
        if DIFFERENCES[name][0] == refuser and (refuser == "vllm-omni" or built.field in fields)  # type: ignore[union-attr]
    ]
    detail = built if isinstance(built, RequestError) else theirs
    assert explained, f"{refuser} alone refuses {request}: {detail}"
    return f"{refuser} alone refuses ({', '.join(sorted(explained))})"


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _oracle_environment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    from omnigen_testing.real.harness import install_standins

    saved = {key: os.environ.get(key) for key in ("HF_HUB_OFFLINE", "SPEAKER_SAMPLES_DIR", "VLLM_PLUGINS")}
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["SPEAKER_SAMPLES_DIR"] = str(tmp_path_factory.mktemp("speakers"))
    os.environ["VLLM_PLUGINS"] = "omnigen"
    install_standins()  # vllm-omni's audio utilities import torchaudio at module level
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@dataclasses.dataclass
class Side:
    builder: HiggsAudioV3RequestBuilder
    server: Any
    clip: str


@pytest.fixture(scope="module")
def side(tmp_path_factory: pytest.TempPathFactory, _oracle_environment: None) -> Side:
    root = tmp_path_factory.mktemp("higgs_builder")
    media = root / "media"
    media.mkdir()
    folder = tiny.write_checkpoint(root / "checkpoint")
    builder = HiggsAudioV3RequestBuilder(folder, default_max_tokens=CONFIGURED_MAX_TOKENS)
    return Side(builder, higgs_oracle_server(folder, media), data_uri(wav_bytes(1.5, rate=24000, seed=5)))


# -- requests -----------------------------------------------------------------------------------

TEXT_WORDS = [*tiny.WORDS, "unknown", "Hello,", "<|audio|>"]


def words(min_size: int = 1, max_size: int = 10) -> st.SearchStrategy[str]:
    return st.lists(st.sampled_from(TEXT_WORDS), min_size=min_size, max_size=max_size).map(" ".join)


def requests() -> st.SearchStrategy[SpeechInput]:
    def mostly(valid: list[Any], invalid: list[Any]) -> st.SearchStrategy[Any]:
        return st.sampled_from(valid * 10 + invalid)

    return st.builds(
        SpeechInput,
        input=st.one_of(words(), words(), words(), st.sampled_from(["", "  "])),
        voice=mostly([None, "default", "DEFAULT"], ["alloy", "vivian"]),
        language=mostly([None], ["English", "Auto"]),
        instructions=mostly([None], ["a calm voice", ""]),
        task_type=mostly([None], ["Base", "CustomVoice"]),
        ref_text=mostly([None], ["hello world"]),
        x_vector_only_mode=mostly([None], [True, False]),
        non_streaming_mode=mostly([None], [True]),
        max_new_tokens=mostly([None, None, 1, 9, 300, 2048, 10000], [0]),
        seed=st.one_of(st.none(), st.integers(0, 2**31)),
    )


def test_generated_requests(side: Side) -> None:
    outcomes: dict[str, int] = {}

    @settings(
        max_examples=150,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(requests())
    def run(request: SpeechInput) -> None:
        outcome = check(side.builder, side.server, request)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    run()
    assert outcomes.get("both accept", 0) >= 30, outcomes


def table(clip: str) -> list[tuple[SpeechInput, str]]:
    accept, both = "both accept", "both refuse"
    unused = "omnigen alone refuses (options_the_adapter_never_reads)"
    return [
        (SpeechInput(input="hello world the quick brown fox"), accept),
        (SpeechInput(input="w1 w2 w3 unknown words"), accept),
        (SpeechInput(input="hello world", voice="default"), accept),
        (SpeechInput(input="hello world", voice="Default", seed=7, max_new_tokens=24), accept),
        (SpeechInput(input="  hello   world  "), accept),
        (SpeechInput(input="hello <|audio|> world"), accept),  # a special in the text is its id
        (SpeechInput(input="hello", voice="alloy"), both),
        (SpeechInput(input=""), both),
        (SpeechInput(input=" "), both),
        (SpeechInput(input="hello", max_new_tokens=0), both),
        # Voice cloning: vllm-omni's encoder needs torchaudio (not installed here), omnigen refuses.
        (SpeechInput(input="hello", ref_audio=clip), both),
        (SpeechInput(input="hello", ref_audio=clip, ref_text="hello world"), both),
        (
            SpeechInput(input="hello", ref_text="hello world"),
            "omnigen alone refuses (ref_text_without_ref_audio)",
        ),
        (SpeechInput(input="hello", language="English"), unused),
        (SpeechInput(input="hello", instructions="a calm voice"), unused),
        (SpeechInput(input="hello", task_type="Base"), unused),
        (SpeechInput(input="hello", x_vector_only_mode=True), unused),
        (SpeechInput(input="hello", speaker_embedding=(0.0, 1.0)), unused),
        (SpeechInput(input="hello", non_streaming_mode=False), unused),
    ]


def test_request_table(side: Side) -> None:
    for request, expected in table(side.clip):
        assert check(side.builder, side.server, request) == expected, request


def test_vllm_omnis_clone_path_needs_torchaudio_here(
    side: Side, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What omnigen's refusal of ref_audio stands for: vllm-omni's own Higgs clone path does not
    run on this machine. Given a (tiny) codec tokenizer on disk where it looks first
    (``HIGGS_AUDIO_TOKENIZER_PATH``), it stops at transformers' ``HiggsAudioV2TokenizerModel``,
    which requires torchaudio (its module imports it; ``_extract_semantic_features`` resamples with
    it), not installed here."""
    from transformers import HiggsAudioV2TokenizerConfig

    folder = tmp_path / "audio_tokenizer"
    HiggsAudioV2TokenizerConfig().save_pretrained(str(folder))
    monkeypatch.setenv("HIGGS_AUDIO_TOKENIZER_PATH", str(folder))
    theirs = oracle_build(side.server, SpeechInput(input="hello", ref_audio=side.clip))
    assert isinstance(theirs, str), theirs
    # vllm-omni re-raises it as "needs transformers>=5.3.0"; the cause is transformers' ImportError.
    assert "<- ImportError: \nHiggsAudioV2TokenizerModel requires the torchaudio library" in theirs, theirs


def test_stop_ids_are_the_tokens_vllm_omni_stops_at(side: Side) -> None:
    """vllm-omni's pipeline hard-codes the released ids of <|endoftext|> (the config's eos) and
    <|audio_end|>; omnigen reads this checkpoint's ids of the same two tokens."""
    tokens = side.builder.tokenizer.convert_ids_to_tokens(side.builder.stop_token_ids)
    assert tokens == ["<|endoftext|>", "<|audio_end|>"]


def test_every_difference_is_exercised(side: Side) -> None:
    seen = set()
    for _, outcome in table(side.clip):
        if "(" in outcome:
            seen.update(outcome[outcome.index("(") + 1 : -1].split(", "))
    assert seen == set(DIFFERENCES)
