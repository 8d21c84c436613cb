"""The glue functions by the dotted name a config gives (``next_stage_input``), and
``resolve(name)``.

``GLUE`` holds omnigen's ports of vllm-omni's stage input processors; a config may also name a
function of its own by dotted path (the pipeline imports it). ``VLLM_OMNI_EQUIVALENTS``
(``omnigen/vllm_omni_ports.py``) names the vllm-omni functions each port reproduces.
"""

from __future__ import annotations

from omnigen.vllm_omni_ports import VLLM_OMNI_EQUIVALENTS

from . import (
    higgs_audio_v3,
    indextts2,
    mimo_audio,
    minicpmo_4_5,
    moss_tts,
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
    )
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
