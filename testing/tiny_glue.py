"""omnigen's tiny test models: talker -> code2wav (``conf/model/omnigen_tiny.yaml``) and
thinker -> talker -> code2wav (``conf/model/omnigen_tiny_omni.yaml``).

thinker -> talker: the talker's prompt is the thinker's output token ids mapped into the
talker's prompt range (``omnigen_testing.tiny_omni.thinker_to_talker``), and the payload is the
thinker's hidden rows (``{"thinker": {"hidden": ...}}``, one row per token the thinker ran), which
the tiny talker records on arrival, as a real talker reads the thinker's states from its buffer.

talker -> code2wav: the prompt is ``omnigen_testing.tiny_omni.talker_to_code2wav`` of the
talker's payload, and the codes also travel as the payload (``codes.audio``, the talker's
frames without placeholders), which the tiny code2wav checks its scheduled tokens against, as a
real code2wav reads its codes from the request's buffer.

No vllm-omni counterparts.
"""

from __future__ import annotations

from typing import Any

import torch

from omnigen.glue.types import (
    GlueError,
    NextStageInput,
    StageResult,
    Window,
    WindowInput,
    bounds_next_prompt,
    counts_frames,
    owned_cpu,
)

THINKER2TALKER = "omnigen_testing.tiny_glue.thinker2talker"
TALKER2CODE2WAV_WINDOW = "omnigen_testing.tiny_glue.talker2code2wav_window"


@bounds_next_prompt(lambda tokens, _payload, _hf_config: tokens)  # one talker id per thinker token
def thinker2talker(source: StageResult) -> NextStageInput:
    """The tiny thinker's output ids and ``hidden`` rows -> the tiny talker's prompt and payload."""
    from omnigen_testing.tiny_omni import thinker_to_talker

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
    from omnigen_testing.tiny_omni import KNOB_DEFAULTS

    codebooks = getattr(hf_config, "omnigen_num_codebooks", KNOB_DEFAULTS["omnigen_num_codebooks"])
    return tokens * int(codebooks)


@bounds_next_prompt(_codes_of_tokens, min_producer_tokens=2)
def talker2code2wav(source: StageResult) -> NextStageInput:
    """The tiny talker's ``codes.audio`` -> the tiny code2wav's prompt (offset codes)."""
    # Imported here: tiny_omni imports vLLM's model layers, which a glue lookup need not load.
    from omnigen_testing.tiny_omni import talker_to_code2wav

    codes = source.get("codes.audio")
    prompt = talker_to_code2wav({"codes.audio": codes})
    frames = codes[(codes >= 0).all(dim=-1)].to("cpu", torch.long).clone()
    return NextStageInput(prompt_token_ids=prompt, payload={"codes": {"audio": frames}})


def _talker_frames(source: StageResult) -> torch.Tensor:
    codes = source.get("codes.audio")
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
        return torch.zeros((0, 0), dtype=torch.long)
    return codes[(codes >= 0).all(dim=-1)].to("cpu", torch.long)


@counts_frames(lambda source: int(_talker_frames(source).shape[0]))
def talker2code2wav_window(source: StageResult, window: Window) -> WindowInput:
    """One window of the tiny talker's frames -> a tiny code2wav request for it and its left
    context; the context's samples (``hop_length`` per code, ``num_codebooks`` codes a frame)
    are dropped from the front of the window's audio."""
    from omnigen_testing.tiny_omni import KNOB_DEFAULTS, talker_to_code2wav

    frames = _talker_frames(source)[window.start - window.left_context : window.end].clone()
    if frames.shape[0] != window.end - window.start + window.left_context:
        raise GlueError(
            TALKER2CODE2WAV_WINDOW,
            source.request_id,
            f"window {window.index} needs frames [{window.start - window.left_context}, {window.end}), "
            f"the payload holds {int(_talker_frames(source).shape[0])}",
        )
    hop = int(getattr(source.hf_config, "omnigen_hop_length", KNOB_DEFAULTS["omnigen_hop_length"]))
    return WindowInput(
        request=NextStageInput(
            prompt_token_ids=talker_to_code2wav({"codes.audio": frames}),
            payload={"codes": {"audio": frames}},
        ),
        drop_samples=window.left_context * int(frames.shape[1]) * hop,
    )
