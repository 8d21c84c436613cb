"""``step_outputs``: what each request gets of a step's payload (CONTRACT 7.2, 7.3), where
``scripts/mutation`` found the suite silent (issue 37, docs/mutation.md).

An autoregressive step cuts a tensor to a request's rows when its first dimension is the step's
token count or the (padded) hidden states' row count, also with no hidden states and inside a
nested dict entry; a step-wide tensor, a 0-d one and a short list's first entry go to every
request as its own host copy. A generation step's dict gives every request its step-wide tensors
and plain values. Every published tensor is a host copy, and a wrong output count names the fix.
The existing cases are in ``test_real_model_clauses.py`` (7.2, 7.3).
"""

from __future__ import annotations

import pytest
import torch

from omnigen.runtime import step_outputs
from omnigen_testing.contract_support import DeviceTensor, on_device

from .test_real_model_clauses import H, _step


def _plain(value: object) -> bool:
    """A host tensor: ``DeviceTensor`` says ``cuda:0`` until moved to the CPU."""
    return type(value) is torch.Tensor and value.device.type == "cpu"


def test_an_ar_step_without_hidden_states_still_cuts_its_per_token_tensors():
    """1-D per-token tensors (token ids) are per token too; a stage with no text hidden states
    cuts by the step's token count alone."""
    step = _step(None, {"ids": torch.arange(5), "codes": torch.arange(10).reshape(5, 2)}, bounds=(0, 4, 5))
    a, b = (step_outputs.ar_request_payloads(step, include_hidden=True)[r] for r in "ab")
    assert torch.equal(a["ids"], torch.arange(4)) and torch.equal(b["ids"], torch.tensor([4]))
    assert torch.equal(a["codes"], torch.arange(8).reshape(4, 2))
    assert torch.equal(b["codes"], torch.tensor([[8, 9]]))
    assert "hidden" not in a


def test_a_payload_tensor_padded_like_the_hidden_states_is_cut_to_each_requests_rows():
    """The forward's outputs have the padded token count (CUDA graph sizes): a payload tensor of
    the hidden states' row count is per token, its padding rows belong to no request."""
    hidden = torch.arange(8 * H, dtype=torch.float32).reshape(8, H)  # 5 tokens, padded to 8
    padded = torch.arange(8) * 10
    step = _step(hidden, {"logits": padded}, bounds=(0, 4, 5))
    a, b = (step_outputs.ar_request_payloads(step, include_hidden=True)[r] for r in "ab")
    assert torch.equal(a["logits"], padded[:4]) and torch.equal(b["logits"], padded[4:5])
    assert torch.equal(a["hidden"], hidden[:4]) and torch.equal(b["hidden"], hidden[4:5])


def test_a_step_wide_tensor_goes_whole_to_every_request():
    """A tensor that is not per token (of another length, or 0-d) is the whole step's."""
    shared, scalar = torch.tensor([7, 8, 9]), torch.tensor(2.5)
    step = _step(None, {"shared": shared, "scale": scalar}, bounds=(0, 4, 5))
    payloads = step_outputs.ar_request_payloads(step, include_hidden=False)
    for req_id in "ab":
        assert torch.equal(payloads[req_id]["shared"], shared)
        assert torch.equal(payloads[req_id]["scale"], scalar)
    assert payloads["a"]["shared"] is not payloads["b"]["shared"]


def test_a_nested_dict_entry_is_shared_out_like_a_top_level_one():
    """``flatten_payload`` flattens one level: a deeper dict is published as a dict, each of its
    entries cut, split or shared by the same rules, and moved to the host."""
    tokens = torch.arange(10).reshape(5, 2)
    step = _step(
        None,
        {
            "codes": {
                "extra": {
                    "tokens": on_device(tokens),
                    "per_request": [torch.tensor([1]), torch.tensor([2])],
                    "shared": torch.tensor([7, 8, 9]),
                }
            }
        },
        bounds=(0, 4, 5),
    )
    a, b = (step_outputs.ar_request_payloads(step, include_hidden=False)[r]["codes.extra"] for r in "ab")
    assert torch.equal(a["tokens"], tokens[:4]) and torch.equal(b["tokens"], tokens[4:])
    assert _plain(a["tokens"]) and _plain(b["tokens"])
    assert a["per_request"].tolist() == [1] and b["per_request"].tolist() == [2]
    assert torch.equal(a["shared"], b["shared"]) and a["shared"].tolist() == [7, 8, 9]


def test_a_list_shorter_than_the_batch_shares_its_first_entry_as_each_requests_host_copy():
    first = on_device(torch.tensor([5.0]))
    step = _step(None, {"speaker": [first]}, bounds=(0, 4, 5))
    payloads = step_outputs.ar_request_payloads(step, include_hidden=False)
    a, b = payloads["a"]["speaker"], payloads["b"]["speaker"]
    assert a.tolist() == b.tolist() == [5.0]
    assert _plain(a) and _plain(b), "a GPU tensor in a list is published on the host"
    assert a is not b and a is not first and b is not first


def test_every_published_tensor_is_a_host_copy():
    """7.2 and 7.3: the rows ride on ``ModelRunnerOutput`` to the scheduler: host tensors."""
    hidden = on_device(torch.randn(5, H))
    step = _step(hidden, {"codes": on_device(torch.arange(5))}, bounds=(0, 4, 5))
    for payload in step_outputs.ar_request_payloads(step, include_hidden=True).values():
        assert _plain(payload["hidden"]) and _plain(payload["codes"])
    for raw in (on_device(torch.ones(2, 3)), [on_device(torch.ones(2)), on_device(torch.ones(3))]):
        for payload in step_outputs.generation_request_payloads(_step(None, raw)).values():
            assert _plain(payload["model_outputs"])
    assert isinstance(hidden, DeviceTensor), "the producer's tensor is left as it was"


def test_a_generation_dict_gives_every_request_its_step_wide_tensors_and_values():
    """7.3 as vllm-omni's generation runner: a list is one entry per request, a tensor is the
    whole step's (on the host), and a plain value (a sample rate) is every request's."""
    ref = on_device(torch.tensor([1.0, 2.0, 3.0]))
    wavs = [torch.ones(6), torch.zeros(4)]
    raw = {"model_outputs": wavs, "ref": ref, "sr": 24000, "codes": {"audio": [torch.ones(1), torch.ones(2)]}}
    payloads = step_outputs.generation_request_payloads(_step(None, raw))
    for row, req_id in enumerate("ab"):
        payload = payloads[req_id]
        assert torch.equal(payload["model_outputs"], wavs[row])
        assert payload["ref"].tolist() == [1.0, 2.0, 3.0] and _plain(payload["ref"])
        assert payload["sr"] == 24000
        assert payload["codes.audio"].shape == (row + 1,)


def test_a_generation_output_count_mismatch_names_the_fix():
    """The error tells the model author what to return instead."""
    fix = r"the model must return one entry per request \(for several tensors per request, return a dict\)$"
    with pytest.raises(ValueError, match=fix):
        step_outputs.generation_request_payloads(_step(None, torch.ones(3, 2)))
    with pytest.raises(ValueError, match=fix):
        step_outputs.generation_request_payloads(_step(None, {"wav": [torch.ones(1)]}))
