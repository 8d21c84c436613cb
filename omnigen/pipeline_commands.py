"""``omnigen run`` / ``omnigen serve``: compose, check, start one engine per stage."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import click

from omnigen import paths, pipeline

log = logging.getLogger("omnigen.serving")

# Overrides that change the generated runners, which the pipeline composes again; the rest
# (serve.*) only say how to run them.
_RUNNER_OVERRIDES = ("model.", "+model.", "~model.", "device=", "graph=", "mtp_graph=")


# The serve sections that are free-form maps (stage -> path, engine argument -> value, ...):
# a key a serve config does not list yet is added, as vLLM's own ``--key value`` would be. Their
# keys are checked where they are read (unknown stages by the settings, engine arguments by vLLM).
_MAP_SECTIONS = ("serve.models.", "serve.engine.", "serve.stage_engine.", "serve.sampling.")


def serve_overrides(model: str, overrides: Sequence[str]) -> list[str]:
    """The overrides ``run``/``serve`` compose with: ``serve=<model>`` first when the user chose
    no serve config and the model has one (``conf/serve/<model>.yaml``: its stages, engine
    arguments and sampling), and keys under the serve maps added where they are new."""
    found = [f"++{o}" if o.startswith(_MAP_SECTIONS) else o for o in overrides]
    if any(o.startswith(("serve=", "+serve=", "~serve")) for o in overrides):
        return found
    folders = [paths.conf_dir(), *paths.extra_config_dirs()]
    if any((folder / "serve" / f"{model}.yaml").is_file() for folder in folders):
        return [f"serve={model}", *found]
    return found


def run(command: str, model: str, overrides: Sequence[str]) -> int:
    from omnigen.requests.base import RequestError, SpeechInput
    from omnigen.serving.limits import check_request
    from omnigen.serving.pipeline import Pipeline, PipelineError
    from omnigen.serving.settings import SettingsError, build_request, read_settings, sampling_of

    overrides = serve_overrides(model, overrides)
    cfg = pipeline.compose_config(model, overrides)
    plan = pipeline.plan_from_config(cfg, model, overrides)
    try:
        settings = read_settings(cfg, plan)
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from exc
    if command == "serve" and settings.mode != "mp":
        raise click.UsageError("serves requests concurrently with one engine per process: set serve.mode=mp")
    runner_overrides = [o for o in overrides if o.startswith(_RUNNER_OVERRIDES)]
    try:
        pipe = Pipeline.from_model(
            model,
            settings.stage_models,
            mode=settings.mode,
            engine_kwargs=settings.engine_kwargs,
            overrides=runner_overrides,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    with pipe:
        if command == "serve":
            from omnigen.serving.http import serve

            return serve(pipe, settings)
        try:
            speech = SpeechInput(input=settings.prompt, seed=settings.seed, **settings.request_options)
            built = build_request(settings, speech, settings.prompt_token_ids)
            sampling = sampling_of(settings, plan, settings.seed, built.max_tokens, built.sampling)
            check_request(pipe.limits, pipe.stages, built, sampling)
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

        Path(settings.output).write_bytes(wav_bytes(out.audio, settings.sample_rate))
        seconds = out.audio.numel() / settings.sample_rate
        click.echo(
            f"omnigen run: wrote {settings.output} ({seconds:.3f} s of audio at {settings.sample_rate} Hz)"
        )
    click.echo("per stage: " + ", ".join(f"{stage} {s:.3f} s" for stage, s in out.seconds.items()))
    return 0
