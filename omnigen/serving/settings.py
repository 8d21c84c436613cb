"""What ``omnigen run`` and ``omnigen serve`` read from the composed config's ``serve`` section.

Each stage's model path (``serve.checkpoint`` for every stage, ``serve.models.STAGE`` where one
differs; ``synthetic:VARIANT`` has the model's declared ``checkpoint.synthetic`` writer write one
to a temporary folder), its
engine arguments (``serve.engine`` under ``serve.stage_engine[stage]``, plus the stage's
architecture for a checkpoint whose config names the whole model), each stage's sampling, and
how a request becomes the first stage's input: the model's request builder where it declares
one (``checkpoint.request_builder``), else the text or token ids as given.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from omnigen.built import BuiltModel
from omnigen.requests.base import BuiltRequest, ChatInput, RequestBuilder, RequestError, SpeechInput

SYNTHETIC_PREFIX = "synthetic:"
BYTE_TOKEN_OFFSET = 10
"""``serve.tokenizer=bytes``: byte ``b`` of a UTF-8 prompt is token ``b + 10``."""
DEFAULT_SAMPLE_RATE = 24000
API_KEY_ENV = "OMNIGEN_API_KEY"
"""Where ``omnigen serve`` reads its API key when ``serve.api_key`` is null."""


class SettingsError(ValueError):
    """A ``serve`` setting that cannot run; names the key and the fix."""


@dataclass(frozen=True)
class Settings:
    model: str
    stage_models: dict[str, str]
    engine_kwargs: dict[str, dict[str, Any]]
    mode: str
    tokenizer: str
    max_tokens: int
    temperature: float
    seed: int | None
    sample_rate: int
    prompt: str
    prompt_token_ids: list[int] | None
    output: str
    host: str
    port: int
    stage_sampling: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per stage, the ``SamplingParams`` fields of ``serve.sampling`` (checked)."""
    stream: bool = False
    """``omnigen run`` writes the audio as it is made (``serve.stream``)."""
    builder: RequestBuilder | None = None
    """The model's request builder, made from the first stage's checkpoint; None: text as given."""
    request_options: dict[str, Any] = field(default_factory=dict)
    """``omnigen run``'s ``serve.request`` options that are set."""
    allowed_local_media_path: str | None = None
    """The folder under which a request's ``ref_audio`` may name a local file (None: none)."""
    api_key: str | None = field(default=None, repr=False)
    """The bearer token the server requires (None: none); never printed."""
    max_concurrent_requests: int = 64
    max_queued_requests: int = 256
    request_timeout_s: float = 600.0
    max_body_bytes: int = 16 * 1024 * 1024
    ray: dict[str, Any] | None = None
    """``serve.ray`` in ``serve.mode=ray`` (checked), else None."""


def read_settings(cfg: DictConfig, plan: BuiltModel) -> Settings:
    serve = OmegaConf.to_container(cfg.serve, resolve=True)
    assert isinstance(serve, dict)
    stages = [s.stage for s in plan.stages]
    problems = _stage_key_problems(serve, plan)
    if not 0 < serve["port"] < 65536:
        problems.append(f"serve.port: {serve['port']} is not a TCP port (1..65535)")
    if serve["max_tokens"] <= 0:
        problems.append(f"serve.max_tokens: {serve['max_tokens']} must be positive")
    if serve["sample_rate"] is not None and serve["sample_rate"] <= 0:
        problems.append(
            f"serve.sample_rate: {serve['sample_rate']} must be positive (or null: the checkpoint's)"
        )
    if not 0 <= serve["temperature"] < float("inf"):
        problems.append(f"serve.temperature: {serve['temperature']} must be a finite number >= 0")
    problems += _sampling_problems(serve["sampling"])
    for key in ("max_concurrent_requests", "max_body_bytes"):
        if serve[key] <= 0:
            problems.append(f"serve.{key}: {serve[key]} must be positive")
    if serve["max_queued_requests"] < 0:
        problems.append(f"serve.max_queued_requests: {serve['max_queued_requests']} must be >= 0")
    if not 0 < serve["request_timeout_s"] < float("inf"):
        problems.append(
            f"serve.request_timeout_s: {serve['request_timeout_s']} must be a positive number of seconds"
        )
    if serve["api_key"] is not None and not str(serve["api_key"]).strip():
        problems.append("serve.api_key: empty; set a key or leave it null")
    problems += _ray_problems(serve, plan)
    if problems:
        raise SettingsError("; ".join(problems))
    stage_models = _stage_models(serve, plan)
    first_max_tokens = (serve["sampling"].get(stages[0]) or {}).get("max_tokens", serve["max_tokens"])
    builder = _request_builder(plan, stage_models[stages[0]], first_max_tokens)
    sample_rate = serve["sample_rate"] or (builder.sample_rate() if builder else DEFAULT_SAMPLE_RATE)
    return Settings(
        model=plan.name,
        stage_models=stage_models,
        engine_kwargs={stage.stage: _engine_kwargs(serve, plan, stage.stage) for stage in plan.stages},
        mode=_enum_value(serve["mode"]),
        tokenizer=_enum_value(serve["tokenizer"]),
        max_tokens=serve["max_tokens"],
        temperature=serve["temperature"],
        seed=serve["seed"],
        sample_rate=sample_rate,
        prompt=serve["prompt"],
        prompt_token_ids=serve["prompt_token_ids"],
        output=serve["output"],
        stream=_stream_setting(serve["stream"], plan),
        host=serve["host"],
        port=serve["port"],
        stage_sampling={stage: dict(serve["sampling"].get(stage) or {}) for stage in stages},
        builder=builder,
        request_options={k: v for k, v in serve["request"].items() if v is not None},
        allowed_local_media_path=serve["allowed_local_media_path"],
        api_key=serve["api_key"] or os.environ.get(API_KEY_ENV) or None,
        max_concurrent_requests=serve["max_concurrent_requests"],
        max_queued_requests=serve["max_queued_requests"],
        request_timeout_s=float(serve["request_timeout_s"]),
        max_body_bytes=serve["max_body_bytes"],
        ray=serve["ray"] if _enum_value(serve["mode"]) == "ray" else None,
    )


def _stage_key_problems(serve: dict[str, Any], plan: BuiltModel) -> list[str]:
    stages = [s.stage for s in plan.stages]
    problems = []
    for stage in stages:
        if _stage_model(serve, stage) is None:
            problems.append(
                f"serve.models.{stage}: no checkpoint for stage {stage!r}; set serve.checkpoint=DIR "
                f"(one folder for every stage) or serve.models.{stage}=DIR"
            )
    for section in ("models", "stage_engine", "sampling"):
        for stage in sorted(set(serve[section]) - set(stages)):
            problems.append(
                f"serve.{section}.{stage}: {plan.name} has no stage {stage!r}; its stages: {', '.join(stages)}"
            )
    return problems


def _ray_problems(serve: dict[str, Any], plan: BuiltModel) -> list[str]:
    """``serve.ray`` is read in ``serve.mode=ray`` only: set in another mode it is refused."""
    from omnigen.serve_schema import RayConf

    if _enum_value(serve["mode"]) != "ray":
        default = OmegaConf.to_container(OmegaConf.structured(RayConf))
        assert isinstance(default, dict)
        return [
            f"serve.ray.{key}: read in serve.mode=ray only (mode is {_enum_value(serve['mode'])}); "
            "set serve.mode=ray or drop it"
            for key, value in serve["ray"].items()
            if value != default[key]
        ]
    from omnigen.serving import ray_stages

    return ray_stages.problems(serve["ray"], [s.stage for s in plan.stages], plan.name)


def _stage_model(serve: dict[str, Any], stage: str) -> str | None:
    return serve["models"].get(stage) or serve["checkpoint"]


def _sampling_problems(sampling: dict[str, Any]) -> list[str]:
    from vllm import SamplingParams

    # ``seed`` is a stage's default seed (vllm-omni deploys Qwen3-Omni's talker with one); a
    # request's own seed replaces it where the request's seed applies.
    known = set(inspect.signature(SamplingParams).parameters) - {"self", "n", "extra_args"}
    problems = []
    for stage, fields in sampling.items():
        for name in sorted(set(fields or {}) - known):
            problems.append(
                f"serve.sampling.{stage}.{name}: not a SamplingParams field this server sets; use one "
                f"of {', '.join(sorted(known))}"
            )
    return problems


def _engine_kwargs(serve: dict[str, Any], plan: BuiltModel, stage: str) -> dict[str, Any]:
    kwargs = {**serve["engine"], **serve["stage_engine"].get(stage, {})}
    arch = plan.stage(stage).arch
    if plan.stage(stage).model_class is not None and plan.checkpoint.model_type is not None:
        # A released checkpoint's config.json names the whole model (one folder, every stage):
        # each stage's engine builds its own architecture (the class the config declares).
        overrides = dict(kwargs.get("hf_overrides") or {})
        overrides.setdefault("architectures", [arch])
        kwargs["hf_overrides"] = overrides
    return kwargs


def _enum_value(value: Any) -> str:
    return str(getattr(value, "value", value))


def _stage_models(serve: dict[str, Any], plan: BuiltModel) -> dict[str, str]:
    """Each stage's model path; ``synthetic:VARIANT`` paths written once, to one scratch folder."""
    values = {s.stage: _stage_model(serve, s.stage) for s in plan.stages}
    if not any(value.startswith(SYNTHETIC_PREFIX) for value in values.values()):
        return values
    scratch = Path(tempfile.mkdtemp(prefix=f"omnigen-{plan.name}-synthetic-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)  # the engines read it at start only
    return {stage: _model_path(value, stage, plan, scratch) for stage, value in values.items()}


def _model_path(value: str, stage: str, plan: BuiltModel, scratch: Path) -> str:
    if not value.startswith(SYNTHETIC_PREFIX):
        return value
    variant = value.removeprefix(SYNTHETIC_PREFIX)
    writer_path = plan.checkpoint.synthetic
    if writer_path is None:
        raise SettingsError(
            f"serve.models.{stage}: {value!r} asks for a synthetic checkpoint, but {plan.name} declares "
            "no writer (checkpoint.synthetic in its model config); give a checkpoint folder instead"
        )
    writer = _declared(plan, "synthetic", writer_path)
    try:
        return str(writer(scratch / stage, variant))
    except ValueError as exc:  # the writer's own words, e.g. the variants it knows
        raise SettingsError(f"serve.models.{stage}: {value!r}: {exc}") from exc


def _declared(plan: BuiltModel, key: str, path: str) -> Any:
    """The object ``checkpoint.<key>`` names by dotted path, or the error that names the key."""
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise SettingsError(
            f"{plan.source}: checkpoint.{key} {path} does not load: {type(exc).__name__}: {exc}"
        ) from exc


def _request_builder(plan: BuiltModel, checkpoint: str, max_tokens: int) -> RequestBuilder | None:
    path = plan.checkpoint.request_builder
    if path is None:
        if plan.checkpoint.provider is not None:
            raise SettingsError(
                f"{plan.name}: omnigen has no request builder for {plan.title} yet, so it cannot turn "
                f"a request into its first stage's input (raw text would be wrong input, not an "
                f"error); the README's model table says which models serve from their checkpoints"
            )
        return None
    first = plan.stages[0].stage
    if not Path(checkpoint, "config.json").is_file():
        raise SettingsError(
            f"serve.models.{first}: {checkpoint!r} is not a checkpoint folder (no config.json); "
            f"{plan.name}'s requests are built from its files: give the downloaded folder"
        )
    cls = _declared(plan, "request_builder", path)
    try:
        return cls(checkpoint, default_max_tokens=max_tokens)
    except (OSError, ValueError, KeyError) as exc:
        raise SettingsError(f"serve.models.{first}: {checkpoint}: {exc}") from exc


def build_request(
    settings: Settings,
    speech: SpeechInput | None,
    token_ids: list[int] | None = None,
    *,
    from_network: bool = False,
) -> BuiltRequest:
    """The first stage's prompt and payload for one request (``RequestError`` names a bad field).

    ``from_network``: the request came over HTTP, so a local ``ref_audio`` file is read only
    under ``serve.allowed_local_media_path`` (``omnigen run``'s own files are the user's)."""
    if settings.builder is not None and settings.builder.api == "chat":
        raise RequestError(
            "input",
            f"{settings.model} is a chat model: /v1/audio/speech and /v1/omnigen/generate serve "
            'dedicated speech models; send its messages to POST /v1/chat/completions (with "modalities": '
            '["text", "audio"] for speech)',
        )
    if token_ids is not None:
        if settings.builder is not None:
            raise RequestError(
                "prompt_token_ids",
                f"{settings.model} builds its prompt from the request's text and options; send input instead",
            )
        return BuiltRequest(prompt={"prompt_token_ids": list(token_ids)})
    if speech is None or not speech.input:
        raise RequestError("input", "a request needs a text prompt (input) or prompt_token_ids")
    if settings.builder is not None:
        from omnigen.providers.vllm_omni import module_installed

        for module in settings.builder.engine_modules(speech):
            if not module_installed(module):
                field_name = "ref_audio" if speech.ref_audio is not None else "input"
                raise RequestError(
                    field_name,
                    f"this request needs {module} in the stages' processes, which is not installed "
                    f"here (install the {module} build that matches your torch)",
                )
        if (
            from_network
            and speech.ref_audio is not None
            and not _ref_audio_allowed(settings, speech.ref_audio)
        ):
            raise RequestError(
                "ref_audio",
                "a local file is read only under serve.allowed_local_media_path "
                f"({settings.allowed_local_media_path or 'not set'}); send a data: URI",
            )
        return settings.builder.build(speech)
    _refuse_model_options(speech, settings.model)
    return BuiltRequest(prompt=prompt_of(settings, speech.input, None), max_tokens=speech.max_new_tokens)


def build_chat_request(settings: Settings, chat: ChatInput) -> BuiltRequest:
    """The first stage's prompt and payload for one chat request (``RequestError`` names a bad
    field); a model whose builder takes no chat messages is refused, naming what it takes."""
    builder = settings.builder
    if builder is None or builder.api != "chat":
        takes = "speech requests (POST /v1/audio/speech)" if builder is not None else "text or token ids"
        raise RequestError(
            "messages", f"{settings.model} has no chat request builder: it takes {takes}, not chat messages"
        )
    return builder.build_chat(chat)


def _ref_audio_allowed(settings: Settings, source: str) -> bool:
    """``data:`` URIs always; a local path (or ``file:`` URI) only under the allowed folder."""
    if source.startswith("data:"):
        return True
    if settings.allowed_local_media_path is None:
        return False
    from urllib.parse import urlparse
    from urllib.request import url2pathname

    path = Path(url2pathname(urlparse(source).path) if source.startswith("file:") else source)
    root = Path(settings.allowed_local_media_path).resolve()
    return path.resolve().is_relative_to(root)


def _refuse_model_options(speech: SpeechInput, model: str) -> None:
    """A model without a request builder has no voices, languages or cloning: say so, never ignore."""
    for name in ("voice", "language", "instructions", "task_type", "ref_audio", "ref_text"):
        if getattr(speech, name) not in (None, "", "default"):
            raise RequestError(name, f"{model} takes no {name} (it has no request builder)")


def prompt_of(settings: Settings, text: str | None, token_ids: list[int] | None) -> dict[str, Any]:
    """The first stage's prompt: token ids as given, or the text (tokenized by the model, or bytes)."""
    if token_ids is not None:
        return {"prompt_token_ids": list(token_ids)}
    if text is None:
        raise SettingsError("a request needs a text prompt (input) or prompt_token_ids")
    if settings.tokenizer == "bytes":
        return {
            "prompt_token_ids": [b + BYTE_TOKEN_OFFSET for b in text.encode("utf-8")] or [BYTE_TOKEN_OFFSET]
        }
    return {"prompt": text}


def sampling_of(
    settings: Settings,
    plan: BuiltModel,
    seed: int | None,
    max_tokens: int | None = None,
    first_stage: dict[str, Any] | None = None,
    *,
    later_stages: dict[str, dict[str, Any]] | None = None,
    request_first_stage_only: bool = False,
) -> dict[str, Any]:
    """Each stage's ``SamplingParams`` for one request (a generation stage: one placeholder token).

    Per autoregressive stage: ``serve.max_tokens``/``temperature``, then ``serve.sampling.STAGE``
    (a ``seed`` there is the stage's default), then the request's own token budget and seed;
    ``first_stage`` adds what the request builder asks of the first stage (its stop ids, ...),
    ``later_stages`` what it asks of later ones. The request's token budget and seed (also its
    code predictor's, ``tts_local_seed``) go to every autoregressive stage, or with
    ``request_first_stage_only`` to the first one only: a chat request's budget and seed are its
    text's (vllm-omni's chat serving overrides the first stage's sampling only); the later stages
    keep their configured ones."""
    from vllm import SamplingParams

    detokenize = settings.tokenizer == "model"
    found: dict[str, Any] = {}
    for index, stage in enumerate(plan.stages):
        if stage.is_generation:
            found[stage.stage] = SamplingParams(max_tokens=1, detokenize=False)
            continue
        fields: dict[str, Any] = {
            "max_tokens": settings.max_tokens,
            "temperature": settings.temperature,
            "ignore_eos": not detokenize,
            "detokenize": detokenize,
            **settings.stage_sampling.get(stage.stage, {}),
        }
        if index == 0:
            fields.update(first_stage or {})
            if max_tokens is not None:
                fields["max_tokens"] = max_tokens
        else:
            fields.update((later_stages or {}).get(stage.stage, {}))
            if max_tokens is not None and not request_first_stage_only:
                fields["max_tokens"] = max_tokens
        if fields.get("min_tokens", 0) > fields["max_tokens"]:
            fields["min_tokens"] = fields["max_tokens"]  # a shorter budget than the floor: the budget wins
        stage_seed = fields.pop("seed", None)
        own = seed if (index == 0 or not request_first_stage_only) else None
        found[stage.stage] = SamplingParams(
            **fields,
            seed=own if own is not None else stage_seed,
            extra_args=None if own is None else {"tts_local_seed": own},
        )
    return found


def _stream_setting(stream: bool, plan: BuiltModel) -> bool:
    """``serve.stream`` needs a streaming edge into the audio stage: refused otherwise, never ignored."""
    if stream and not any(stage.stream is not None for stage in plan.stages):
        raise SettingsError(
            f"serve.stream: {plan.name} has no streaming edge (no stage sets stream.enabled); set "
            "model.stages.STAGE.stream in its config, or drop serve.stream"
        )
    return bool(stream)
