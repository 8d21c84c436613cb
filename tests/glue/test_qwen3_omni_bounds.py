"""Qwen3-Omni's glue declares how long the talker's and code2wav's prompts can be, so a request is
checked against their contexts before the thinker runs (``omnigen.serving.limits``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omnigen.glue import qwen3_omni
from omnigen.glue.types import StageResult, min_producer_tokens, next_prompt_bound, reads_producer_prompt
from omnigen.requests.base import BuiltRequest, RequestError
from omnigen.serving.limits import StageLimits, check_request

IM, USER, ASSISTANT, SYSTEM = qwen3_omni.IM_START, qwen3_omni.USER, qwen3_omni.ASSISTANT, qwen3_omni.SYSTEM
CHAT = [IM, SYSTEM, 5, 6, IM, USER, 7, 8, 9, IM, ASSISTANT, 10]  # system 4, user 5, the reply's turn 3


def test_the_talker_bound_is_the_talker_prompt_length():
    bound = next_prompt_bound(qwen3_omni.thinker2talker)
    assert reads_producer_prompt(qwen3_omni.thinker2talker)
    # The user turn and the reply's nine positions; the thinker's tokens never reach the talker.
    for tokens in (1, 50, 4000):
        assert (
            bound(tokens, {}, None, CHAT)
            == 5 + 9
            == qwen3_omni.talker_prompt_length(CHAT, CHAT + [0] * tokens)
        )
    # A prompt that ends inside a user turn: the reply's tokens join that turn.
    open_turn = [IM, USER, 7, 8]
    assert bound(6, {}, None, open_turn) == 4 + 6
    assert bound(6, {}, None, None) is None  # the thinker's prompt ids are not known


def test_the_code2wav_bound_is_a_frame_of_codes_per_talker_token():
    bound = next_prompt_bound(qwen3_omni.talker2code2wav)
    assert not reads_producer_prompt(qwen3_omni.talker2code2wav)
    config = SimpleNamespace(talker_config=SimpleNamespace(num_code_groups=16))
    assert bound(10, {}, config) == 160
    assert bound(10, {}, SimpleNamespace(talker_config=SimpleNamespace(num_code_groups=4))) == 40
    assert bound(10, {}, None) == 160  # the released num_code_groups
    assert min_producer_tokens(qwen3_omni.talker2code2wav) == 1


def test_the_bound_holds_for_what_the_glue_makes():
    codes = torch.randint(0, 2048, (12, 16))
    source = StageResult(
        request_id="r",
        prompt_token_ids=[0] * 14,
        output_token_ids=[5] * 11 + [2150],
        payload={"codes.audio": codes},
    )
    made = qwen3_omni.talker2code2wav(source)
    bound = next_prompt_bound(qwen3_omni.talker2code2wav)(12, {}, None)
    assert len(made.prompt_token_ids) == 11 * 16 <= bound
    # code2wav decodes its prompt as the codes: they are the prompt.
    assert made.prompt_token_ids == made.payload["codes"]["audio"]


def _limits(talker_room: int, code2wav_room: int):
    return [
        StageLimits("thinker", False, 152064, 512, 511),
        StageLimits(
            "talker",
            False,
            3072,
            512,
            talker_room,
            prompt_bound=next_prompt_bound(qwen3_omni.thinker2talker),
            bound_reads_producer_prompt=True,
        ),
        StageLimits(
            "code2wav",
            True,
            None,
            4096,
            code2wav_room,
            prompt_bound=next_prompt_bound(qwen3_omni.talker2code2wav),
        ),
    ]


def _check(talker_room: int, code2wav_room: int, talker_tokens: int, thinker_tokens: int = 8):
    config = SimpleNamespace(talker_config=SimpleNamespace(num_code_groups=16))
    stages = [SimpleNamespace(hf_config=config) for _ in range(3)]
    sampling = {
        "thinker": SimpleNamespace(max_tokens=thinker_tokens),
        "talker": SimpleNamespace(max_tokens=talker_tokens),
        "code2wav": None,
    }
    built = BuiltRequest(prompt={"prompt_token_ids": CHAT})
    check_request(_limits(talker_room, code2wav_room), stages, built, sampling, prompt_field="messages")


def test_check_request_through_the_three_stages():
    _check(talker_room=14, code2wav_room=16 * 100, talker_tokens=100)
    with pytest.raises(RequestError) as info:
        _check(talker_room=13, code2wav_room=16 * 100, talker_tokens=100)
    assert str(info.value) == (
        "messages: the request becomes at least 14 prompt tokens of stage 'talker', which takes at most 13 whatever max_tokens says; shorten it"
    )
    with pytest.raises(RequestError) as info:
        _check(talker_room=511, code2wav_room=16 * 100, talker_tokens=101)
    assert (
        "stage 'talker' may write 101 tokens, which become up to 1616 prompt tokens of stage 'code2wav'"
        in str(info.value)
    )
    assert "send max_tokens of at most 100" in str(info.value)
