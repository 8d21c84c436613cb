"""Which vllm-omni 0.30 stage input processors each of omnigen's glue ports reproduces (strings:
nothing imports vllm-omni). Plain data, so that the generator can word its error for a config that
names vllm-omni's function (``spec``) without importing the glue and torch; ``omnigen.glue``
checks that every port is listed, and the oracle test walks the table.
"""

from __future__ import annotations

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
}
