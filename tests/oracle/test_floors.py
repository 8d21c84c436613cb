"""benchmarks/floors.py: each floor does the per-request work of its clause, as the generated
runner does it, so the sum of a cell's floors is a bound on what the contract costs (a floor that
skipped work would make a target look reachable)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from benchmarks import floors
from omnigen.runtime import buffers, mtp

pytestmark = pytest.mark.oracle

BATCH = 16
RUNNER_KEYS = ("request_id", "_omni_prompt_len", "_omni_num_computed_tokens", "_omni_is_prefill")


CELLS = sorted(floors.CELL_FLOORS)
MTP_CELLS = [cell for cell in CELLS if "code_rows" in floors.CELL_FLOORS[cell]]
PER_ROW_CELLS = [cell for cell in CELLS if "row_hook_calls" in floors.CELL_FLOORS[cell]]


@functools.cache
def _steady(cell: str) -> tuple[floors.Step, dict]:
    """A cell's steady step (made once: it drives a runner) and a copy of its buffers."""
    step = floors.steady_step(cell, BATCH)
    return step, copy.deepcopy({req_id: step.buffers[req_id] for req_id in step.req_ids})


@pytest.fixture
def step(request):
    """The cell's steady step, its buffers and mirrors put back as they were after each test."""
    step, saved = _steady(request.param)
    yield step
    for req_id, contents in saved.items():
        buffer = step.buffers[req_id]
        buffer.clear()
        buffer.update(copy.deepcopy(contents))
        step.requests[req_id].additional_information_cpu = buffer


every_cell = pytest.mark.parametrize("step", CELLS, indirect=True)


def _blank(step) -> None:
    """Take out of the step's buffers (and mirrors) what the floors write: the runner keys, each
    update's values, the codes. (A steady step already holds equal values: a floor that wrote
    nothing would otherwise pass.)"""
    for req_id, update in zip(step.req_ids, step.updates, strict=True):
        buffer = step.buffers[req_id]
        for key in RUNNER_KEYS:
            del buffer[key]
        for key, value in update.items():
            for qualifier in value:
                buffer[key].pop(qualifier, None)
        if step.codes is not None:
            buffer["codes"].pop("audio", None)
        step.requests[req_id].additional_information_cpu = None


def _check_stored(step, expected: dict) -> None:
    """Each buffer holds the runner's values for the step's updates (owned copies where
    GPU-resident), its own codes row, and is its request's mirror."""
    for row, (req_id, update) in enumerate(zip(step.req_ids, step.updates, strict=True)):
        buffer = step.buffers[req_id]
        assert step.requests[req_id].additional_information_cpu is buffer
        for key, value in update.items():
            for qualifier, item in value.items():
                stored = buffer[key][qualifier]
                assert torch.equal(stored, expected[req_id][key][qualifier])
                if (key, qualifier) in step.gpu_keys:
                    assert stored.data_ptr() != item.data_ptr(), "a GPU-resident value is an owned copy"
        if step.codes is not None:
            stored = buffer["codes"]["audio"]
            assert torch.equal(stored, step.codes[row : row + 1])
            assert stored.untyped_storage().data_ptr() != step.codes.untyped_storage().data_ptr()


@every_cell
def test_runner_keys_are_the_runners(step):
    expected = {req_id: {k: step.buffers[req_id][k] for k in RUNNER_KEYS} for req_id in step.req_ids}
    _blank(step)
    floors.runner_keys(step)
    assert {req_id: {k: step.buffers[req_id][k] for k in RUNNER_KEYS} for req_id in step.req_ids} == expected


@every_cell
def test_journal_keeps_every_dict_it_would_restore(step):
    saved = floors.journal(step)
    nested = sum(1 for r in step.req_ids for v in step.buffers[r].values() if isinstance(v, dict))
    assert len(saved) == len(step.req_ids) + nested
    for original, kept in saved:
        assert kept == original and kept is not original


def _merged_by_the_runner(step) -> dict:
    """The buffers after the runner's own merge of the step's updates (4.1)."""

    class Runner:
        requests = step.requests
        model_intermediate_buffer = copy.deepcopy(step.buffers)
        GPU_RESIDENT_KEYS = step.gpu_keys

    runner = Runner()
    rows = [runner.model_intermediate_buffer[req_id] for req_id in step.req_ids]
    requests = [runner.requests[req_id] for req_id in step.req_ids]
    deferred: buffers.DeferredCopies = {}
    buffers.merge_updates(rows, requests, step.updates, runner.GPU_RESIDENT_KEYS, deferred)
    buffers.store_owned_copies(deferred)
    return runner.model_intermediate_buffer


@every_cell
def test_merges_and_owned_copies_store_what_the_runner_stores(step):
    expected = _merged_by_the_runner(step)
    _blank(step)
    floors.merges(step)
    floors.owned_copies_batched(step)
    if step.codes is not None:
        floors.code_rows(step)
    _check_stored(step, expected)


@pytest.mark.parametrize("step", MTP_CELLS, indirect=True)
def test_code_rows_are_owned_rows_of_the_codes(step):
    _blank(step)
    floors.code_rows(step)
    for row, req_id in enumerate(step.req_ids):
        stored = step.buffers[req_id]["codes"]["audio"]
        assert torch.equal(stored, step.codes[row : row + 1])
        assert stored.untyped_storage().data_ptr() != step.codes.untyped_storage().data_ptr()


@every_cell
def test_generators_are_the_runners(step):
    expected = mtp.row_generators(dict(step.generators), step.requests, step.req_ids, torch.device("cpu"))
    found = floors.generators(step)
    assert [g is None for g in found] == [g is None for g in expected]


@every_cell
def test_hook_calls_call_the_hook_once_per_row_or_batch(step):
    name = "row_hook_calls" if step.row_results else "hook_calls"
    calls = []
    hook = "preprocess" if step.row_results else "preprocess_decode_batch"
    original = getattr(step.model, hook)
    setattr(step.model, hook, lambda *a, **k: calls.append(k) or original(*a, **k))
    step.recorder.calls.clear()
    try:
        with step.recorder.recording():
            floors.FLOORS[name][1](step)
    finally:
        setattr(step.model, hook, original)
    # The hook's calls are recorded, so that their own time is measured (replayed) and left out.
    assert len(step.recorder.calls) == len(calls) > 0
    if step.row_results:
        assert [k["request_id"] for k in calls] == step.req_ids
        assert all(k["input_ids"].shape == (1,) and k["input_embeds"].shape == (1, step.width) for k in calls)
    else:
        assert len(calls) == 1 and len(calls[0]["req_infos"]) == len(step.req_ids)


@pytest.mark.parametrize("step", PER_ROW_CELLS, indirect=True)
def test_row_checks_refuse_a_row_of_the_wrong_width(step):
    floors.row_checks(step)
    ids, embeds, update = step.row_results[3]
    step.row_results[3] = (ids, embeds[:, :-1], update)
    try:
        with pytest.raises(ValueError):
            floors.row_checks(step)
    finally:
        step.row_results[3] = (ids, embeds, update)


@pytest.mark.parametrize("step", PER_ROW_CELLS, indirect=True)
def test_mtp_gather_joins_one_row_per_request(step):
    ids, embeds, hidden, text = floors.mtp_gather(step)
    assert ids.shape == (BATCH,) and embeds.shape == hidden.shape == text.shape == (BATCH, step.width)


def test_verdict_says_out_of_reach_only_past_the_limit():
    assert floors.verdict(2.0, 1.5).startswith("out of reach")
    assert floors.verdict(1.5, 1.5).startswith("within reach")


@every_cell
def test_omnigen_code_is_compared_with_the_floors_of_the_same_work(step):
    compared = floors.omnigen_code_for(step.cell)
    paid = floors.CELL_FLOORS[step.cell]
    for names, code in compared.values():
        assert set(names) <= set(paid)
        code(step)  # the runtime's own functions, called as the generated runner calls them
    covered = {name for names, _ in compared.values() for name in names}
    # What has no omnigen counterpart to time alone: the hook calls (the same calls on both sides),
    # and a talker-MTP row's checks (written into the generated row loop, not a function).
    assert set(paid) - covered <= {"hook_calls", "row_hook_calls", "row_checks"}


@every_cell
def test_whole_step_stores_what_the_runner_and_the_floors_store(step):
    expected = _merged_by_the_runner(step)
    stamped = {req_id: {k: step.buffers[req_id][k] for k in RUNNER_KEYS} for req_id in step.req_ids}
    _blank(step)
    floors.whole_step(step)
    _check_stored(step, expected)
    assert {r: {k: step.buffers[r][k] for k in RUNNER_KEYS} for r in step.req_ids} == stamped


@pytest.mark.parametrize("step", MTP_CELLS, indirect=True)
def test_hook_recorder_records_every_hook_and_predictor_call_then_puts_the_model_back(step):
    """What the benchmarks leave out as hook time is the replay of exactly the calls a step made,
    and once recording ends the runner calls the model's own hooks again, unwrapped."""
    model, runner = step.model, step.runner
    before = {
        name: model.__dict__.get(name) for name in ("preprocess", "preprocess_decode_batch", "talker_mtp")
    }
    runner_predictor = runner.talker_mtp
    recorder = step.recorder
    recorder.calls.clear()
    name = "row_hook_calls" if step.row_results else "hook_calls"
    with recorder.recording():
        floors.FLOORS[name][1](step)
        runner.talker_mtp(*mtp.leading_rows(runner, len(step.req_ids)))
    hook_calls = len(step.req_ids) if step.row_results else 1
    assert len(recorder.calls) == hook_calls + 1
    assert recorder.calls[-1][0] is runner_predictor
    assert recorder.calls[-1][1][0].shape[0] == len(step.req_ids)
    assert {name: model.__dict__.get(name) for name in before} == before
    assert runner.talker_mtp is runner_predictor
    replayed = []
    recorder.calls[:] = [
        (lambda *a, **k: replayed.append((a, k)), args, kwargs) for _, args, kwargs in recorder.calls
    ]
    assert recorder.replay_seconds(3) >= 0
    assert replayed == [(args, kwargs) for _, args, kwargs in recorder.calls] * 3


@every_cell
def test_a_floor_is_timed_with_the_hooks_returning_at_once_then_put_back(step):
    """A floor's time is its own (positive, however cheap: nothing is subtracted), and the model's
    hooks are its own again afterwards."""
    model = step.model
    names = ("preprocess", "preprocess_decode_batch", "talker_mtp")
    before = {name: model.__dict__.get(name) for name in names}
    seen = []
    floor = floors.FLOORS["row_hook_calls" if step.row_results else "hook_calls"][1]

    def calls_the_model(step):
        hooks = [getattr(model, name, None) for name in names]
        seen.append(all(hook is None or hook is floors._return_at_once for hook in hooks))
        floor(step)

    assert floors.us_per_request(calls_the_model, step, number=2) > 0
    assert seen and all(seen)
    assert {name: model.__dict__.get(name) for name in names} == before
