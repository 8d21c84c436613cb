"""StageResult's payload lookup and the small helpers the glue functions share."""

from __future__ import annotations

import pytest
import torch

from omnigen.glue import GlueError, StageResult
from omnigen.glue.types import flat_payload, voice_from_payload


def test_flat_payload_reads_dotted_and_nested_keys():
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    flat = flat_payload(
        {"codes.audio": a, "meta": {"finished": True}, "hidden_states": {"layers": {0: b}}, "hidden": c}
    )
    assert flat == {"codes.audio": a, "meta.finished": True, "hidden_states.layer_0": b, "hidden": c}


def test_a_dotted_key_wins_over_its_nested_spelling():
    dotted, nested = torch.zeros(1), torch.ones(1)
    source = StageResult(
        "r", [], [], payload={"codes.audio": dotted, "codes": {"audio": nested, "ref": nested}}
    )
    assert source.get("codes.audio") is dotted
    assert source.get("codes.ref") is nested
    assert source.get("codes.missing", "default") == "default"


def test_a_nested_value_fills_a_dotted_none():
    value = torch.ones(1)
    assert (
        StageResult("r", [], [], payload={"codes.audio": None, "codes": {"audio": value}}).get("codes.audio")
        is value
    )


def test_all_token_ids():
    assert StageResult("r", [1, 2], [3]).all_token_ids == [1, 2, 3]


def test_voice_normalization():
    assert voice_from_payload({"speaker": [" Vivian "]}, "speaker") == "vivian"
    assert voice_from_payload({"speaker": "Ryan"}, "speaker") == "ryan"
    assert voice_from_payload({"language": ["English"]}, "language") == ["English"]
    assert voice_from_payload({"language": "English"}, "language") == ["English"]
    assert voice_from_payload({"speaker": []}, "speaker") is None
    assert voice_from_payload({}, "speaker") is None


def test_glue_error_names_function_and_request():
    error = GlueError("omnigen.glue.x.y", "req-7", "nothing to send")
    assert str(error) == "omnigen.glue.x.y: request 'req-7': nothing to send"
    assert isinstance(error, ValueError)
    with pytest.raises(GlueError):
        raise error
