"""omnigen's tiny test model: talker -> code2wav (``conf/model/omnigen_tiny.yaml``).

No vllm-omni counterpart: the prompt is ``omnigen.testing.tiny_omni.talker_to_code2wav`` of
the talker's payload, and the codes also travel as the payload (``codes.audio``, the talker's
frames without placeholders), which the tiny code2wav checks its scheduled tokens against, as a
real code2wav reads its codes from the request's buffer.
"""

from __future__ import annotations

import torch

from .types import NextStageInput, StageResult


def talker2code2wav(source: StageResult) -> NextStageInput:
    """The tiny talker's ``codes.audio`` -> the tiny code2wav's prompt (offset codes)."""
    # Imported here: tiny_omni imports vLLM's model layers, which a glue lookup need not load.
    from omnigen.testing.tiny_omni import talker_to_code2wav

    codes = source.get("codes.audio")
    prompt = talker_to_code2wav({"codes.audio": codes})
    frames = codes[(codes >= 0).all(dim=-1)].to("cpu", torch.long).clone()
    return NextStageInput(prompt_token_ids=prompt, payload={"codes": {"audio": frames}})
