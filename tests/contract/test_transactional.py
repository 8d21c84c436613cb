"""A step's preprocessing is all or nothing (issue 9, item 5).

A per-row hook that raises, or returns what the row cannot take, on the third hooked row of a
step leaves every buffer, mirror, persistent input and MTP buffer as it was before the step, and
the error names the request. Before, the first rows' updates stayed merged, their runner keys
stamped, and short embeddings were written partially.
"""

from __future__ import annotations

import pytest
import torch

from omnigen_testing.contract_support import HOOK_VARIANTS, FakeModel, Step, ids, rig, rows_of, runner_state

FAULTS = ("raises", "short_embeds", "wide_embeds", "int_embeds", "ids_count", "update_type")
# Five rows the per-row hook takes one by one (prefills), with a decode row between them.
KINDS = ["prefill", "tail", "decode", "cached_prefill", "single_prompt", "prefill"]


class FaultyModel(FakeModel):
    """FakeModel whose per-row hook goes wrong on its third call."""

    fault = "raises"

    def preprocess(self, input_ids, input_embeds, **infos):
        calls = len(self.recorder.of("preprocess"))
        ids_out, embeds, update = super().preprocess(input_ids, input_embeds, **infos)
        if calls != 2:
            return ids_out, embeds, update
        if self.fault == "raises":
            raise RuntimeError("the model failed")
        if self.fault == "short_embeds":
            return ids_out, embeds[:-1], update
        if self.fault == "wide_embeds":
            return ids_out, torch.cat([embeds, embeds[:, :1]], dim=1), update
        if self.fault == "int_embeds":
            return ids_out, embeds.to(torch.int64), update
        if self.fault == "ids_count":
            return torch.cat([ids_out, ids_out]), embeds, update
        return ids_out, embeds, ["not", "a", "dict"]


@pytest.mark.parametrize("variant", HOOK_VARIANTS, ids=ids(HOOK_VARIANTS))
@pytest.mark.parametrize("fault", FAULTS)
def test_a_bad_row_leaves_the_whole_step_as_it_was(variant, fault, target, recorder, ctx, graph):
    graph.for_policy(variant.caps["mtp_graph"] or "unsafe")
    step = Step(rows_of(KINDS))
    r = rig(variant, step, recorder, ctx, target=target)
    r.runner.model.__class__ = FaultyModel
    r.runner.model.fault = fault
    buffers = {
        row.req_id: {"meta": {"tag": row.tag}, "codes": {"audio": torch.ones(1, 2)}} for row in step.rows[:2]
    }
    for req_id, buf in buffers.items():
        r.runner.model_intermediate_buffer[req_id] = buf
        r.runner.requests[req_id].additional_information_cpu = buf
    before = runner_state(r.runner)
    objects = {req_id: id(buf) for req_id, buf in r.runner.model_intermediate_buffer.items()}
    error = RuntimeError if fault == "raises" else ValueError
    with pytest.raises(error) as err:
        r.run_rows()
    assert len(recorder.of("preprocess")) == 3, "the fault came on the third hooked row"
    assert runner_state(r.runner) == before
    assert {k: id(v) for k, v in r.runner.model_intermediate_buffer.items()} == objects, (
        "buffers restored in place"
    )
    if fault != "raises":
        third = recorder.of("preprocess")[2]["req_id"]
        assert f"request {third}: model.preprocess returned" in str(err.value)


class ReplacingModel(FaultyModel):
    """A step hook that replaces the first row's buffer object in the map (and succeeds); the row
    hooks then merge into the new object (and set its mirror) until the third fails."""

    def preprocess_batch(self, req_ids, model_intermediate_buffer, device):
        super().preprocess_batch(req_ids, model_intermediate_buffer, device)
        model_intermediate_buffer[req_ids[0]] = {"meta": {"replaced": True}}


STEP_HOOKED = [v for v in HOOK_VARIANTS if v.facts["batch_hook"]]


@pytest.mark.parametrize("variant", STEP_HOOKED, ids=ids(STEP_HOOKED))
def test_a_replaced_buffer_and_its_mirror_are_put_back(variant, target, recorder, ctx, graph):
    graph.for_policy(variant.caps["mtp_graph"] or "unsafe")
    step = Step(rows_of(KINDS))
    r = rig(variant, step, recorder, ctx, target=target)
    r.runner.model.__class__ = ReplacingModel
    r.runner.model.fault = "raises"
    first = step.rows[0].req_id
    buffer = {"meta": {"tag": "kept"}}
    r.runner.model_intermediate_buffer[first] = buffer
    r.runner.requests[first].additional_information_cpu = buffer
    before = runner_state(r.runner)
    with pytest.raises(RuntimeError, match="the model failed"):
        r.run_rows()
    assert r.runner.model_intermediate_buffer[first] is buffer
    assert r.runner.requests[first].additional_information_cpu is buffer
    assert runner_state(r.runner) == before


def test_the_journal_puts_back_every_dict_a_step_can_write_into():
    """Every buffer (an empty one too) and every dict inside one, dict subclasses included, is
    restored in place; a buffer made during the step is dropped again."""
    import collections
    import copy
    from types import SimpleNamespace

    from omnigen.runtime import phases

    sub = collections.OrderedDict(a=1)
    counts = collections.defaultdict(int, b=2)
    buffers = {
        "full": {"request_id": "full", "meta": {"tag": 1}, "ordered": sub, "counts": counts, "n": 3},
        "empty": {},
    }
    requests = {req_id: SimpleNamespace(additional_information_cpu=buf) for req_id, buf in buffers.items()}
    requests["new"] = SimpleNamespace()
    runner = SimpleNamespace(model_intermediate_buffer=buffers, requests=requests, _talker_mtp_generators={})
    before = copy.deepcopy(buffers)
    objects = {req_id: id(buf) for req_id, buf in buffers.items()}
    ids = torch.arange(3)
    journal = phases.StepJournal(runner, ["full", "empty", "new"], ids)

    full = buffers["full"]
    full["meta"]["tag"] = 2
    sub["a"] = 9
    sub["z"] = 0
    counts["c"] += 1
    full["n"] = 4
    buffers["empty"]["request_id"] = "empty"
    buffers["new"] = {"request_id": "new"}
    requests["new"].additional_information_cpu = buffers["new"]
    ids.fill_(7)
    journal.undo()

    assert buffers == before
    assert {req_id: id(buf) for req_id, buf in buffers.items()} == objects
    assert buffers["full"]["ordered"] is sub and list(sub.items()) == [("a", 1)]
    assert buffers["full"]["counts"] is counts and dict(counts) == {"b": 2}
    assert not hasattr(requests["new"], "additional_information_cpu")
    assert ids.tolist() == [0, 1, 2]
