"""Differential pipeline test: Higgs Audio v3 through ``omnigen run``/``omnigen serve`` against
vllm-omni's own pieces.

One tiny real-shaped Higgs Audio v3 checkpoint (``testing/checkpoints``: one folder for both stages,
safetensors weights with the codec bundled; its text embedding scaled so that the text reaches the
codes, ``SHARPENED``) serves a handful of speech requests (several texts, seeds and budgets, one
text longer than a KV block) two ways, and the audio must be equal sample for sample:

* omnigen: ``omnigen run`` (``serve.mode=inproc``, a subprocess) for one request, and
  ``omnigen serve`` (``mp``: an engine-core process per stage) on a free loopback port for every
  request, one at a time over HTTP (``POST /v1/audio/speech``), then stopped with SIGTERM (it must
  exit 128 + 15 and leave no engine process behind). Bad options over HTTP are refused with 400
  naming the field, before any stage runs.
* oracle: one subprocess (this module run as ``python -m tests.e2e.test_real_higgs_audio_v3
  oracle``) that imports vllm_omni (its patch.py runs) and chains vllm-omni 0.30's own pieces on
  vLLM's CPU engine, in the full-payload form omnigen runs (``async_chunk: false``):

  1. the request: vllm-omni's speech serving layer (``OmniOpenAIServingSpeech`` with its Higgs
     Audio v3 adapter, ``_prepare_speech_generation``: validate, build, sampling overrides, seed;
     ``tests/oracle/test_higgs_audio_v3_builder.py``'s ``higgs_oracle_server``) with the talker's
     default sampling of vllm-omni's deploy/higgs_multimodal_qwen3.yaml (temperature 1.0, top_p
     0.95, top_k 50, repetition_penalty 1.0) and pipeline.py's constraints (detokenize false; the
     stop ids are this checkpoint's eos and ``<|audio_end|>`` where vllm-omni hard-codes the
     released 151643 and 151671);
  2. the talker: ``vllm.LLM`` (engine core in process) whose worker builds vllm-omni's
     ``GPUARModelRunner`` composed onto vLLM's ``CPUModelRunner`` (as ``testing/real/harness.py``
     composes it), with vllm-omni's model_config fields for the stage (model_stage
     ``higgs_audio_v3``, async_chunk false). Each step's multimodal output per request (what the
     runner puts on the wire for the engine core) is accumulated the way vllm-omni's output
     processor does it for the stage's RequestOutput: ``OmniRequestState.add_multimodal_tensor``
     and ``_consolidate_multimodal_tensors`` (modality ``latent``, the stage's
     engine_output_type), then ``unflatten_payload``;
  3. the code2wav prompt: vllm-omni's ``talker2code2wav`` (the code2wav stage's
     ``sync_process_input_func``) on that finished talker output;
  4. code2wav: ``vllm.LLM`` with vllm-omni's ``GPUGenerationModelRunner`` on ``CPUModelRunner``;
     its ``model_outputs`` are the audio, as the runner's output gives them.

Both sides run the same engine arguments (``ChainSettings``: conf/serve/higgs_audio_v3.yaml's
values, which are vllm-omni's deploy values, plus this test's small lengths), and each request
alone (no batching on either side). The codec decoder of vllm-omni 0.30 asks
``torch.cuda.is_current_stream_capturing()`` before every decode, which raises on this CPU build of
torch; both sides answer it False (omnigen's provider, ``omnigen/providers/vllm_omni.py``; here
``_no_stream_capture``).

What is compared: omnigen's 16-bit WAV samples against the oracle's float audio written with the
same rule (``round(clip(x) * 32767)``), exactly; and against the WAV vllm-omni's own serving layer
writes (``AudioMixin.create_audio``), to within its other rounding rule. Negative controls: the
oracle also runs the first request with another seed and another text, and omnigen's audio must
differ from each.

    .venv/bin/python -m pytest -q -m e2e tests/e2e/test_real_higgs_audio_v3.py
"""

from __future__ import annotations

import argparse
import base64
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

# The oracle's runners, and the audio and process helpers of the Qwen3-TTS pipeline test (no test
# of its is collected here). Both import-light: vLLM and vllm-omni only in the oracle process.
from omnigen_testing.oracle import runners
from omnigen_testing.qwen3_tts_chain import (
    REPO_ROOT,
    ServerEnd,
    _b64,
    _unb64,
    finished_run,
    first_difference,
    free_port,
    kill_all,
    omnigen_environment,
    oracle_results,
    pcm16,
    post_speech,
    post_speech_streamed,
    require_vllm_omni,
    sharpen,
    stop_server,
    wait_healthy,
    wav_samples,
)

pytestmark = pytest.mark.e2e
require_vllm_omni()

MODULE = "tests.e2e.test_real_higgs_audio_v3"

TALKER_ARCH = "HiggsAudioV3TalkerForConditionalGeneration"
CODE2WAV_ARCH = "HiggsAudioV3Code2WavForConditionalGeneration"
_MODELS = "vllm_omni.model_executor.models.higgs_audio_v3"
TALKER_CLASS = f"{_MODELS}.higgs_audio_v3_talker.{TALKER_ARCH}"
CODE2WAV_CLASS = f"{_MODELS}.higgs_audio_v3_code2wav.HiggsAudioV3Code2Wav"
NUM_CODEBOOKS = 8
SAMPLES_PER_FRAME = 960

# vllm-omni's deploy/higgs_multimodal_qwen3.yaml, stage 0's default_sampling_params (its seed 42
# applies to requests without one; every request here names its seed).
TALKER_SAMPLING = {"temperature": 1.0, "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.0}

ORACLE_TIMEOUT_S = 900
SERVE_TIMEOUT_S = 420


# --------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class ChainSettings:
    """The engine arguments and default token budget both sides run with.

    omnigen reads the rest from conf/serve/higgs_audio_v3.yaml (skip_tokenizer_init,
    trust_remote_code, enforce_eager, no prefix caching, the talker's 4096-token steps, code2wav's
    lifted max_position_embeddings, the talker's sampling); the oracle states the same values in
    ``oracle_engine``. (vllm-omni deploys its talker with prefix caching on, which moves its codes
    by a frame: see the serve config.)"""

    max_num_seqs: int = 4
    talker_max_model_len: int = 512
    code2wav_max_model_len: int = 2048
    default_max_tokens: int = 24
    """The talker's configured max_tokens (``serve.sampling.talker.max_tokens``): the budget of a
    request that names none (``omnigen run``)."""

    def omnigen_overrides(self, checkpoint: Path) -> list[str]:
        return [
            "model=higgs_audio_v3",
            f"serve.checkpoint={checkpoint}",
            f"serve.engine.max_num_seqs={self.max_num_seqs}",
            f"serve.stage_engine.talker.max_model_len={self.talker_max_model_len}",
            f"serve.stage_engine.code2wav.max_model_len={self.code2wav_max_model_len}",
            f"serve.stage_engine.code2wav.max_num_batched_tokens={self.code2wav_max_model_len}",
            f"serve.sampling.talker.max_tokens={self.default_max_tokens}",
        ]

    def oracle_engine(self, stage: str) -> dict[str, Any]:
        common = {
            "skip_tokenizer_init": True,
            "trust_remote_code": True,
            "enforce_eager": True,
            "max_num_seqs": self.max_num_seqs,
        }
        if stage == "talker":
            return {
                **common,
                "hf_overrides": {"architectures": [TALKER_ARCH]},
                "enable_prefix_caching": False,
                "max_model_len": self.talker_max_model_len,
                "max_num_batched_tokens": 4096,
            }
        return {
            **common,
            "hf_overrides": {
                "text_config": {"max_position_embeddings": 65536},
                "architectures": [CODE2WAV_ARCH],
            },
            "enable_prefix_caching": False,
            "max_model_len": self.code2wav_max_model_len,
            "max_num_batched_tokens": self.code2wav_max_model_len,
        }


SETTINGS = ChainSettings()

# A text over one KV block (128 tokens on CPU).
LONG_TEXT = " ".join(["hello world the quick brown fox jumps over the lazy dog and a good day to you"] * 10)
REQUESTS: list[dict[str, Any]] = [
    {
        "id": "fox",
        "input": "hello world the quick brown fox jumps over the lazy dog",
        "seed": 3,
        "max_tokens": 24,
    },
    {"id": "day", "input": "good day to you and thank you", "seed": 5, "max_tokens": 30},
    {"id": "voice", "input": "this is my voice", "voice": "default", "seed": 7, "max_tokens": 16},
    {"id": "long", "input": LONG_TEXT, "seed": 11, "max_tokens": 12},
]
RUN_REQUEST = {**REQUESTS[0], "id": "run:fox", "max_tokens": None}
# The negative controls (oracle only): the first request with one field changed.
CONTROLS = [
    {**REQUESTS[0], "id": "control:seed", "seed": 4},
    {**REQUESTS[0], "id": "control:text", "input": "hello world the quick brown dog jumps over the lazy fox"},
]
# Bad options over HTTP: (body, the field the 400 names, a phrase of its message).
REFUSALS: list[tuple[dict[str, Any], str, str]] = [
    ({"input": "hello", "voice": "alloy"}, "voice", "allowed: default"),
    ({"input": "hello", "language": "English"}, "language", "takes no such option"),
    ({"input": "hello", "ref_audio": "data:audio/wav;base64,AAAA"}, "ref_audio", "torchaudio"),
    ({"input": "hello", "ref_text": "hello"}, "ref_text", "no ref_audio"),
    ({"input": "  "}, "input", "empty"),
    # The glue's prompt bound: fewer than 9 talker tokens give code2wav nothing ...
    ({"input": "hello", "max_tokens": 8}, "max_tokens", "at least 9"),
    # ... and 400 would give it more than its context (2047 codes: 8 x (264 - 9) fits).
    ({"input": "hello", "max_tokens": 400}, "max_tokens", "at most 264"),
]

# The tiny checkpoint's text embedding is scaled by SHARPEN after it is written. With the writer's
# N(0, 0.05) weights it is small next to the codebook embeddings the talker adds once it speaks, so
# requests that differ only in their text could get the same codes: a port that dropped the text
# would still match. Scaled, each request's codes are its own (test_the_oracle_made_real_audio,
# CONTROLS); shapes and names stay the released ones. (Scaling the codebook embedding too, which
# the codebook head shares, makes every take the same few codes.)
SHARPENED = ("tied.embedding.text_embedding.weight",)
SHARPEN = 20.0


def write_checkpoint(folder: Path) -> Path:
    """The tiny checkpoint (testing/checkpoints), its SHARPENED tensors scaled."""
    from omnigen_testing.checkpoints import write_higgs_audio_v3

    return sharpen(write_higgs_audio_v3(folder, seed=0), SHARPENED, SHARPEN)


def code2wav_prompt_bound(tokens: int) -> int:
    """omnigen's declared bound (omnigen/glue/higgs_audio_v3.py), stated here for the oracle."""
    return NUM_CODEBOOKS * max(1, tokens - 1 - NUM_CODEBOOKS)


# =========================================================================== oracle side
# Everything below runs only in the oracle process (vLLM and vllm-omni are imported there).

# Filled by the runners: per talker request each step's multimodal output; per code2wav request
# its output payload.
TALKER_STEPS: dict[str, list[Any]] = {}
CODE2WAV_OUTPUTS: dict[str, dict[str, Any]] = {}
_REQUEST_NUMBERS = itertools.count(1)


def _no_stream_capture() -> None:
    """vllm-omni's code2wav asks ``torch.cuda.is_current_stream_capturing()`` before each decode;
    this CPU build of torch raises there instead of answering. No stream captures on it: False."""
    import torch

    if not torch.backends.cuda.is_built():
        torch.cuda.is_current_stream_capturing = lambda: False


def _omni_fields() -> dict[str, dict[str, Any]]:
    """vllm-omni's OmniModelConfig fields of each stage (its higgs_audio_v3/pipeline.py, sync)."""
    return runners.tts_stage_fields("higgs_audio_v3", TALKER_ARCH, CODE2WAV_ARCH)


def _oracle_classes() -> dict[str, dict[str, Any]]:
    """The worker (qualified name) and scheduler class of each stage. The talker has no
    full-payload producer here (the edge is sync): its runner keeps each step's output."""
    talker = runners.step_outputs_ar_runner("OracleHiggsTalkerRunner", TALKER_STEPS)
    code2wav = runners.generation_runner("OracleHiggsCode2WavRunner", CODE2WAV_OUTPUTS)
    fields = _omni_fields()
    return {
        stage: runners.engine_classes(
            runner,
            fields[stage],
            worker_name=runner.__name__.replace("Runner", "Worker"),
            scheduler_name=f"higgs_{stage}",
            set_capture_size=False,  # no Higgs model has a talker_mtp, the one reader of it
        )
        for stage, runner in (("talker", talker), ("code2wav", code2wav))
    }


def accumulated_output(steps: list[Any]) -> Any:
    """The talker's finished multimodal output as vllm-omni's output processor makes it from the
    steps' outputs (``OmniRequestState``: add each, consolidate, unflatten)."""
    from vllm_omni.data_entry_keys import unflatten_payload
    from vllm_omni.outputs.mm_outputs import MultimodalPayload
    from vllm_omni.outputs.output_processor import OmniRequestState

    state = SimpleNamespace(mm_type=None, mm_accumulated=MultimodalPayload())
    for payload in steps:
        OmniRequestState.add_multimodal_tensor(state, payload, "latent")
    OmniRequestState._consolidate_multimodal_tensors(state)
    merged = {**state.mm_accumulated.tensors, **state.mm_accumulated.metadata}
    return MultimodalPayload.from_dict(unflatten_payload(merged)) or MultimodalPayload()


class OracleChain:
    """vllm-omni's serving layer, talker runner, glue and code2wav runner, chained by hand."""

    def __init__(self, checkpoint: Path, settings: ChainSettings, scratch: Path) -> None:
        runners.load_vllm_omni(checkpoint, {TALKER_ARCH: TALKER_CLASS, CODE2WAV_ARCH: CODE2WAV_CLASS})
        _no_stream_capture()
        from vllm import LLM, SamplingParams

        from omnigen.requests.higgs_audio_v3 import HiggsAudioV3RequestBuilder
        from tests.oracle.test_higgs_audio_v3_builder import higgs_oracle_server

        classes = _oracle_classes()
        self.engines = {
            stage: LLM(model=str(checkpoint), **settings.oracle_engine(stage), **classes[stage])
            for stage in ("talker", "code2wav")
        }
        media = scratch / "media"
        media.mkdir(parents=True, exist_ok=True)
        os.environ["SPEAKER_SAMPLES_DIR"] = str(scratch / "speakers")  # its own, empty upload store
        self.server = higgs_oracle_server(checkpoint, media, default_max_tokens=settings.default_max_tokens)
        # The stop ids of this checkpoint (vllm-omni's pipeline.py hard-codes the released ones).
        stops = HiggsAudioV3RequestBuilder(checkpoint).stop_token_ids
        self.server.engine_client.default_sampling_params_list = [
            SamplingParams(
                **TALKER_SAMPLING,
                max_tokens=settings.default_max_tokens,
                seed=42,
                detokenize=False,
                stop_token_ids=stops,
            ),
            SamplingParams(
                temperature=0.0, top_p=1.0, top_k=-1, max_tokens=65536, seed=42, repetition_penalty=1.0
            ),
        ]

    def run(self, specs: list[dict[str, Any]]) -> dict[str, Any]:
        started = time.perf_counter()
        results = [{"id": spec.get("id"), **self._one(spec)} for spec in specs]
        return {"results": results, "wall_s": time.perf_counter() - started}

    def _one(self, spec: dict[str, Any]) -> dict[str, Any]:
        import numpy as np
        from vllm import SamplingParams
        from vllm_omni.model_executor.stage_input_processors.higgs_audio_v3 import talker2code2wav

        from omnigen.requests.base import SpeechInput
        from omnigen_testing.oracle.speech_server import oracle_build

        # 1. vllm-omni's serving layer.
        speech = SpeechInput(
            input=spec["input"],
            voice=spec.get("voice"),
            max_new_tokens=spec.get("max_tokens"),
            seed=spec.get("seed"),
        )
        built = oracle_build(self.server, speech)
        if isinstance(built, str):
            raise ValueError(f"vllm-omni refuses request {spec.get('id')}: {built}")
        prompt, sampling = built
        assert "additional_information" not in prompt, prompt

        # 2. the talker.
        rid = f"oracle-{next(_REQUEST_NUMBERS)}"
        (out,) = runners.generate(
            self.engines["talker"],
            [{"prompt_token_ids": list(prompt["prompt_token_ids"])}],
            [sampling],
            [rid],
        )
        completion = out.outputs[0]
        talker_output = SimpleNamespace(
            request_id=rid,
            finished=out.finished,
            outputs=[SimpleNamespace(multimodal_output=accumulated_output(TALKER_STEPS.pop(rid, [])))],
        )
        codes = talker_output.outputs[0].multimodal_output.get("codes", {}).get("audio")

        # 3. the glue (the code2wav stage's sync_process_input_func).
        (code2wav_prompt,) = talker2code2wav([talker_output])
        ids = list(code2wav_prompt["prompt_token_ids"])
        if not ids:
            raise RuntimeError(f"{spec.get('id')}: vllm-omni's glue made an empty code2wav prompt")

        # 4. code2wav.
        rid2 = f"{rid}-code2wav"
        runners.generate(
            self.engines["code2wav"],
            [{"prompt_token_ids": ids}],
            [SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)],
            [rid2],
        )
        audio, sample_rate = runners.code2wav_audio(CODE2WAV_OUTPUTS, rid2)
        return {
            "token_ids": [int(t) for t in completion.token_ids],
            "finish_reason": completion.finish_reason,
            "max_tokens": int(sampling.max_tokens),
            "seed": sampling.seed,
            "codes_shape": list(codes.shape) if codes is not None else None,
            "code2wav_prompt": ids,
            "audio": _b64(np.asarray(audio, dtype=np.float32)),
            "sample_rate": sample_rate,
            "wav": runners.vllm_omni_wav(audio, sample_rate),
        }

    def close(self) -> None:
        runners.shutdown(self.engines)


def oracle_main(argv: list[str]) -> int:
    """The oracle process: runs the requests of ``--requests`` (JSON) through the chain and prints
    one JSON line on stdout (vLLM's own output goes to stderr)."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE} oracle")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--requests", required=True, help="JSON: the request specs")
    parser.add_argument("--scratch", type=Path, required=True)
    args = parser.parse_args(argv)
    started = time.time()
    answers = runners.oracle_answers(REPO_ROOT)
    chain = OracleChain(args.checkpoint, SETTINGS, args.scratch)
    init_s = time.time() - started
    try:
        reply = chain.run(json.loads(args.requests))
    except Exception as exc:  # answered, so the caller reports it
        reply = runners.error_reply(exc)
    finally:
        chain.close()
    answers.write(json.dumps({**reply, "init_s": init_s}) + "\n")
    return 0


# =========================================================================== pytest side


def start_oracle(checkpoint: Path, specs: list[dict[str, Any]], log: Path, scratch: Path) -> subprocess.Popen:
    args = ["--checkpoint", str(checkpoint), "--requests", json.dumps(specs), "--scratch", str(scratch)]
    return runners.start_oracle_process(MODULE, args, log, REPO_ROOT)


def omnigen_command(command: str, checkpoint: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "omnigen.cli", command, *SETTINGS.omnigen_overrides(checkpoint), *extra]


def speech_body(spec: dict[str, Any]) -> dict[str, Any]:
    keys = ("input", "voice", "seed", "max_tokens")
    return {key: spec[key] for key in keys if spec.get(key) is not None}


@dataclasses.dataclass
class Runs(ServerEnd):
    voices: dict[str, Any]
    oracle: dict[str, dict[str, Any]]
    """request id -> the oracle's result."""
    served: dict[str, bytes]
    run: bytes
    refusals: list[tuple[int, str]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Everything runs once, side by side: the oracle process, ``omnigen serve`` and ``omnigen
    run``; once the server is up every request goes to it, one at a time."""
    import httpx

    root = tmp_path_factory.mktemp("real_higgs_audio_v3")
    checkpoint = write_checkpoint(root / "checkpoint")
    oracle = start_oracle(
        checkpoint, [*REQUESTS, RUN_REQUEST, *CONTROLS], root / "oracle.log", root / "oracle"
    )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with (root / "serve.log").open("w") as out:
        serve = subprocess.Popen(
            omnigen_command("serve", checkpoint, f"serve.port={port}"),
            cwd=REPO_ROOT,
            env=omnigen_environment(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    wav = root / "run.wav"
    extra = ["serve.mode=inproc", f"serve.output={wav}", f"serve.seed={RUN_REQUEST['seed']}"]
    extra.append(f"serve.prompt='{RUN_REQUEST['input']}'")
    with (root / "run.log").open("w") as out:
        run = subprocess.Popen(
            omnigen_command("run", checkpoint, *extra),
            cwd=REPO_ROOT,
            env=omnigen_environment(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_healthy(serve, base, root / "serve.log", SERVE_TIMEOUT_S)
        served: dict[str, bytes] = {}
        refusals: list[tuple[int, str]] = []
        with httpx.Client(base_url=base, timeout=120) as client:
            voices = client.get("/v1/audio/voices").json()
            for body, _, _ in REFUSALS:
                response = client.post("/v1/audio/speech", json=body)
                refusals.append((response.status_code, response.text))
            for spec in REQUESTS:
                served[spec["id"]] = post_speech(client, speech_body(spec), spec["id"])
            # The longest request again, streamed: raw PCM16 as code2wav decodes each window.
            served["stream:" + REQUESTS[1]["id"]] = post_speech_streamed(client, speech_body(REQUESTS[1]))
        end = stop_server(serve, root / "serve.log")
        run_wav = finished_run(run, wav, root / "run.log")
        out, _ = oracle.communicate(timeout=ORACLE_TIMEOUT_S)
    finally:
        kill_all(serve, oracle, run)
    return Runs(
        oracle=oracle_results(out, root / "oracle.log"),
        served=served,
        run=run_wav,
        refusals=refusals,
        voices=voices,
        **vars(end),  # ServerEnd: serve_exit, orphans, serve_log
    )


def oracle_pcm(runs: Runs, request_id: str) -> Any:
    return pcm16(_unb64(runs.oracle[request_id]["audio"]))


def test_the_oracle_made_real_audio(runs: Runs):
    """The oracle's audio has the length its codes give (960 samples a frame, the code2wav prompt
    8 codes a frame), is not silence, and each request's codes are its own; the talker ran to its
    budget or stopped at eos, and the code2wav prompt is within omnigen's declared bound (equal to
    it at the budget: a step's codes publish at the next step)."""
    import numpy as np

    prompts = []
    for spec in [*REQUESTS, RUN_REQUEST, *CONTROLS]:
        result = runs.oracle[spec["id"]]
        audio = _unb64(result["audio"])
        frames = len(result["code2wav_prompt"]) // NUM_CODEBOOKS
        assert result["sample_rate"] == 24000
        assert frames >= 1 and audio.size == SAMPLES_PER_FRAME * frames, (spec["id"], frames, audio.size)
        assert len(np.unique(pcm16(audio))) > 100, spec["id"]
        budget = spec["max_tokens"] or SETTINGS.default_max_tokens
        assert result["max_tokens"] == budget and result["seed"] == spec["seed"], spec["id"]
        tokens = len(result["token_ids"])
        assert len(result["code2wav_prompt"]) <= code2wav_prompt_bound(tokens), spec["id"]
        if result["finish_reason"] == "length":
            assert tokens == budget and len(result["code2wav_prompt"]) == code2wav_prompt_bound(tokens), spec[
                "id"
            ]
        prompts.append(tuple(result["code2wav_prompt"]))
    distinct = [tuple(runs.oracle[spec["id"]]["code2wav_prompt"]) for spec in [*REQUESTS, *CONTROLS]]
    assert len(set(distinct)) == len(distinct)


def test_served_audio_equals_vllm_omni(runs: Runs):
    """Each request over HTTP: omnigen's WAV samples equal the oracle's audio, sample for sample."""
    problems = []
    for spec in REQUESTS:
        ours, rate = wav_samples(runs.served[spec["id"]])
        assert rate == runs.oracle[spec["id"]]["sample_rate"]
        problem = first_difference(ours, oracle_pcm(runs, spec["id"]))
        if problem:
            problems.append(f"{spec['id']}: {problem}")
    assert not problems, "omnigen serve's audio differs from vllm-omni's:\n" + "\n".join(problems)


def test_streamed_audio_equals_the_whole_answer_but_its_first_frame(runs: Runs):
    """The shipped streaming edge (vllm-omni's chunking: 1, then 25 frames, 25 of left context, 4
    held back on the right). Every sample of the whole answer comes, in order; from the second
    frame on they are the whole answer's exactly. The first window is one frame decoded with 4
    frames after it, less than the codec's reach to the right, so its 960 samples differ a little
    (measured: at most 160 of 32768)."""
    import numpy as np

    spec = REQUESTS[1]
    whole = np.asarray(wav_samples(runs.served[spec["id"]])[0]).astype(np.int32)
    streamed = np.frombuffer(runs.served["stream:" + spec["id"]], dtype="<i2").astype(np.int32)
    frame = 960  # the tiny checkpoint's samples a frame (testing/checkpoints/higgs_audio_v3.py)
    assert streamed.shape == whole.shape and whole.size > 2 * frame  # nothing dropped or doubled
    assert first_difference(streamed[frame:], whole[frame:]) is None
    assert int(np.abs(streamed[:frame] - whole[:frame]).max()) <= 256  # 7.8e-3 of full scale


def test_run_audio_equals_vllm_omni(runs: Runs):
    """``omnigen run`` (inproc, the configured token budget) equals the oracle, and the same request
    served over HTTP with that budget named."""
    ours, rate = wav_samples(runs.run)
    assert rate == 24000
    assert first_difference(ours, oracle_pcm(runs, RUN_REQUEST["id"])) is None
    assert first_difference(ours, wav_samples(runs.served[REQUESTS[0]["id"]])[0]) is None


def test_negative_controls_differ(runs: Runs):
    """Another seed or text on the oracle side gives other audio: the comparison above can fail,
    and would fail for a port that lost the seed or the text."""
    ours, _ = wav_samples(runs.served[REQUESTS[0]["id"]])
    for control in CONTROLS:
        assert first_difference(ours, oracle_pcm(runs, control["id"])) is not None, control["id"]


def test_wav_matches_the_one_vllm_omni_writes(runs: Runs):
    """omnigen's WAV and the one vllm-omni's serving layer writes for the same audio (its
    ``create_audio``: soundfile, PCM_16) have the same rate and length and differ by at most one
    step of 16 bits: the two float-to-16-bit rules differ (omnigen rounds x * 32767, libsndfile
    scales by 32768), and this decoder's float32 output is not on libsndfile's grid."""
    import numpy as np

    for spec in REQUESTS:
        ours, rate = wav_samples(runs.served[spec["id"]])
        theirs, their_rate = wav_samples(base64.b64decode(runs.oracle[spec["id"]]["wav"]))
        assert (rate, ours.size) == (their_rate, theirs.size), spec["id"]
        assert np.abs(ours.astype(np.int32) - theirs.astype(np.int32)).max() <= 1, spec["id"]


def test_bad_options_are_refused_naming_the_field(runs: Runs):
    """400 before any stage runs, the message naming the field (and what is allowed)."""
    for (body, field, phrase), (status, text) in zip(REFUSALS, runs.refusals, strict=True):
        detail = json.loads(text).get("detail", "")
        assert status == 400, (body, status, text)
        assert detail.startswith(f"{field}:") and phrase in detail, (body, detail)


def test_voices_and_shutdown(runs: Runs):
    """The server lists no voices (Higgs has none built in); SIGTERM stops it (128 + 15) with no
    engine process left behind."""
    assert runs.voices["voices"] == []
    assert runs.serve_exit == 128 + signal.SIGTERM, runs.serve_log[-3000:]
    assert not runs.orphans, runs.orphans
    assert "higgs_audio_v3: shutting down 2 stage engine(s)" in runs.serve_log
    assert "declares no prompt bound" not in runs.serve_log


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "oracle":
        # Run in the module's importable copy: one copy of its globals (the dicts its runners fill).
        from tests.e2e import test_real_higgs_audio_v3 as _self

        sys.exit(_self.oracle_main(sys.argv[2:]))
    sys.exit(f"usage: python -m {MODULE} oracle --checkpoint DIR --requests JSON --scratch DIR")
