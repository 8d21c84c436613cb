"""omnigen's Qwen3-TTS pipeline against vllm-omni's own pieces chained by hand: the settings,
the requests, the oracle process and the helpers that start ``omnigen run``/``serve``.

Shared by the differential test (``tests/e2e/test_real_qwen3_tts.py``, which says what is compared
and why) and the benchmarks (``benchmarks/real_tts.py``, ``benchmarks/streaming.py``).

* the checkpoint: one tiny real-shaped Qwen3-TTS CustomVoice folder (``omnigen_testing.checkpoints``:
  safetensors weights, speakers vivian, ryan and dylan, dylan a Beijing-dialect speaker; three of its
  tensors scaled so that the text and voice reach the codes, ``SHARPENED``);
* the oracle: one process (``python -m omnigen_testing.qwen3_tts_chain oracle``) that imports
  vllm_omni (its patch.py runs) and chains vllm-omni 0.30's own pieces on vLLM's CPU engine, in the
  full-payload form omnigen runs (``async_chunk: false``):

  1. the request: vllm-omni's speech serving layer (``OmniOpenAIServingSpeech`` with its Qwen3-TTS
     adapter, ``_prepare_speech_generation``: validate, build, sampling overrides, seed) around a
     stand-in engine client (``omnigen_testing.oracle.speech_server``), with the talker's default
     sampling of vllm-omni's deploy/qwen3_tts.yaml and pipeline.py (temperature 0.9, top_k 50,
     min_tokens 2, repetition_penalty 1.05, detokenize false; the stop id is this checkpoint's
     codec EOS where vllm-omni hard-codes the released 2150);
  2. the talker: ``vllm.LLM`` (engine core in process) whose worker builds vllm-omni's
     ``GPUARModelRunner`` composed onto vLLM's ``CPUModelRunner`` (as ``omnigen_testing/real/harness.py``
     composes it; the payload arrives as ``additional_information`` through its
     ``OracleScheduler``), with vllm-omni's model_config fields for the stage (model_stage
     ``qwen3_tts``, async_chunk false, ``custom_process_next_stage_input_func`` =
     ``talker2code2wav_full_payload``, its deploy's subtalker sampling). The runner's own
     full-payload producer path runs: it accumulates each step's payload
     (``accumulate_full_payload_output``) and, once the request finished, flushes it through
     ``_build_custom_process_payload``, i.e. vllm-omni's ``talker2code2wav_full_payload`` on the
     runner's request state. Only the connector's transport is replaced: the built payload is kept
     (there is no second engine process to ship it to);
  3. the code2wav prompt: vllm-omni's ``talker2code2wav_token_only`` on the finished talker output
     (its accumulated codes, its token ids) and the request's prompt;
  4. code2wav: ``vllm.LLM`` with vllm-omni's ``GPUGenerationModelRunner`` on ``CPUModelRunner``;
     its ``model_outputs`` are the audio, as the runner's output gives them.

Both sides run the same engine arguments (``ChainSettings``: conf/serve/qwen3_tts.yaml's values,
which are vllm-omni's deploy values where it has them, plus small lengths).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import itertools
import json
import os
import socket
import subprocess
import sys
import time
import wave
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Import-light (it imports vLLM and vllm-omni inside its functions, run in the oracle process only).
from omnigen_testing.oracle import runners

REPO_ROOT = Path(__file__).resolve().parents[1]
MODULE = "omnigen_testing.qwen3_tts_chain"

TALKER_ARCH = "Qwen3TTSTalkerForConditionalGeneration"
CODE2WAV_ARCH = "Qwen3TTSCode2Wav"
_MODELS = "vllm_omni.model_executor.models.qwen3_tts"
TALKER_CLASS = f"{_MODELS}.qwen3_tts_talker.{TALKER_ARCH}"
CODE2WAV_CLASS = f"{_MODELS}.qwen3_tts_code2wav.{CODE2WAV_ARCH}"
GLUE = "vllm_omni.model_executor.stage_input_processors.qwen3_tts"

# vllm-omni's deploy/qwen3_tts.yaml (stage 0's default_sampling_params and subtalker sampling)
# and model_executor/models/qwen3_tts/pipeline.py (sampling_constraints).
TALKER_SAMPLING = {"temperature": 0.9, "top_k": 50, "min_tokens": 2, "repetition_penalty": 1.05}
SUBTALKER_SAMPLING = {"do_sample": True, "temperature": 0.9, "top_k": 50, "top_p": 1.0}

ORACLE_TIMEOUT_S = 600
SERVE_TIMEOUT_S = 300
RUN_TIMEOUT_S = 600


# --------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class ChainSettings:
    """The engine arguments and default token budget both sides run with.

    omnigen reads the rest from conf/serve/qwen3_tts.yaml (skip_tokenizer_init, no prefix
    caching, trust_remote_code, the talker's max_num_batched_tokens 512, code2wav in bfloat16,
    the talker's sampling); the oracle states the same values in ``oracle_engine``."""

    max_num_seqs: int = 4
    talker_max_model_len: int = 512
    code2wav_max_model_len: int = 2048
    default_max_tokens: int = 16
    """The talker's configured max_tokens (``serve.sampling.qwen3_tts.max_tokens``): the budget
    of a request that names none (``omnigen run``)."""
    enforce_eager: bool = False
    """vLLM's default (False) compiles the model (torch.compile, inductor) on both sides."""

    def omnigen_overrides(self, checkpoint: Path) -> list[str]:
        return [
            "model=qwen3_tts",
            f"serve.checkpoint={checkpoint}",
            f"serve.engine.max_num_seqs={self.max_num_seqs}",
            f"serve.stage_engine.qwen3_tts.max_model_len={self.talker_max_model_len}",
            "serve.stage_engine.qwen3_tts.dtype=bfloat16",
            f"serve.stage_engine.code2wav.max_model_len={self.code2wav_max_model_len}",
            f"serve.stage_engine.code2wav.max_num_batched_tokens={self.code2wav_max_model_len}",
            f"serve.sampling.qwen3_tts.max_tokens={self.default_max_tokens}",
            *(["serve.engine.enforce_eager=true"] if self.enforce_eager else []),
        ]

    def oracle_engine(self, stage: str) -> dict[str, Any]:
        common = {
            "skip_tokenizer_init": True,
            "enable_prefix_caching": False,
            "trust_remote_code": True,
            "max_num_seqs": self.max_num_seqs,
            "dtype": "bfloat16",
            **({"enforce_eager": True} if self.enforce_eager else {}),
        }
        if stage == "qwen3_tts":
            return {**common, "max_model_len": self.talker_max_model_len, "max_num_batched_tokens": 512}
        return {
            **common,
            "max_model_len": self.code2wav_max_model_len,
            "max_num_batched_tokens": self.code2wav_max_model_len,
        }


# The requests (``input`` uses the tiny tokenizer's words). ``max_tokens`` None: the configured
# budget (ChainSettings.default_max_tokens), as ``omnigen run`` sends it.
REQUESTS: list[dict[str, Any]] = [
    {
        "id": "ryan-english",
        "input": "hello world the quick brown fox jumps over the lazy dog",
        "voice": "ryan",
        "language": "English",
        "seed": 3,
        "max_tokens": 16,
    },
    {
        # The dialect speaker: with Auto the talker takes its dialect's language id.
        "id": "dylan-auto",
        "input": "good day to you and thank you",
        "voice": "dylan",
        "language": "Auto",
        "seed": 5,
        "max_tokens": 20,
    },
    {
        "id": "vivian-instructions",
        "input": "this is my voice and it is a good one",
        "voice": "vivian",
        "language": "English",
        "instructions": "a calm low voice",
        "seed": 7,
        "max_tokens": 24,
    },
    {
        "id": "dylan-chinese-instructions",
        "input": "please say hello to the world",
        "voice": "dylan",
        "language": "Chinese",
        "instructions": "speak slow and deep",
        "seed": 3,
        "max_tokens": 12,
    },
]
RUN_REQUEST = {**REQUESTS[0], "id": "run:ryan-english", "max_tokens": None}
# The negative controls (oracle only): the first request with one field changed.
CONTROLS = [
    {**REQUESTS[0], "id": "control:seed", "seed": 4},
    {**REQUESTS[0], "id": "control:voice", "voice": "vivian"},
    {**REQUESTS[0], "id": "control:text", "input": "hello world the quick brown dog jumps over the lazy fox"},
]

# Tensors of the tiny checkpoint scaled by SHARPEN after it is written. With the writer's N(0, 0.05)
# weights the talker's logits are flat next to the sampling noise and its text embeddings are
# about 1e-3 of its codec embeddings, so requests that differ only in their text (or voice) get
# the same codes: a port that dropped the text would still match. Scaled, each request's codes
# are its own (test_the_oracle_made_real_audio, CONTROLS); shapes and names stay the released ones.
SHARPENED = (
    "talker.model.text_embedding.weight",
    "talker.codec_head.weight",
    "talker.code_predictor.lm_head.",
)
SHARPEN = 20.0


def write_checkpoint(folder: Path) -> Path:
    """The tiny CustomVoice checkpoint (testing/checkpoints), its SHARPENED tensors scaled."""
    from omnigen_testing.checkpoints import write_qwen3_tts

    return sharpen(write_qwen3_tts(folder, variant="custom_voice", seed=0), SHARPENED, SHARPEN)


def sharpen(folder: Path, prefixes: tuple[str, ...], factor: float) -> Path:
    """Scale the tensors of a tiny checkpoint's ``model.safetensors`` whose names start with one
    of ``prefixes`` by ``factor`` (in float, stored back in their dtype): names and shapes stay
    the released ones. A prefix naming no tensor is an error (the checkpoint writer renamed it)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    unmatched = [prefix for prefix in prefixes if not any(name.startswith(prefix) for name in tensors)]
    if unmatched:
        raise ValueError(f"{path}: no tensor named {unmatched} to sharpen")
    for name, tensor in tensors.items():
        if name.startswith(prefixes):
            tensors[name] = (tensor.float() * factor).to(tensor.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


# --------------------------------------------------------------------------- audio helpers


def pcm16(samples: Any) -> Any:
    """Float samples as omnigen's WAV writes them (omnigen/serving/audio.py states the rule):
    clipped to [-1, 1], times 32767, rounded half to even."""
    import numpy as np

    x = np.asarray(samples, dtype=np.float32).reshape(-1)
    return np.rint(np.clip(x, -1.0, 1.0) * np.float32(32767.0)).astype(np.int16)


def wav_samples(data: bytes) -> tuple[Any, int]:
    """The int16 samples and sample rate of a mono 16-bit WAV."""
    import numpy as np

    with wave.open(io.BytesIO(data)) as audio:
        assert (audio.getnchannels(), audio.getsampwidth()) == (1, 2), "not a mono 16-bit WAV"
        return np.frombuffer(audio.readframes(audio.getnframes()), dtype="<i2").copy(), audio.getframerate()


def first_difference(ours: Any, theirs: Any) -> str | None:
    """None when equal; else where and by how much two int16 sample arrays differ."""
    import numpy as np

    ours, theirs = np.asarray(ours), np.asarray(theirs)
    if ours.shape != theirs.shape:
        return f"length {ours.size} vs {theirs.size} samples"
    diff = np.flatnonzero(ours != theirs)
    if diff.size == 0:
        return None
    delta = np.abs(ours.astype(np.int32) - theirs.astype(np.int32))
    i = int(diff[0])
    return (
        f"{diff.size} of {ours.size} samples differ (max |diff| {int(delta.max())}); "
        f"first at {i}: {int(ours[i])} vs {int(theirs[i])}"
    )


def _b64(array: Any) -> str:
    import numpy as np

    return base64.b64encode(np.ascontiguousarray(array, dtype=np.float32).tobytes()).decode()


def _unb64(text: str) -> Any:
    import numpy as np

    return np.frombuffer(base64.b64decode(text), dtype=np.float32).copy()


# =========================================================================== oracle side
# Everything below runs only in the oracle process (vLLM and vllm-omni are imported there).

# Filled by the runners: per talker request what its full-payload producer built; per code2wav
# request its output payload.
TALKER_FLUSHED: dict[str, dict[str, Any]] = {}
CODE2WAV_OUTPUTS: dict[str, dict[str, Any]] = {}
_REQUEST_NUMBERS = itertools.count(1)
_CHAINS: list[Any] = []


def _omni_fields() -> dict[str, dict[str, Any]]:
    """vllm-omni's OmniModelConfig fields of each stage (its qwen3_tts/pipeline.py, full payload)."""
    return runners.tts_stage_fields(
        "qwen3_tts",
        TALKER_ARCH,
        CODE2WAV_ARCH,
        custom_process_next_stage_input_func=f"{GLUE}.talker2code2wav_full_payload",
        subtalker_sampling_params=dict(SUBTALKER_SAMPLING),
    )


def _oracle_classes(tag: str) -> dict[str, dict[str, Any]]:
    """The worker (qualified name) and scheduler class of each stage (``tag``: one chain's)."""
    talker = runners.full_payload_ar_runner(f"OracleTalkerRunner_{tag}", TALKER_FLUSHED)
    code2wav = runners.generation_runner(f"OracleCode2WavRunner_{tag}", CODE2WAV_OUTPUTS)
    fields = _omni_fields()
    return {
        "qwen3_tts": runners.engine_classes(
            talker,
            fields["talker"],
            worker_name=f"OracleTalkerWorker_{tag}",
            scheduler_name="talker",
        ),
        "code2wav": runners.engine_classes(
            code2wav,
            fields["code2wav"],
            worker_name=f"OracleCode2WavWorker_{tag}",
            scheduler_name="code2wav",
        ),
    }


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat (dotted) payload in the nested form of a RequestOutput's multimodal_output."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        kind, dot, rest = key.partition(".")
        if dot:
            out.setdefault(kind, {})[rest] = value
        else:
            out[key] = value
    return out


class OracleChain:
    """vllm-omni's serving layer, talker runner, glue and code2wav runner, chained by hand."""

    def __init__(self, checkpoint: Path, settings: ChainSettings, scratch: Path) -> None:
        runners.load_vllm_omni(checkpoint, {TALKER_ARCH: TALKER_CLASS, CODE2WAV_ARCH: CODE2WAV_CLASS})
        from vllm import LLM, SamplingParams

        from omnigen_testing.oracle.speech_server import oracle_server

        classes = _oracle_classes(f"{len(_CHAINS)}")
        _CHAINS.append(self)
        self.settings = settings
        self.engines = {
            stage: LLM(
                model=str(checkpoint),
                hf_overrides={"architectures": [arch]},
                **settings.oracle_engine(stage),
                **classes[stage],
            )
            for stage, arch in (("qwen3_tts", TALKER_ARCH), ("code2wav", CODE2WAV_ARCH))
        }
        media = scratch / "media"
        media.mkdir(parents=True, exist_ok=True)
        # The serving layer's uploaded-voice store: its own, empty (not ~/.cache/vllm-omni's).
        os.environ["SPEAKER_SAMPLES_DIR"] = str(scratch / "speakers")
        self.server = oracle_server(checkpoint, media)
        eos = self.server.model_config.hf_config.talker_config.codec_eos_token_id
        # The deployment's default sampling list (deploy/qwen3_tts.yaml + pipeline.py constraints).
        self.server.engine_client.default_sampling_params_list = [
            SamplingParams(
                **TALKER_SAMPLING,
                max_tokens=settings.default_max_tokens,
                detokenize=False,
                stop_token_ids=[eos],
            ),
            SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=65536, repetition_penalty=1.0),
        ]

    def build(self, spec: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """vllm-omni's engine prompt and talker SamplingParams for one request."""
        from omnigen.requests.base import SpeechInput
        from omnigen_testing.oracle.speech_server import oracle_build

        speech = SpeechInput(
            input=spec["input"],
            voice=spec.get("voice"),
            language=spec.get("language"),
            instructions=spec.get("instructions"),
            max_new_tokens=spec.get("max_tokens"),
            seed=spec.get("seed"),
        )
        built = oracle_build(self.server, speech)
        if isinstance(built, str):
            raise ValueError(f"vllm-omni refuses request {spec.get('id')}: {built}")
        return built

    def run(self, specs: list[dict[str, Any]], batch: bool) -> dict[str, Any]:
        """Every request through both stages: each alone, or all as one batch per stage."""
        import time as clock

        started = clock.perf_counter()
        built = [self.build(spec) for spec in specs]
        groups = [list(range(len(specs)))] if batch else [[i] for i in range(len(specs))]
        results: list[dict[str, Any]] = [{} for _ in specs]
        first_audio_s = None
        for group in groups:
            for i, result in zip(group, self._chain([built[i] for i in group]), strict=True):
                results[i] = {"id": specs[i].get("id"), **result}
            if first_audio_s is None:
                first_audio_s = clock.perf_counter() - started
        return {"results": results, "wall_s": clock.perf_counter() - started, "first_audio_s": first_audio_s}

    def _chain(self, built: list[tuple[dict[str, Any], Any]]) -> list[dict[str, Any]]:
        import numpy as np
        from vllm import SamplingParams
        from vllm_omni.model_executor.stage_input_processors.qwen3_tts import talker2code2wav_token_only

        from omnigen_testing.real.harness import ORACLE_PAYLOAD_KEY

        # 1. the talker: the prompt's placeholder ids, its additional_information as the payload.
        ids = []
        prompts, params = [], []
        for prompt, sampling in built:
            ids.append(f"oracle-{next(_REQUEST_NUMBERS)}")
            prompts.append(
                {"prompt_token_ids": list(prompt["prompt_token_ids"]), "cache_salt": prompt["cache_salt"]}
            )
            sp = sampling.clone()
            sp.extra_args = {**(sp.extra_args or {}), ORACLE_PAYLOAD_KEY: prompt["additional_information"]}
            params.append(sp)
        talker = self.engines["qwen3_tts"]
        outs = runners.generate(talker, prompts, params, ids)
        flushed_all = runners.flushed_payloads(talker, TALKER_FLUSHED, ids)

        # 2. the glue: the producer's payload, the orchestrator's token-only prompt.
        prompts2, params2, talker_info = [], [], []
        for rid, out, (prompt, _), flushed in zip(ids, outs, built, flushed_all, strict=True):
            completion = out.outputs[0]
            talker_output = SimpleNamespace(
                request_id=rid,
                finished=out.finished,
                outputs=[
                    SimpleNamespace(
                        token_ids=list(completion.token_ids),
                        cumulative_token_ids=list(completion.token_ids),
                        multimodal_output=_nested(flushed["accumulated"]),
                    )
                ],
            )
            (code2wav_prompt,) = talker2code2wav_token_only([talker_output], prompt)
            info = dict(code2wav_prompt.get("additional_information") or {})
            payload = {**info, **flushed["payload"]}
            if isinstance(info.get("meta"), dict):
                payload["meta"] = {**info["meta"], **flushed["payload"].get("meta", {})}
            prompts2.append({"prompt_token_ids": list(code2wav_prompt["prompt_token_ids"])})
            params2.append(
                SamplingParams(
                    temperature=0.0, max_tokens=1, detokenize=False, extra_args={ORACLE_PAYLOAD_KEY: payload}
                )
            )
            codes = flushed["payload"]["codes"]["audio"]
            talker_info.append(
                {
                    "token_ids": [int(t) for t in completion.token_ids],
                    "finish_reason": completion.finish_reason,
                    "runner_output_token_ids": [int(t) for t in flushed["output_token_ids"]],
                    "codes": [int(c) for c in codes.reshape(-1).tolist()],
                    "code2wav_prompt_len": len(code2wav_prompt["prompt_token_ids"]),
                    "payload_keys": sorted(payload),
                }
            )

        # 3. code2wav.
        ids2 = [f"{rid}-code2wav" for rid in ids]
        runners.generate(self.engines["code2wav"], prompts2, params2, ids2)
        results = []
        for rid, info in zip(ids2, talker_info, strict=True):
            audio, sample_rate = runners.code2wav_audio(CODE2WAV_OUTPUTS, rid)
            results.append(
                {
                    **info,
                    "audio": _b64(np.asarray(audio, dtype=np.float32)),
                    "sample_rate": sample_rate,
                    "wav": runners.vllm_omni_wav(audio, sample_rate),
                }
            )
        return results

    def close(self) -> None:
        runners.shutdown(self.engines)


def oracle_main(argv: list[str]) -> int:
    """The oracle process: reads JSON commands, one a line, from stdin; answers each with one JSON
    line on stdout (vLLM's own output goes to stderr). A command: ``{"requests": [...], "batch":
    bool, "chain": NAME}`` (``chain``: one of ``--chains``, default the first); ``{"quit": true}``
    or end of input ends it."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE} oracle")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument(
        "--chains",
        default='{"default": {}}',
        help="JSON: chain name -> ChainSettings fields; each chain is a talker and a code2wav engine",
    )
    parser.add_argument("--scratch", type=Path, default=None)
    args = parser.parse_args(argv)
    started = time.time()
    answers = runners.oracle_answers(REPO_ROOT)
    import tempfile

    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="oracle-qwen3-tts-"))
    chains = {
        name: OracleChain(args.checkpoint, ChainSettings(**fields), scratch)
        for name, fields in json.loads(args.chains).items()
    }
    answers.write(json.dumps({"ready": True, "init_s": time.time() - started}) + "\n")
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            command = json.loads(line)
            if command.get("quit"):
                break
            try:
                chain = chains[command.get("chain") or next(iter(chains))]
                reply = chain.run(command["requests"], bool(command.get("batch")))
            except Exception as exc:  # answered, so the caller reports it
                reply = runners.error_reply(exc)
            reply["time"] = time.time()
            answers.write(json.dumps(reply) + "\n")
    finally:
        for chain in chains.values():
            chain.close()
    return 0


# =========================================================================== the omnigen side


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def omnigen_environment() -> dict[str, str]:
    """What ``omnigen run``/``serve`` run with (as tests/e2e/test_serve.py)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # ``omnigen run``'s in-process engines: one OpenMP thread (see runners.start_oracle_process); those of
            # ``omnigen serve`` get one from vLLM's CPU worker either way.
            "OMP_NUM_THREADS": "1",
            "VLLM_PLUGINS": "omnigen",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
        }
    )
    return env


def run_overrides(spec: dict[str, Any]) -> list[str]:
    """``omnigen run``'s overrides for one request."""
    found = [f"serve.seed={spec['seed']}"]
    for key in ("voice", "language", "instructions"):
        if spec.get(key) is not None:
            found.append(f"serve.request.{key}='{spec[key]}'")
    found.append(f"serve.prompt='{spec['input']}'")
    return found


def speech_body(spec: dict[str, Any]) -> dict[str, Any]:
    keys = ("input", "voice", "language", "instructions", "seed", "max_tokens")
    return {key: spec[key] for key in keys if spec.get(key) is not None}


def start_oracle(
    checkpoint: Path, chains: dict[str, ChainSettings], log: Path, scratch: Path
) -> subprocess.Popen:
    args = ["--checkpoint", str(checkpoint), "--scratch", str(scratch)]
    args += ["--chains", json.dumps({name: dataclasses.asdict(s) for name, s in chains.items()})]
    return runners.start_oracle_process(MODULE, args, log, REPO_ROOT, stdin=True)


def omnigen_command(command: str, checkpoint: Path, settings: ChainSettings, *extra: str) -> list[str]:
    return [sys.executable, "-m", "omnigen.cli", command, *settings.omnigen_overrides(checkpoint), *extra]


def start_run(
    checkpoint: Path, settings: ChainSettings, spec: dict[str, Any], wav: Path, log: Path
) -> subprocess.Popen:
    extra = ["serve.mode=inproc", f"serve.output={wav}", *run_overrides(spec)]
    with log.open("w") as out:
        return subprocess.Popen(
            omnigen_command("run", checkpoint, settings, *extra),
            cwd=REPO_ROOT,
            env=omnigen_environment(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def start_serve(checkpoint: Path, settings: ChainSettings, port: int, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            omnigen_command("serve", checkpoint, settings, f"serve.port={port}"),
            cwd=REPO_ROOT,
            env=omnigen_environment(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def wait_healthy(process: subprocess.Popen, base: str, log: Path, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"omnigen serve exited {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"omnigen serve did not come up in {timeout:.0f} s:\n{log.read_text()[-4000:]}")


def require_vllm_omni() -> None:
    """Skip the calling test module where vllm-omni (the model classes and the oracle) is not
    installed. Found, not imported: the pytest process never imports vLLM or vllm-omni (the oracle
    process does)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("vllm_omni") is None:
        pytest.skip(
            "vllm-omni (the model classes and the oracle) is not installed: it is tied to vLLM 0.30",
            allow_module_level=True,
        )


def post_speech(client: Any, body: dict[str, Any], label: str) -> bytes:
    """``POST /v1/audio/speech`` through an httpx client: the WAV answered (200, audio/wav)."""
    response = client.post("/v1/audio/speech", json=body)
    assert response.status_code == 200, f"{label}: {response.status_code} {response.text[:2000]}"
    assert response.headers["content-type"] == "audio/wav"
    return response.content


def post_speech_streamed(client: Any, body: dict[str, Any]) -> bytes:
    """``POST /v1/audio/speech`` streamed: the raw PCM16 as code2wav decodes each window."""
    streamed = client.post(
        "/v1/audio/speech", json={**body, "stream_format": "audio", "response_format": "pcm"}
    )
    assert streamed.status_code == 200, streamed.text[:2000]
    return streamed.content


@dataclasses.dataclass
class ServerEnd:
    """How ``omnigen serve`` ended (``stop_server``): its exit code after SIGTERM, the processes it
    started that outlived it ("PID NAME"), its whole log."""

    serve_exit: int
    orphans: list[str]
    serve_log: str


def stop_server(process: subprocess.Popen, log: Path) -> ServerEnd:
    """SIGTERM to ``omnigen serve``; the processes it started that outlived it are killed then,
    never left behind, and its log read once nothing of it runs."""
    import signal

    import psutil

    descendants = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(signal.SIGTERM)
    code = process.wait(120)
    _, alive = psutil.wait_procs(descendants, timeout=30)
    orphans = [f"{p.pid} {p.name()}" for p in alive]
    for orphan in alive:
        orphan.kill()
    return ServerEnd(serve_exit=code, orphans=orphans, serve_log=log.read_text())


def oracle_results(out: str, log: Path, *, commands: bool = False) -> dict[str, dict[str, Any]]:
    """The results of an oracle process's one answer (``out``: its stdout), by request id; the end
    of its ``log`` in the message where it answered anything else or an error. ``commands``: a
    command-driven oracle (``oracle_main`` here), which also says when it is ready."""
    replies = [json.loads(line) for line in out.splitlines() if line.strip()]
    if commands:
        replies = [reply for reply in replies if "results" in reply or "error" in reply]
    assert len(replies) == 1 and "error" not in replies[0], f"oracle: {replies}\n{log.read_text()[-6000:]}"
    return {result["id"]: result for result in replies[0]["results"]}


def kill_all(*processes: subprocess.Popen) -> None:
    """Kill those of the processes still running (a fixture's cleanup, whatever failed)."""
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def finished_run(process: subprocess.Popen, wav: Path, log: Path) -> bytes:
    code = process.wait(RUN_TIMEOUT_S)
    assert code == 0 and wav.is_file(), f"omnigen run exited {code}:\n{log.read_text()[-4000:]}"
    return wav.read_bytes()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "oracle":
        # Run in the module's importable copy: one copy of its globals (the dicts its runners fill).
        from omnigen_testing import qwen3_tts_chain as _self

        sys.exit(_self.oracle_main(sys.argv[2:]))
    sys.exit(f"usage: python -m {MODULE} oracle --checkpoint DIR [--chains JSON]")
