"""``omnigen run`` / ``omnigen serve``: compose the serve settings, read the model from its built
package (``omnigen.api.served_model``: a variant only where overrides change the runners), check,
start one engine per stage."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import click

from omnigen import api, paths, pipeline

log = logging.getLogger("omnigen.serving")

# The serve sections that are free-form maps (stage -> path, engine argument -> value, ...):
# a key a serve config does not list yet is added, as vLLM's own ``--key value`` would be. Their
# keys are checked where they are read (unknown stages by the settings, engine arguments by vLLM).
_MAP_SECTIONS = (
    "serve.models.",
    "serve.engine.",
    "serve.stage_engine.",
    "serve.sampling.",
    "serve.ray.stages.",
    "serve.ray.env_vars.",
    "serve.ray.replica.resources.",
    "serve.ray.replica.label_selector.",
)


def _in_a_map(override: str) -> bool:
    """A key under a serve map (``serve.engine.x=1``) or a whole map (``serve.engine={x: 1}``,
    which Hydra merges into it)."""
    key = override.split("=", 1)[0]
    return key.startswith(_MAP_SECTIONS) or f"{key}." in _MAP_SECTIONS


def serve_overrides(model: str, overrides: Sequence[str]) -> list[str]:
    """The overrides ``run``/``serve`` compose with: ``serve=<model>`` first when the user chose
    no serve config and the model has one (``conf/serve/<model>.yaml``: its stages, engine
    arguments and sampling), and keys under the serve maps added where they are new."""
    found = [f"++{o}" if _in_a_map(o) else o for o in overrides]
    if any(o.startswith(("serve=", "+serve=", "~serve")) for o in overrides):
        return found
    folders = [paths.conf_dir(), *paths.extra_config_dirs()]
    if any((folder / "serve" / f"{model}.yaml").is_file() for folder in folders):
        return [f"serve={model}", *found]
    return found


def _run_request(settings, plan):
    """``omnigen run``'s one request: the first stage's input, each stage's sampling and what
    check_request blames a too-long prompt on."""
    from omnigen.requests.base import ChatInput, RequestError, SpeechInput
    from omnigen.serving.settings import build_chat_request, build_request, sampling_of

    options = dict(settings.request_options)
    if settings.builder is not None and settings.builder.api == "chat":
        extra = sorted(set(options) - {"messages", "voice", "language"})
        if extra:
            raise RequestError(
                extra[0], f"{settings.model} is a chat model: it takes messages, voice and language"
            )
        if settings.prompt_token_ids is not None:
            raise RequestError("prompt_token_ids", f"{settings.model} renders its prompt from messages")
        messages = options.get("messages") or [{"role": "user", "content": settings.prompt}]
        chat = ChatInput(
            messages=tuple(messages), voice=options.get("voice"), language=options.get("language")
        )
        built = build_chat_request(settings, chat)
        sampling = sampling_of(
            settings,
            plan,
            settings.seed,
            built.max_tokens,
            built.sampling,
            later_stages=built.stage_sampling,
            request_first_stage_only=True,
        )
        return built, sampling, "messages"
    if "messages" in options:
        raise RequestError(
            "messages", f"{settings.model} takes a text prompt (serve.prompt), not chat messages"
        )
    speech = SpeechInput(input=settings.prompt, seed=settings.seed, **options)
    built = build_request(settings, speech, settings.prompt_token_ids)
    sampling = sampling_of(settings, plan, settings.seed, built.max_tokens, built.sampling)
    return built, sampling, "input"


def run(command: str, model: str, overrides: Sequence[str]) -> int:
    from omnigen.requests.base import RequestError
    from omnigen.serving.limits import check_request
    from omnigen.serving.pipeline import Pipeline, PipelineError
    from omnigen.serving.settings import SettingsError, read_settings

    overrides = serve_overrides(model, overrides)
    cfg = pipeline.compose_config(model, overrides)  # the serve section (and a config error early)
    plan = api.served_model(model, overrides, cfg=cfg)
    try:
        settings = read_settings(cfg, plan)
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from exc
    if command == "serve" and settings.mode not in ("mp", "ray"):
        raise click.UsageError(
            "serves requests concurrently with one engine per process: set serve.mode=mp (or ray)"
        )
    try:
        pipe = Pipeline.from_model(
            plan,
            settings.stage_models,
            mode=settings.mode,
            engine_kwargs=settings.engine_kwargs,
            ray=settings.ray,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    with pipe:
        if command == "serve":
            from omnigen.serving.http import serve

            return serve(pipe, settings)
        try:
            built, sampling, prompt_field = _run_request(settings, plan)
            check_request(pipe.limits, pipe.stages, built, sampling, prompt_field=prompt_field)
            if settings.stream:
                out = _stream_to_file(pipe, built, sampling, Path(settings.output), settings.sample_rate)
            else:
                (out,) = pipe.generate([built.prompt], sampling, payloads=[built.payload])
        except RequestError as exc:
            log.error("omnigen run: serve.request.%s", exc)
            return 1
        except (PipelineError, SettingsError) as exc:
            log.error("omnigen run: %s", exc)
            return 1
    for stage, text in out.text.items():
        click.echo(f"{stage}: {text}")
    if out.audio is not None:
        from omnigen.serving.audio import wav_bytes

        if not settings.stream:
            Path(settings.output).write_bytes(wav_bytes(out.audio, settings.sample_rate))
        seconds = out.audio.numel() / settings.sample_rate
        click.echo(
            f"omnigen run: wrote {settings.output} ({seconds:.3f} s of audio at {settings.sample_rate} Hz)"
        )
    click.echo("per stage: " + ", ".join(f"{stage} {s:.3f} s" for stage, s in out.seconds.items()))
    return 0


def _stream_to_file(pipe, built, sampling, output: Path, sample_rate: int):
    """A streaming pipeline's audio written as it arrives: each window's samples go to
    ``OUTPUT.part`` (a WAV a player can follow), renamed to ``OUTPUT`` when the take is whole; a
    failed run removes the part file and leaves any earlier ``OUTPUT`` as it was."""
    import soundfile

    from omnigen.serving.audio_out import to_pcm16
    from omnigen.serving.streaming import AudioChunk, stream

    part = output.with_name(output.name + ".part")
    out = None
    try:
        with soundfile.SoundFile(
            part, "w", samplerate=sample_rate, channels=1, subtype="PCM_16", format="WAV"
        ) as file:
            for item in stream(pipe, built.prompt, sampling, payload=built.payload):
                if isinstance(item, AudioChunk):
                    if item.index == 0:
                        click.echo(f"omnigen run: first audio after {item.seconds:.3f} s, writing {part}")
                    file.write(to_pcm16(item.samples))
                    file.flush()
                else:
                    out = item
        part.replace(output)
    finally:
        part.unlink(missing_ok=True)
    return out
