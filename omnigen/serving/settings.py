"""What ``omnigen run`` and ``omnigen serve`` read from the composed config's ``serve`` section.

Each stage's model path (``omnigen_tiny:VARIANT`` writes a tiny test model's config to a
temporary folder), its engine arguments (``serve.engine`` under ``serve.stage_engine[stage]``),
the sampling of a request, and turning a text prompt into the first stage's token ids.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from omnigen.plan import ModelPlan

TINY_PREFIX = "omnigen_tiny:"
BYTE_TOKEN_OFFSET = 10
"""``serve.tokenizer=bytes``: byte ``b`` of a UTF-8 prompt is token ``b + 10``."""


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


def read_settings(cfg: DictConfig, plan: ModelPlan) -> Settings:
    serve = OmegaConf.to_container(cfg.serve, resolve=True)
    assert isinstance(serve, dict)
    stages = [s.stage for s in plan.stages]
    problems = []
    for stage in stages:
        if stage not in serve["models"]:
            problems.append(
                f"serve.models.{stage}: no model for stage {stage!r}; set serve.models.{stage}=PATH"
            )
    for stage in sorted(set(serve["models"]) - set(stages)):
        problems.append(
            f"serve.models.{stage}: {plan.name} has no stage {stage!r}; its stages: {', '.join(stages)}"
        )
    for stage in sorted(set(serve["stage_engine"]) - set(stages)):
        problems.append(f"serve.stage_engine.{stage}: {plan.name} has no stage {stage!r}")
    if not 0 < serve["port"] < 65536:
        problems.append(f"serve.port: {serve['port']} is not a TCP port (1..65535)")
    if serve["sample_rate"] <= 0 or serve["max_tokens"] <= 0:
        problems.append("serve.sample_rate and serve.max_tokens must be positive")
    if not 0 <= serve["temperature"] < float("inf"):
        problems.append(f"serve.temperature: {serve['temperature']} must be a finite number >= 0")
    if problems:
        raise SettingsError("; ".join(problems))
    scratch = Path(tempfile.mkdtemp(prefix="omnigen-tiny-"))
    return Settings(
        model=plan.name,
        stage_models={stage: _model_path(serve["models"][stage], stage, scratch) for stage in stages},
        engine_kwargs={
            stage: {**serve["engine"], **serve["stage_engine"].get(stage, {})} for stage in stages
        },
        mode=_enum_value(serve["mode"]),
        tokenizer=_enum_value(serve["tokenizer"]),
        max_tokens=serve["max_tokens"],
        temperature=serve["temperature"],
        seed=serve["seed"],
        sample_rate=serve["sample_rate"],
        prompt=serve["prompt"],
        prompt_token_ids=serve["prompt_token_ids"],
        output=serve["output"],
        host=serve["host"],
        port=serve["port"],
    )


def _enum_value(value: Any) -> str:
    return str(getattr(value, "value", value))


def _model_path(value: str, stage: str, scratch: Path) -> str:
    if not value.startswith(TINY_PREFIX):
        return value
    from omnigen.testing import tiny_omni

    variant = value.removeprefix(TINY_PREFIX)
    if variant not in tiny_omni.VARIANTS:
        raise SettingsError(
            f"serve.models.{stage}: no tiny variant {variant!r}; choose one of: {', '.join(sorted(tiny_omni.VARIANTS))}"
        )
    # omnigen_tiny:thinker also writes the thinker's tokenizer into its folder.
    return tiny_omni.write_tiny_config(
        scratch / stage, arch=tiny_omni.VARIANT_ARCHS[variant], variant=variant
    )


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
    settings: Settings, plan: ModelPlan, seed: int | None, max_tokens: int | None = None
) -> dict[str, Any]:
    """Each stage's ``SamplingParams`` for one request (a generation stage: one placeholder token)."""
    from vllm import SamplingParams

    detokenize = settings.tokenizer == "model"
    found: dict[str, Any] = {}
    for stage in plan.stages:
        if stage.is_generation:
            found[stage.stage] = SamplingParams(max_tokens=1, detokenize=False)
            continue
        found[stage.stage] = SamplingParams(
            max_tokens=max_tokens or settings.max_tokens,
            temperature=settings.temperature,
            seed=seed,
            ignore_eos=not detokenize,
            detokenize=detokenize,
            extra_args=None if seed is None else {"tts_local_seed": seed},
        )
    return found
