"""``phases``: what a bad hook result's message says and which slices a row gets (CONTRACT 3.3,
3.5), where ``scripts/mutation`` found the suite silent (issue 37, docs/mutation.md).

A decode batch's ids that are no tensor are described as what they are, each problem its own
clause. A talker-MTP row's message names what is wrong and only that: good MTP inputs (taken
out of the update by the generated row loop and handed back) are not reported missing, a plain
row's message never speaks of MTP inputs, and an MTP row's bad ids are not told they may be
None. A one-row step whose row ends the step but starts after token 0 gets its own tokens, not
the step's. An inference tensor is its own inference alias. The existing cases are in
``test_hook_faults.py``, ``test_preprocess_property.py`` and ``test_step_views.py``.
"""

from __future__ import annotations

import pytest
import torch

from omnigen.runtime import phases

from .test_step_views import _rows, _same_view

WIDTH = 4
MTP_WIDTH = 3


def _clauses(message: str) -> list[str]:
    """The problems a message lists after ``returned``."""
    return message.split(" returned ", 1)[1].split("; ")


def _batch_error(out: tuple, req_ids: list[str]) -> str:
    with pytest.raises(ValueError) as err:
        phases.batch_output(req_ids, out, WIDTH)
    return str(err.value)


def test_a_batch_results_ids_that_are_no_tensor_are_described_as_what_they_are():
    """The hook returned a list of ids: the message says so, and not that it returned None."""
    req_ids = ["a", "b"]
    message = _batch_error(([1, 2], torch.zeros(2, WIDTH), [None, None]), req_ids)
    assert "no (list) ids" in message
    assert "ids of type list, expected a tensor" in message
    assert "NoneType" not in message


def test_a_bad_batch_result_lists_each_problem_as_its_own_clause():
    req_ids = ["a", "b"]
    out = (torch.zeros(2), torch.zeros(2, WIDTH, dtype=torch.int64), [None, "meta"])
    clauses = _clauses(_batch_error(out, req_ids))
    assert len(clauses) == 3
    assert clauses[0].startswith("ids of dtype torch.float32")
    assert clauses[1].startswith("embeddings of dtype torch.int64")
    assert clauses[2].startswith("request b's update is a str")


def _mtp_pair() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(MTP_WIDTH), torch.randn(MTP_WIDTH)


@pytest.mark.parametrize(
    ("ids", "embeds", "named"),
    [
        (torch.tensor([5]), torch.zeros(1, WIDTH + 1), "embeddings (1, 5) torch.float32"),
        (torch.tensor([5.0]), torch.zeros(1, WIDTH), "1 ids of dtype torch.float32"),
        (torch.tensor([5, 6]), torch.zeros(1, WIDTH), "2 ids of dtype torch.int64"),
    ],
    ids=["wide embeddings", "float ids", "two ids"],
)
def test_a_talker_mtp_rows_good_mtp_inputs_are_not_reported_missing(ids, embeds, named):
    """The generated row loop took the MTP inputs out of the update before it found another
    problem; the message names that problem and not the MTP inputs it hands back."""
    out = (ids, embeds, {"meta": {}})
    message = phases.mtp_row_problems("r1", out, _mtp_pair(), WIDTH, MTP_WIDTH)
    assert named in message
    assert "mtp_inputs" not in message
    assert len(_clauses(message)) == 1


@pytest.mark.parametrize(
    "pair",
    [
        phases.ABSENT,
        (torch.randn(MTP_WIDTH + 1), torch.randn(MTP_WIDTH)),
        (torch.randn(MTP_WIDTH), torch.randn(MTP_WIDTH + 1)),
        (torch.randn(MTP_WIDTH), torch.randn(MTP_WIDTH).to(torch.int64)),
        (torch.randn(MTP_WIDTH),) * 3,
    ],
    ids=["missing", "wide last_hidden", "wide text_step", "integer text_step", "three vectors"],
)
def test_a_talker_mtp_rows_bad_mtp_inputs_are_named(pair):
    out = (torch.tensor([5]), torch.zeros(1, WIDTH), {})
    message = phases.mtp_row_problems("r1", out, pair, WIDTH, MTP_WIDTH)
    assert f"no update['mtp_inputs'] of two {MTP_WIDTH}-wide floating-point" in message


def test_a_talker_mtp_rows_bad_ids_are_not_told_they_may_be_none():
    """None ids are refused on a talker-MTP row (its ids feed the MTP): the hint must not offer them."""
    out = (torch.tensor([5.0]), torch.zeros(1, WIDTH), {})
    message = phases.mtp_row_problems("r1", out, _mtp_pair(), WIDTH, MTP_WIDTH)
    assert "a talker-MTP row's ids feed the MTP" in message
    assert "None" not in message


def test_a_plain_rows_message_says_nothing_of_mtp_inputs():
    with pytest.raises(ValueError) as err:
        phases.row_output("r1", (torch.tensor([5, 6]), torch.zeros(2, WIDTH + 1), None), 2, WIDTH)
    message = str(err.value)
    assert "embeddings (2, 5) torch.float32" in message
    assert "mtp" not in message.lower()
    assert len(_clauses(message)) == 1


@pytest.mark.parametrize("start", [1, 3])
def test_a_single_row_that_ends_the_step_after_token_0_gets_only_its_own_tokens(start):
    ids = torch.arange(12, dtype=torch.int32)
    embeds = torch.randn(12, WIDTH)
    id_rows, embed_rows = phases.row_slices(_rows([(start, 12)]), ids, embeds)
    assert len(id_rows) == len(embed_rows) == 1
    assert _same_view(id_rows[0], ids[start:])
    assert _same_view(embed_rows[0], embeds[start:])


def test_an_inference_tensor_is_its_own_inference_alias():
    with torch.inference_mode():
        tensor = torch.zeros(3, WIDTH)
        assert phases.inference_alias(tensor) is tensor
    ordinary = torch.zeros(3, WIDTH)
    with torch.inference_mode():
        alias = phases.inference_alias(ordinary)
        assert alias.is_inference() and _same_view(alias, ordinary)
        alias.fill_(2.0)
    assert bool((ordinary == 2.0).all())
