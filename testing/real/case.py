"""What one real-model stage case states, for both runners of the differential test.

A case module (``testing/real/cases/<name>.py``) defines ``CASE = RealStageCase(...)``.
The harness (``harness.py``) runs the case twice through vLLM's ``LLM`` on CPU: once with
omnigen's generated worker for ``(omnigen_model, omnigen_stage)``, once with vllm-omni's
runner composed onto vLLM's CPU runner, and compares the two traces step by step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RealRequest:
    """One request of a case: its prompt ids, sampling and the payload it arrives with."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    payload: dict[str, Any] | None = None
    """What the producing stage (or orchestrator) would hand this stage for the request;
    delivered to omnigen inline (``SamplingParams.extra_args``), to the oracle as vllm-omni's
    ``additional_information``."""
    seed: int | None = None
    """``extra_args["tts_local_seed"]``: seeds the code predictor (CONTRACT 2.3)."""
    temperature: float = 0.0
    sampling_seed: int | None = None
    """``SamplingParams.seed`` (vLLM's own sampler)."""


@dataclass(frozen=True)
class RealStageCase:
    name: str
    omnigen_model: str
    omnigen_stage: str
    arch: str
    """The architecture registered with vLLM (and written into the tiny config)."""
    model_class: str
    """Qualified name of vllm-omni's model class, registered with ``ModelRegistry`` only."""
    oracle_runner: str
    """Qualified name of vllm-omni's runner class composed onto ``CPUModelRunner``."""
    write_checkpoint: Callable[[Path], Path]
    """Writes the tiny config (and tokenizer files the class needs) into a folder; returns it."""
    requests: Callable[[], list[RealRequest]]
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra ``LLM(...)`` kwargs (dtype, max_num_batched_tokens for chunked prefill, ...)."""
    omni_model_config: dict[str, Any] = field(default_factory=dict)
    """Fields vllm-omni's ``OmniModelConfig`` adds that the ORACLE runner needs on
    ``model_config`` (omnigen's worker sets its own from conf/)."""
    redraw_weights_std: float | None = 0.5
    """Weights re-drawn from N(0, std) with a fixed generator after loading, so outputs
    depend on the runner's inputs; None keeps the dummy loader's weights."""
    not_on_cpu: str | None = None
    """Why the stage cannot run on CPU (then the case is reported, not run)."""
