"""A request against the whole pipeline's limits, before any stage runs (``omnigen.serving.limits``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omnigen.requests.base import BuiltRequest, RequestError
from omnigen.serving.limits import StageLimits, check_request


def _pipeline(code2wav_room: int = 127):
    talker = StageLimits("talker", False, vocab_size=512, max_model_len=128, max_prompt_tokens=127)
    code2wav = StageLimits(
        "code2wav",
        True,
        vocab_size=None,
        max_model_len=128,
        max_prompt_tokens=code2wav_room,
        prompt_bound=lambda tokens, payload, hf_config: 4 * tokens + payload.get("extra", 0),
        min_producer_tokens=2,
    )
    stages = [SimpleNamespace(hf_config=None), SimpleNamespace(hf_config=None)]
    return [talker, code2wav], stages


def _check(ids, max_tokens, payload=None, room=127):
    limits, stages = _pipeline(room)
    built = BuiltRequest(prompt={"prompt_token_ids": ids}, payload=payload or {})
    check_request(limits, stages, built, {"talker": SimpleNamespace(max_tokens=max_tokens), "code2wav": None})


def test_a_request_that_fits_every_stage_passes():
    _check([1, 2, 3], 31)


@pytest.mark.parametrize(
    ("ids", "max_tokens", "payload", "says"),
    [
        ([], 5, None, "prompt_token_ids: empty"),
        ([512], 5, None, "prompt_token_ids[0]: 512 is not a token id of stage 'talker' (allowed: 0..511)"),
        ([3, True], 5, None, "prompt_token_ids[1]: True is not a token id"),
        ([1] * 128, 5, None, "input: the prompt is 128 tokens; stage 'talker' takes at most 127"),
        ([1], 32, None, "send max_tokens of at most 31"),
        ([1], 30, {"extra": 10}, "send max_tokens of at most 29"),  # the payload widens the bound
        ([1], 1, None, "max_tokens: stage 'talker' needs at least 2 tokens"),
        ([1] * 127, 5, None, "input: the prompt leaves stage 'talker' room for 1 of the 2 tokens"),
    ],
)
def test_a_request_some_stage_cannot_take_is_refused_naming_the_field(ids, max_tokens, payload, says):
    with pytest.raises(RequestError) as info:
        _check(ids, max_tokens, payload)
    assert says in str(info.value)


def test_the_context_caps_the_budget_before_the_next_stage_is_checked():
    # 100 prompt tokens leave the talker 28 tokens of its 128, whatever max_tokens asks: 112 codes fit.
    _check([1] * 100, 1000)
