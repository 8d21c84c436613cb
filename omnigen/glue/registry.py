"""The glue functions by the dotted name a config gives (``next_stage_input``), and
``resolve(name)``.

``VLLM_OMNI_EQUIVALENTS`` names, per function, the vllm-omni 0.30 functions whose results it
reproduces (as strings: nothing here imports vllm-omni); the oracle test walks it.
"""

from __future__ import annotations

from . import (
    higgs_audio_v3,
    indextts2,
    mimo_audio,
    minicpmo_4_5,
    moss_tts,
    omnigen_tiny,
    qwen2_5_omni,
    qwen3_omni,
    qwen3_tts,
)
from .types import Glue

GLUE: dict[str, Glue] = {
    f"{function.__module__}.{function.__name__}": function
    for function in (
        qwen3_tts.talker2code2wav,
        qwen3_omni.thinker2talker,
        qwen3_omni.talker2code2wav,
        qwen2_5_omni.thinker2talker,
        qwen2_5_omni.talker2code2wav,
        mimo_audio.llm2code2wav,
        minicpmo_4_5.llm2tts,
        minicpmo_4_5.tts2code2wav,
        indextts2.talker2s2mel,
        higgs_audio_v3.talker2code2wav,
        moss_tts.talker2codec,
        omnigen_tiny.talker2code2wav,
        omnigen_tiny.thinker2talker,
    )
}

_P = "vllm_omni.model_executor.stage_input_processors"
VLLM_OMNI_EQUIVALENTS: dict[str, tuple[str, ...]] = {
    # omnigen name: (vllm-omni producer-side payload builder, consumer-side prompt builder),
    # or just the one function where vllm-omni's edge has one.
    "omnigen.glue.qwen3_tts.talker2code2wav": (
        f"{_P}.qwen3_tts.talker2code2wav_full_payload",
        f"{_P}.qwen3_tts.talker2code2wav_token_only",
    ),
    "omnigen.glue.qwen3_omni.thinker2talker": (
        f"{_P}.qwen3_omni.thinker2talker_full_payload",
        f"{_P}.qwen3_omni.thinker2talker_token_only",
    ),
    # The code2wav stage has no input function: its prompt is the talker's output ids.
    "omnigen.glue.qwen3_omni.talker2code2wav": (f"{_P}.qwen3_omni.talker2code2wav_full_payload",),
    "omnigen.glue.qwen2_5_omni.thinker2talker": (
        f"{_P}.qwen2_5_omni.thinker2talker_full_payload",
        f"{_P}.qwen2_5_omni.thinker2talker_token_only",
    ),
    "omnigen.glue.qwen2_5_omni.talker2code2wav": (
        f"{_P}.qwen2_5_omni.talker2code2wav_full_payload",
        f"{_P}.qwen2_5_omni.talker2code2wav_token_only",
    ),
    "omnigen.glue.mimo_audio.llm2code2wav": (
        f"{_P}.mimo_audio.llm2code2wav_full_payload",
        f"{_P}.mimo_audio.llm2code2wav_token_only",
    ),
    "omnigen.glue.minicpmo_4_5.llm2tts": (f"{_P}.minicpmo_4_5_omni.llm2tts",),
    "omnigen.glue.minicpmo_4_5.tts2code2wav": (
        f"{_P}.minicpmo_4_5_omni.tts2code2wav_full_payload",
        f"{_P}.minicpmo_4_5_omni.tts2code2wav_token_only",
    ),
    "omnigen.glue.indextts2.talker2s2mel": (
        f"{_P}.indextts2.talker2s2mel_full_payload",
        f"{_P}.indextts2.talker2s2mel_token_only",
    ),
    "omnigen.glue.higgs_audio_v3.talker2code2wav": (f"{_P}.higgs_audio_v3.talker2code2wav",),
    "omnigen.glue.moss_tts.talker2codec": (f"{_P}.moss_tts.talker2codec",),
    "omnigen.glue.omnigen_tiny.talker2code2wav": (),
    "omnigen.glue.omnigen_tiny.thinker2talker": (),
}


class UnknownGlueError(KeyError):
    """A config names a glue function omnigen does not have."""

    def __str__(self) -> str:  # KeyError would print the repr, newlines escaped
        return str(self.args[0])


def resolve(name: str) -> Glue:
    """The glue function a config names, e.g. ``"omnigen.glue.qwen3_tts.talker2code2wav"``."""
    try:
        return GLUE[name]
    except KeyError:
        hint = ""
        if name.startswith("vllm_omni."):
            matches = [ours for ours, theirs in VLLM_OMNI_EQUIVALENTS.items() if name in theirs]
            hint = f" (omnigen's version: {matches[0]})" if matches else ""
        known = "\n  ".join(sorted(GLUE))
        raise UnknownGlueError(f"unknown glue function {name!r}{hint}; known:\n  {known}") from None
