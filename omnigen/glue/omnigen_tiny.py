"""omnigen's tiny test model: talker -> code2wav (``conf/model/omnigen_tiny.yaml``).

No vllm-omni counterpart: the prompt is ``omnigen.testing.tiny_omni.talker_to_code2wav`` of
the talker's payload; the codes travel as the prompt, so there is no payload.
"""

from __future__ import annotations

from .types import NextStageInput, StageResult


def talker2code2wav(source: StageResult) -> NextStageInput:
    """The tiny talker's ``codes.audio`` -> the tiny code2wav's prompt (offset codes)."""
    # Imported here: tiny_omni imports vLLM's model layers, which a glue lookup need not load.
    from omnigen.testing.tiny_omni import talker_to_code2wav

    codes = source.get("codes.audio")
    return NextStageInput(prompt_token_ids=talker_to_code2wav({"codes.audio": codes}))
