"""Tiny checkpoint folders shaped like released ones, with seeded random weights in safetensors.

Unlike the config-only checkpoints of ``testing/real/cases`` (which run under vLLM's dummy
loader), these folders carry every tensor the model classes load, under the released names, so
vLLM's real weight-loading path runs on them (``load_format="safetensors"``).

    .venv/bin/python -m omnigen_testing.checkpoints qwen3_tts --variant custom_voice --out /tmp/q3tts
    .venv/bin/python -m omnigen_testing.checkpoints qwen3_omni --out /tmp/q3omni
    .venv/bin/python -m omnigen_testing.checkpoints higgs_audio_v3 --out /tmp/higgs

One module per model family; ``WRITERS`` maps the CLI's model names to their writers.
"""

from __future__ import annotations

from omnigen_testing.checkpoints.higgs_audio_v3 import write_higgs_audio_v3
from omnigen_testing.checkpoints.qwen3_omni import write_qwen3_omni
from omnigen_testing.checkpoints.qwen3_tts import VARIANTS as QWEN3_TTS_VARIANTS
from omnigen_testing.checkpoints.qwen3_tts import write_qwen3_tts

WRITERS = {
    "qwen3_tts": write_qwen3_tts,
    "higgs_audio_v3": write_higgs_audio_v3,
    "qwen3_omni": write_qwen3_omni,
}

__all__ = ["QWEN3_TTS_VARIANTS", "WRITERS", "write_higgs_audio_v3", "write_qwen3_omni", "write_qwen3_tts"]
