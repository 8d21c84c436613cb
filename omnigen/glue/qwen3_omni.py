"""Qwen3-Omni (MoE): thinker -> talker -> code2wav.

Matches vllm-omni 0.30's ``stage_input_processors/qwen3_omni.py`` in full-payload mode:

* ``thinker2talker``: the payload of ``thinker2talker_full_payload`` and the prompt of
  ``thinker2talker_token_only`` (the talker stage's ``sync_process_input_func``);
* ``talker2code2wav``: the payload of ``talker2code2wav_full_payload``, and the prompt the
  code2wav stage runs: its scheduler replaces the request's prompt with the payload's flat codes
  (``OmniSchedulingCoordinator.update_request_metadata``, generation mode, from the payload's
  ``codes.audio``), and the model decodes its input ids as the codes
  (``qwen3_omni.py``, code2wav forward).

Both declare how long the next stage's prompt can be (``bounds_next_prompt``), so a request is
checked against the talker's and code2wav's contexts before the thinker runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .types import (
    GlueError,
    NextStageInput,
    StageResult,
    Window,
    WindowInput,
    bounds_next_prompt,
    counts_frames,
    finished_flag,
    first_tensor,
    owned_cpu,
    prompt_list_entry,
    voice_from_payload,
)

# Chat-template tokens of the thinker's vocabulary.
IM_START = 151644
SYSTEM = 8948
USER = 872
ASSISTANT = 77091
ASSISTANT_TALKER_PREFIX = 9
"""Talker positions for the reply's own turn: 3 + 4 + 1 + 1 (role, codec prefix, bos, pad)."""

CODEBOOK_SIZE = 2048
"""The talker's codec ids are in [0, 2048); 4196-4198 (pad, bos, eos) and the stop id are not."""

EMBEDDING_LAYER = 0
"""The thinker's word embeddings are captured layer 0."""

THINKER2TALKER = "omnigen.glue.qwen3_omni.thinker2talker"
TALKER2CODE2WAV = "omnigen.glue.qwen3_omni.talker2code2wav"
TALKER2CODE2WAV_WINDOW = "omnigen.glue.qwen3_omni.talker2code2wav_window"


def talker_prompt_length(prompt_token_ids: Sequence[int], all_token_ids: Sequence[int]) -> int:
    """How many positions the talker's prefill has for a thinker conversation.

    The talker sees every user turn whole and, for the reply (the last turn, when it is the
    assistant's), a fixed nine-position prefix; system turns are skipped. Turns are split at
    ``<|im_start|>`` in the prompt; the last one runs to the end of prompt + reply.
    """
    starts = [i for i, token in enumerate(prompt_token_ids) if token == IM_START]
    bounds = [*starts, len(all_token_ids)]
    length = 0
    for turn, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False)):
        role = prompt_token_ids[start + 1] if start + 1 < len(prompt_token_ids) else None
        if role == USER:
            length += end - start
        elif role == ASSISTANT and turn == len(starts) - 1:
            length += ASSISTANT_TALKER_PREFIX
    return length


def _accept_hidden_layer(source: StageResult, accept_hidden_layer: int | None) -> int:
    if accept_hidden_layer is not None:
        return int(accept_hidden_layer)
    talker_config = getattr(source.hf_config, "talker_config", None)
    layer = getattr(talker_config, "accept_hidden_layer", None)
    if layer is None:
        raise GlueError(
            THINKER2TALKER,
            source.request_id,
            "the thinker layer the talker reads is unknown: give StageResult.hf_config (the model's HF "
            "config, with talker_config.accept_hidden_layer) or accept_hidden_layer=",
        )
    return int(layer)


def _talker_prompt_bound(
    tokens: int, first_payload: Any, hf_config: Any, producer_prompt: Sequence[int] | None
) -> int | None:
    """The talker's longest prompt for a thinker that samples up to ``tokens`` tokens after
    ``producer_prompt``: ``talker_prompt_length``, which reads only where the prompt's turns
    start (the reply's ids count only when the prompt ends inside a user turn). None: the
    thinker's prompt ids are not known."""
    if producer_prompt is None:
        return None
    return talker_prompt_length(producer_prompt, [*producer_prompt, *([0] * tokens)])


@bounds_next_prompt(_talker_prompt_bound, reads_producer_prompt=True)
def thinker2talker(source: StageResult, *, accept_hidden_layer: int | None = None) -> NextStageInput:
    """The thinker's captured layers -> the talker's conditioning, and its placeholder prompt.

    * ``embed.prefill``: the thinker's word embeddings (layer 0, or ``hidden`` when layer 0
      was not captured); ``hidden_states.output``: the layer the talker accepts
      (``talker_config.accept_hidden_layer``). Both drop their last row when there is more
      than one: it belongs to the final sampled token, which the thinker never ran.
    * ``embed.tts_bos`` / ``tts_eos`` / ``tts_pad``: the thinker's TTS special embeddings.
    * ``ids.all`` (prompt + reply) and ``ids.prompt``: the talker re-derives its turns.
    * Speaker and language: the thinker request's own (normalized), else the caller's prompt's.
    * The prompt: placeholders, as many as ``talker_prompt_length`` positions.
    """
    layer = _accept_hidden_layer(source, accept_hidden_layer)
    embeddings = source.get(f"hidden_states.layer_{EMBEDDING_LAYER}")
    if not isinstance(embeddings, torch.Tensor):
        embeddings = source.get("hidden")
    accepted = source.get(f"hidden_states.layer_{layer}")
    if not isinstance(embeddings, torch.Tensor) or not isinstance(accepted, torch.Tensor):
        raise GlueError(
            THINKER2TALKER,
            source.request_id,
            f"missing thinker tensors: embeddings (hidden_states.layer_{EMBEDDING_LAYER} or hidden) "
            f"{'found' if isinstance(embeddings, torch.Tensor) else 'absent'}, hidden_states.layer_{layer} "
            f"{'found' if isinstance(accepted, torch.Tensor) else 'absent'}; payload keys "
            f"{sorted(source.payload)}",
        )
    embeddings = embeddings[:-1] if embeddings.shape[0] > 1 else embeddings
    accepted = accepted[:-1] if accepted.shape[0] > 1 else accepted
    all_ids = source.all_token_ids
    if all_ids and (embeddings.shape[0] == 0 or accepted.shape[0] == 0):
        raise GlueError(
            THINKER2TALKER,
            source.request_id,
            f"empty thinker conditioning for {len(all_ids)} token ids "
            f"(embedding rows {embeddings.shape[0]}, hidden rows {accepted.shape[0]})",
        )

    embed: dict[str, Any] = {"prefill": owned_cpu(embeddings)}
    for name in ("tts_bos", "tts_eos", "tts_pad"):
        tensor = first_tensor(source.get(f"embed.{name}"))
        if tensor is not None:
            embed[name] = tensor
    payload: dict[str, Any] = {
        "embed": embed,
        "hidden_states": {"output": owned_cpu(accepted)},
        "ids": {"all": list(all_ids), "prompt": list(source.prompt_token_ids)},
        "meta": {"finished": finished_flag()},
    }
    # The caller's prompt first, the request's own metadata over it (it is the later merge in
    # vllm-omni too: the connector payload lands after the request's own information).
    for key in ("speaker", "language"):
        value = voice_from_payload(source.input_payload, key)
        if value is None:
            value = prompt_list_entry(source.user_prompt, "additional_information", key)
        if value is not None:
            payload[key] = value
    length = talker_prompt_length(source.prompt_token_ids, all_ids)
    return NextStageInput(prompt_token_ids=[0] * length, payload=payload)


def codec_rows(codes: torch.Tensor, output_token_ids: Sequence[int]) -> torch.Tensor:
    """The talker's codec rows that belong to real codec tokens.

    Rows and output ids are aligned from the end (the runner also kept prefill rows); a row
    stays when its sampled id is a codec id (not the stop id, pad, bos or eos, nor an async
    ``-1`` placeholder) and all its codes are in the codebook.
    """
    if codes.ndim != 2 or codes.numel() == 0:
        return codes
    aligned = min(int(codes.shape[0]), len(output_token_ids))
    rows = codes[codes.shape[0] - aligned :]
    ids = list(output_token_ids)[len(output_token_ids) - aligned :]
    is_codec = torch.tensor([_is_codec_id(token) for token in ids], dtype=torch.bool, device=rows.device)
    in_codebook = (rows.min(dim=1).values >= 0) & (rows.max(dim=1).values < CODEBOOK_SIZE)
    return rows[is_codec & in_codebook] if aligned else rows[:0]


def _is_codec_id(token: Any) -> bool:
    try:
        return 0 <= int(token) < CODEBOOK_SIZE
    except (TypeError, ValueError):
        return False


DEFAULT_NUM_CODE_GROUPS = 16
"""Codebooks per frame when the config does not say (the released talker's num_code_groups)."""


def _codes_of_tokens(tokens: int, first_payload: Any, hf_config: Any) -> int:
    """code2wav's longest prompt for a talker budget: a frame of ``num_code_groups`` codes per
    sampled token (a run that ends without the stop id keeps every row)."""
    talker = getattr(hf_config, "talker_config", None)
    return int(getattr(talker, "num_code_groups", DEFAULT_NUM_CODE_GROUPS)) * tokens


@bounds_next_prompt(_codes_of_tokens)
def talker2code2wav(source: StageResult) -> NextStageInput:
    """The talker's codec rows -> code2wav's codes, codebook-major, as a list of ints.

    The prompt is those codes too: vllm-omni's code2wav scheduler replaces the request's prompt
    with the payload's ``codes.audio`` when the payload arrives, and the model decodes its input
    ids (``input_ids.reshape(16, -1)``), not the buffer.
    """
    codes = source.get("codes.audio")
    if codes is None:
        raise GlueError(TALKER2CODE2WAV, source.request_id, f"no codes.audio in {sorted(source.payload)}")
    if not isinstance(codes, torch.Tensor):
        codes = torch.as_tensor(codes)
    if codes.numel() == 0:
        raise GlueError(TALKER2CODE2WAV, source.request_id, "codes.audio is empty")
    rows = codec_rows(codes.to(torch.long), source.output_token_ids)
    if rows.numel() == 0:
        raise GlueError(
            TALKER2CODE2WAV,
            source.request_id,
            f"no codec row left of {tuple(codes.shape)} for {len(source.output_token_ids)} output ids",
        )
    flat = rows.transpose(0, 1).cpu().reshape(-1).tolist()
    payload = {"codes": {"audio": flat}, "meta": {"finished": finished_flag()}}
    return NextStageInput(prompt_token_ids=list(flat), payload=payload)


def _frames_so_far(source: StageResult) -> torch.Tensor:
    """The talker's codec frames so far, ``(frames, Q)``: ``codec_rows`` of the payload so far,
    which for a finished take are the rows ``talker2code2wav`` sends (rows and output ids align
    from the end at every step, so an unfinished take's frames are the first of its final ones)."""
    codes = source.get("codes.audio")
    if codes is None:
        return torch.zeros((0, DEFAULT_NUM_CODE_GROUPS), dtype=torch.long)
    codes = codes if isinstance(codes, torch.Tensor) else torch.as_tensor(codes)
    if codes.ndim != 2 or codes.numel() == 0:
        return torch.zeros((0, DEFAULT_NUM_CODE_GROUPS), dtype=torch.long)
    return codec_rows(codes.to(torch.long), source.output_token_ids)


def decoder_geometry(source: StageResult) -> tuple[int, int]:
    """code2wav's ``(samples per frame, right-edge loss)`` from ``code2wav_config``.

    The decoder is causal: each of its ``upsample_rates`` blocks is a transposed convolution of
    kernel ``2r``, stride ``r``, trimmed ``r`` on both sides, so ``L`` inputs give ``(L - 1) r``
    outputs, and ``T`` frames decode to ``T * total_upsample - tail`` samples, ``tail = sum over i
    of prod(upsample_rates[i:])`` (555 for the released 8, 5, 4, 3). vllm-omni's async-chunk
    decode (``chunked_decode_streaming``) keeps ``[left * total_upsample - tail, ...)`` of a window
    for the same reason: the left context's last ``tail`` samples refill the previous window's
    missing end (vllm-omni #4706, #4828: clicks when they were dropped).
    """
    config = getattr(source.hf_config, "code2wav_config", None)
    rates = getattr(config, "upsample_rates", None)
    ratios = getattr(config, "upsampling_ratios", None)
    if rates is None or ratios is None:
        raise GlueError(
            TALKER2CODE2WAV_WINDOW,
            source.request_id,
            "code2wav's samples per frame are unknown: give StageResult.hf_config (the model's HF config, "
            "with code2wav_config.upsample_rates and upsampling_ratios)",
        )
    total = 1
    for factor in [*rates, *ratios]:
        total *= int(factor)
    tail, product = 0, 1
    for rate in reversed([int(rate) for rate in rates]):
        product *= rate
        tail += product
    return total, tail


@counts_frames(lambda source: int(_frames_so_far(source).shape[0]))
def talker2code2wav_window(source: StageResult, window: Window) -> WindowInput:
    """One window of the talker's frames -> a code2wav request for it (the streaming form of
    ``talker2code2wav``; vllm-omni's ``talker2code2wav_async_chunk``, one window per request).

    * The codes: the window's frames and the ``left_context`` frames before it, codebook-major,
      as the prompt (code2wav decodes its input ids) and as ``codes.audio``.
    * ``meta.left_context_size``: vllm-omni's chunk metadata. The model reads it only under
      vllm-omni's ``async_chunk``, which plain vLLM never sets: it then decodes every code
      (``chunked_decode``) and trims nothing, so the driver drops ``left * total_upsample - tail``
      samples (``decoder_geometry``), what vllm-omni's async-chunk decode drops, and keeps the
      window's own ``frames * total_upsample`` (less ``tail`` for the first) after them.
    * ``meta.finished`` is true: each window is a whole code2wav request (vllm-omni's flag marks
      the last chunk of its one long-lived request).
    """
    frames = _frames_so_far(source)
    left = window.left_context
    if window.start < left or window.end > frames.shape[0]:
        raise GlueError(
            TALKER2CODE2WAV_WINDOW,
            source.request_id,
            f"window {window.index} needs frames [{window.start - left}, {window.end}), "
            f"the payload holds {int(frames.shape[0])}",
        )
    codes = frames[window.start - left : window.end].transpose(0, 1).to("cpu", torch.long).reshape(-1)
    upsample, tail = decoder_geometry(source)
    payload = {
        "codes": {"audio": codes},
        "meta": {"left_context_size": left, "finished": finished_flag()},
    }
    # Alone, a window decodes to (left + frames) * upsample - tail samples; batched with a longer
    # one it runs on into the zero padding: keep the window's own (the first one's end is short).
    own = (window.end - window.start) * upsample - (0 if left else tail)
    return WindowInput(
        request=NextStageInput(prompt_token_ids=codes.tolist(), payload=payload),
        drop_samples=max(left * upsample - tail, 0) if left else 0,
        keep_samples=own,
    )
