"""omnigen's tiny test models: talker -> code2wav (``conf/model/omnigen_tiny.yaml``) and
thinker -> talker -> code2wav (``conf/model/omnigen_tiny_omni.yaml``).

thinker -> talker: the talker's prompt is the thinker's output token ids mapped into the
talker's prompt range (``omnigen.testing.tiny_omni.thinker_to_talker``), and the payload is the
thinker's hidden rows (``{"thinker": {"hidden": ...}}``, one row per token the thinker ran), which
the tiny talker records on arrival, as a real talker reads the thinker's states from its buffer.

talker -> code2wav: the prompt is ``omnigen.testing.tiny_omni.talker_to_code2wav`` of the
talker's payload, and the codes also travel as the payload (``codes.audio``, the talker's
frames without placeholders), which the tiny code2wav checks its scheduled tokens against, as a
real code2wav reads its codes from the request's buffer.

No vllm-omni counterparts.
"""

from __future__ import annotations

from typing import Any

import torch

from .types import GlueError, NextStageInput, StageResult, bounds_next_prompt, owned_cpu

THINKER2TALKER = "omnigen.glue.omnigen_tiny.thinker2talker"


@bounds_next_prompt(lambda tokens, _payload, _hf_config: tokens)  # one talker id per thinker token
def thinker2talker(source: StageResult) -> NextStageInput:
    """The tiny thinker's output ids and ``hidden`` rows -> the tiny talker's prompt and payload."""
    from omnigen.testing.tiny_omni import thinker_to_talker

    if not source.output_token_ids:
        raise GlueError(THINKER2TALKER, source.request_id, "the thinker wrote no token for the talker")
    hidden = source.get("hidden")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise GlueError(
            THINKER2TALKER,
            source.request_id,
            f"expected the thinker's hidden rows as a (tokens, hidden) tensor, got {type(hidden).__name__}",
        )
    return NextStageInput(
        prompt_token_ids=thinker_to_talker(source.output_token_ids),
        payload={"thinker": {"hidden": owned_cpu(hidden)}},
    )


def _codes_of_tokens(tokens: int, _payload: Any, hf_config: Any) -> int:
    """At most one frame per talker token, ``omnigen_num_codebooks`` prompt ids a frame (the
    prefill's token has no frame: the code predictor runs on decode steps, so one frame needs
    two tokens)."""
    from omnigen.testing.tiny_omni import KNOB_DEFAULTS

    codebooks = getattr(hf_config, "omnigen_num_codebooks", KNOB_DEFAULTS["omnigen_num_codebooks"])
    return tokens * int(codebooks)


@bounds_next_prompt(_codes_of_tokens, min_producer_tokens=2)
def talker2code2wav(source: StageResult) -> NextStageInput:
    """The tiny talker's ``codes.audio`` -> the tiny code2wav's prompt (offset codes)."""
    # Imported here: tiny_omni imports vLLM's model layers, which a glue lookup need not load.
    from omnigen.testing.tiny_omni import talker_to_code2wav

    codes = source.get("codes.audio")
    prompt = talker_to_code2wav({"codes.audio": codes})
    frames = codes[(codes >= 0).all(dim=-1)].to("cpu", torch.long).clone()
    return NextStageInput(prompt_token_ids=prompt, payload={"codes": {"audio": frames}})
