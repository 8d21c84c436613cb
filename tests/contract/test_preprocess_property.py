"""``_preprocess_rows`` against a straightforward reference, on random steps (issue 9, item 6).

Hypothesis draws a stage variant (per-row hooks with and without the talker MTP, plain and MTP
decode batches, a step hook), a step (row phases and spans, offsets sometimes moved, buffers
present or not) and faults armed on random calls of each hook (``_faults.FAULTS``). The generated
runner and ``reference`` below (plain Python over lists, written from CONTRACT 3.1-3.5 and issue
9's rules, calling the same fake model) then either end in equal state (buffers, mirrors,
input ids, input embeddings, the MTP staging buffers) or both fail: the runner with the error the
reference names (type and the hook and request in the message) and every part of its state as it
was before the step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from omnigen.runtime import phases, vllm_api
from omnigen_testing.contract_support import (
    HIDDEN,
    HOOK_VARIANTS,
    MTP_BUFFER_NAMES,
    ROW_KINDS,
    TARGETS,
    FakeForwardContext,
    FakeModel,
    FakePredictor,
    Recorder,
    RowSpec,
    Step,
    freeze,
    rig,
    runner_state,
)

from ._faults import (
    BATCH_FAULTS,
    BATCH_MTP_FAULTS,
    FAULTS,
    ROW_FAULTS,
    ROW_MTP_FAULTS,
    HookFailure,
    hook_message,
)

EXAMPLES = 250
PROPERTY_VARIANTS = [
    v
    for v in HOOK_VARIANTS
    if v.id
    in {
        "qwen2_5_omni.talker",  # per-row hooks
        "qwen3_omni.talker",  # per-row hooks feeding the MTP
        "minicpmo_4_5.tts[decode_batch=plain]",  # plain decode batches
        "mimo_audio.fused_thinker_talker[decode_batch=plain]",  # ... with request features
        "qwen3_tts.qwen3_tts",  # MTP decode batches and the step hook
        "moss_tts_local.talker",  # MTP decode batches
        "minicpmo_4_5.tts[batch_hook=true]",  # per-row hooks and the step hook
    }
]
assert len(PROPERTY_VARIANTS) == 7


class PropertyModel(FakeModel):
    """``FakeModel`` with faults armed per hook and call: ``faults[hook][call] = fault``."""

    faults: dict[str, dict[int, str]]

    def _fault(self, hook: str) -> str | None:
        return self.faults.get(hook, {}).get(len(self.recorder.of(hook)) - 1)

    def preprocess(self, input_ids, input_embeds, **infos):
        out = super().preprocess(input_ids, input_embeds, **infos)
        fault = self._fault("preprocess")
        if fault is None or (
            fault.startswith("mtp_") and fault != "mtp_ids_none" and "mtp_inputs" not in out[2]
        ):
            return out  # an MTP-input fault on a row the model gave no MTP inputs changes nothing
        return FAULTS["preprocess"][fault](out)

    def preprocess_decode_batch(self, input_ids, req_infos):
        out = super().preprocess_decode_batch(input_ids, req_infos)
        fault = self._fault("preprocess_decode_batch")
        return out if fault is None else FAULTS["preprocess_decode_batch"][fault](out)

    def preprocess_batch(self, req_ids, model_intermediate_buffer, device):
        super().preprocess_batch(req_ids, model_intermediate_buffer, device)
        fault = self._fault("preprocess_batch")
        if fault is not None:
            FAULTS["preprocess_batch"][fault](self, list(req_ids), model_intermediate_buffer)


# -- the reference --------------------------------------------------------------------------------


@dataclass
class Expected:
    """The error the reference says the step must fail with."""

    error: type[BaseException]
    fragments: list[str]


class Failed(Exception):
    def __init__(self, expected: Expected) -> None:
        self.expected = expected


INTEGER = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}


def _tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _row_result_ok(out: Any, span: int, mtp_row: bool, mtp_width: int) -> bool:
    """Issue 9's rules for a per-row ``preprocess`` result."""
    if not isinstance(out, tuple) or len(out) != 3:
        return False
    ids, embeds, update = out
    if not (_tensor(embeds) and tuple(embeds.shape) == (span, HIDDEN) and embeds.dtype.is_floating_point):
        return False
    if ids is None:
        if mtp_row:
            return False
    elif not (_tensor(ids) and ids.numel() == span and ids.dtype in INTEGER):
        return False
    if update is not None and not isinstance(update, dict):
        return False
    if mtp_row:
        pair = update.get("mtp_inputs") if isinstance(update, dict) else None
        if not (isinstance(pair, tuple) and len(pair) == 2):
            return False
        for t in pair:
            if not (_tensor(t) and t.numel() == mtp_width and t.dtype.is_floating_point):
                return False
    return True


def _batch_result_ok(out: Any, n: int, mtp: bool, mtp_width: int) -> bool:
    """Issue 9's rules for a ``preprocess_decode_batch`` result."""
    if not isinstance(out, tuple) or len(out) != (5 if mtp else 3):
        return False
    ids, embeds, updates = out[0], out[1], out[-1]
    if not (_tensor(ids) and ids.numel() == n and ids.dtype in INTEGER):
        return False
    if not (_tensor(embeds) and tuple(embeds.shape) == (n, HIDDEN) and embeds.dtype.is_floating_point):
        return False
    if not isinstance(updates, (list, tuple)) or len(updates) != n:
        return False
    if any(u is not None and not isinstance(u, dict) for u in updates):
        return False
    if mtp:
        for t in (out[2], out[3]):
            if not (_tensor(t) and tuple(t.shape) == (n, mtp_width) and t.dtype.is_floating_point):
                return False
    return True


def _merge(buffer: dict, update: Any) -> None:
    """CONTRACT 4.1: one level deep."""
    if not isinstance(update, dict):
        return
    for key, value in update.items():
        if isinstance(value, dict):
            if not isinstance(buffer.get(key), dict):
                buffer[key] = {}
            buffer[key].update(value)
        else:
            buffer[key] = value


def reference(
    caps: dict,
    facts: dict,
    rows: list[RowSpec],
    offsets: list[int],
    ids: list[int],
    embeds: list[list[float]],
    buffers: dict[str, dict],
    model: PropertyModel,
    output_key: tuple[str, str] | None,
) -> dict[str, Any]:
    """What the step leaves: ``{"ids", "embeds", "buffers", "mtp"}``, or ``Failed``."""
    total = len(ids)
    mtp = caps["talker_mtp"]
    decode_batch = caps["decode_batch"]
    keys = [
        {
            "request_id": r.req_id,
            "_omni_prompt_len": r.prompt_len,
            "_omni_num_computed_tokens": r.computed,
            "_omni_is_prefill": r.computed < r.prompt_len,
        }
        for r in rows
    ]
    decode = [r.span == 1 and r.computed >= r.prompt_len for r in rows]
    # Segments: runs of adjacent decode rows are batches (when the stage batches), the rest rows.
    segments: list[list[int]] = []
    for i in range(len(rows)):
        if decode_batch != "none" and decode[i] and segments and segments[-1][-1] == i - 1 and decode[i - 1]:
            segments[-1].append(i)
        else:
            segments.append([i])
    batched = [decode_batch != "none" and decode[seg[0]] for seg in segments]

    # Offsets, before any hook.
    if decode_batch == "plain":
        for seg, is_batch in zip(segments, batched, strict=True):
            if is_batch:
                first = offsets[seg[0]]
                if (
                    [offsets[i] for i in seg] != list(range(first, first + len(seg)))
                    or first < 0
                    or (first + len(seg) > total)
                ):
                    raise Failed(Expected(RuntimeError, [phases.CONTIGUITY_ERROR]))
    if mtp:
        mtp_offsets = [offsets[i] for i in range(len(rows)) if decode[i]]
        if len(set(mtp_offsets)) != len(mtp_offsets) or any(o < 0 or o >= total for o in mtp_offsets):
            raise Failed(Expected(RuntimeError, [phases.MTP_OFFSETS_ERROR]))
    for r, off in zip(rows, offsets, strict=True):
        if off < 0 or off + r.span > total:
            raise Failed(Expected(RuntimeError, [phases.ROW_BOUNDS_ERROR, r.req_id]))
    slots = [t for r, off in zip(rows, offsets, strict=True) for t in range(off, off + r.span)]
    if len(slots) != len(set(slots)):  # two rows over the same tokens
        raise Failed(Expected(RuntimeError, [phases.ROW_OVERLAP_ERROR]))

    def call(hook: str, req_ids: list[str], *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(model, hook)(*args, **kwargs)
        except HookFailure:
            who = "request" if len(req_ids) == 1 else "requests"
            raise Failed(
                Expected(HookFailure, [f"raised by model.{hook} for {who} {', '.join(req_ids)};"])
            ) from None

    if facts["batch_hook"]:
        scratch = copy.deepcopy(buffers)
        call(
            "preprocess_batch",
            [r.req_id for r in rows],
            [r.req_id for r in rows],
            scratch,
            torch.device("cpu"),
        )

    staged: list[tuple[int, str, list[int], list[float], list[float], list[float]]] = []
    for seg, is_batch in zip(segments, batched, strict=True):
        if not is_batch:
            i = seg[0]
            r, start = rows[i], offsets[i]
            buffer = buffers.setdefault(r.req_id, {})
            buffer.update(keys[i])
            ids_in = torch.tensor(ids[start : start + r.span], dtype=torch.int32)
            embeds_in = torch.tensor(embeds[start : start + r.span], dtype=torch.float32).reshape(-1, HIDDEN)
            out = call("preprocess", [r.req_id], ids_in, embeds_in, **dict(buffer))
            mtp_row = mtp and decode[i]
            if not _row_result_ok(out, r.span, mtp_row, HIDDEN):
                raise Failed(Expected(ValueError, [f"request {r.req_id}: model.preprocess returned"]))
            out_ids, out_embeds, update = out
            if mtp_row:
                update = dict(update)
                hidden, text = update.pop("mtp_inputs")
                staged.append(
                    (
                        start,
                        r.req_id,
                        out_ids.reshape(-1).tolist(),
                        out_embeds.reshape(-1).tolist(),
                        hidden.reshape(-1).tolist(),
                        text.reshape(-1).tolist(),
                    )
                )
            _merge(buffer, update)
            for j in range(r.span):
                embeds[start + j] = out_embeds[j].tolist()
                if out_ids is not None:
                    ids[start + j] = int(out_ids.reshape(-1)[j])
            continue
        req_ids = [rows[i].req_id for i in seg]
        infos = []
        for i in seg:
            buffer = buffers.setdefault(rows[i].req_id, {})
            buffer.update(keys[i])
            infos.append(dict(buffer))
        ids_in = torch.tensor([ids[offsets[i]] for i in seg], dtype=torch.int32)
        out = call("preprocess_decode_batch", req_ids, ids_in, infos)
        if not _batch_result_ok(out, len(seg), mtp, HIDDEN):
            raise Failed(
                Expected(
                    ValueError, [f"model.preprocess_decode_batch for requests {', '.join(req_ids)} returned"]
                )
            )
        out_ids, out_embeds, updates = out[0].reshape(-1), out[1], out[-1]
        for k, i in enumerate(seg):
            embeds[offsets[i]] = out_embeds[k].tolist()
            ids[offsets[i]] = int(out_ids[k])
            if mtp:
                staged.append(
                    (
                        offsets[i],
                        rows[i].req_id,
                        [int(out_ids[k])],
                        out_embeds[k].tolist(),
                        out[2][k].tolist(),
                        out[3][k].tolist(),
                    )
                )
        for i, update in zip(seg, updates, strict=True):
            _merge(buffers[rows[i].req_id], update)

    mtp_rows: dict[str, list] = {name: [] for name in MTP_BUFFER_NAMES}
    for offset, req_id, row_ids, row_embeds, hidden, text in staged:
        mtp_rows["talker_mtp_input_ids"].append(row_ids[0])
        mtp_rows["talker_mtp_inputs_embeds"].append(row_embeds)
        mtp_rows["last_talker_hidden"].append(hidden)
        mtp_rows["text_step"].append(text)
        # FakePredictor: the row's embedding becomes last_hidden + 0.5; codes round(h[0]) * 10 + j.
        embeds[offset] = [h + 0.5 for h in hidden]
        kind, qualifier = output_key
        buffer = buffers.setdefault(req_id, {})
        if not isinstance(buffer.get(kind), dict):
            buffer[kind] = {}
        code = round(hidden[0]) * 10
        buffer[kind][qualifier] = torch.tensor([[code + j for j in range(FakePredictor.num_codes)]])
    return {"ids": ids, "embeds": embeds, "buffers": buffers, "mtp": mtp_rows}


# -- random steps ----------------------------------------------------------------------------------


@st.composite
def scenarios(draw) -> dict[str, Any]:
    variant = draw(st.sampled_from(PROPERTY_VARIANTS))
    n = draw(st.integers(1, 7))
    rows = []
    for i in range(n):
        kind = draw(st.sampled_from([*ROW_KINDS, "random"]))
        if kind == "random":
            shape = (draw(st.integers(1, 6)), draw(st.integers(0, 8)), draw(st.integers(1, 3)))
        else:
            shape = ROW_KINDS[kind]
        rows.append(RowSpec(f"r{i + 1}-{kind}", *shape, tag=i + 1))
    offsets = [sum(r.span for r in rows[:i]) for i in range(n)]
    total = sum(r.span for r in rows)
    if draw(st.integers(0, 3)) == 0:  # one offset in four steps moved
        for row in draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2, unique=True)):
            offsets[row] = draw(st.integers(-2, total + 1))
    buffers = {}
    for r in rows:
        which = draw(st.sampled_from(["none", "none", "meta", "stale"]))
        if which == "meta":
            buffers[r.req_id] = {"meta": {"tag": r.tag}, "codes": {"audio": torch.ones(1, 2)}}
        elif which == "stale":
            buffers[r.req_id] = {"_omni_is_prefill": "stale", "hidden_states": {"last": torch.zeros(HIDDEN)}}
    row_faults = list(ROW_FAULTS) + (list(ROW_MTP_FAULTS) if variant.caps["talker_mtp"] else [])
    batch_faults = list(BATCH_FAULTS) + (list(BATCH_MTP_FAULTS) if variant.caps["talker_mtp"] else [])
    none: st.SearchStrategy[dict] = st.just({})
    faults = {
        "preprocess": draw(
            none | st.dictionaries(st.integers(0, n - 1), st.sampled_from(row_faults), max_size=2)
        ),
        "preprocess_decode_batch": draw(
            none | st.dictionaries(st.integers(0, 3), st.sampled_from(batch_faults), max_size=2)
        ),
        "preprocess_batch": draw(
            none | none | st.fixed_dictionaries({0: st.sampled_from(["raises", "raises_after_writing"])})
        ),
    }
    return {"variant": variant, "rows": rows, "offsets": offsets, "buffers": buffers, "faults": faults}


@pytest.mark.parametrize("target", TARGETS)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_preprocess_rows_equals_the_reference_or_fails_as_documented(target, scenario):
    variant, rows, offsets = scenario["variant"], scenario["rows"], scenario["offsets"]
    recorder = Recorder()
    step = Step(rows, offsets=offsets)
    r = rig(
        variant,
        step,
        recorder,
        FakeForwardContext(recorder),
        buffers=copy.deepcopy(scenario["buffers"]),
        predictor=FakePredictor(recorder, codes_on_device=False),
        target=target,
    )
    r.runner.model.__class__ = PropertyModel
    r.runner.model.faults = scenario["faults"]
    ref_model = PropertyModel(
        Recorder(), {row.req_id: row.tag for row in rows}, mtp=variant.caps["talker_mtp"]
    )
    ref_model.faults = scenario["faults"]
    total = step.total
    ref_ids = step.input_ids.gpu[:total].tolist()
    ref_embeds = step.inputs_embeds.gpu[:total].tolist()
    output_key = getattr(type(r.runner), "MTP_OUTPUT_KEY", None)
    try:
        expected = reference(
            variant.caps,
            variant.facts,
            rows,
            list(offsets),
            ref_ids,
            ref_embeds,
            copy.deepcopy(scenario["buffers"]),
            ref_model,
            output_key,
        )
    except Failed as failed:
        expected = failed.expected
    before = runner_state(r.runner)
    pad_before = (freeze(step.input_ids.gpu[total:]), freeze(step.inputs_embeds.gpu[total:]))
    if isinstance(expected, Expected):
        event(f"fails: {expected.error.__name__}")
        try:
            with mock.patch.object(vllm_api, "set_forward_context", FakeForwardContext(recorder)):
                r.run_rows()
        except expected.error as exc:
            message = hook_message(exc)
            for fragment in expected.fragments:
                assert fragment in message, (fragment, message)
        else:
            raise AssertionError(f"the runner took a step the reference refuses: {expected}")
        assert runner_state(r.runner) == before, "a failed step changed the runner's state"
        assert recorder.of("talker_mtp") == []
        return
    event("equal to the reference")
    with mock.patch.object(vllm_api, "set_forward_context", FakeForwardContext(recorder)):
        r.run_rows()
    runner = r.runner
    assert step.input_ids.gpu[:total].tolist() == expected["ids"]
    assert step.inputs_embeds.gpu[:total].tolist() == expected["embeds"]
    assert (freeze(step.input_ids.gpu[total:]), freeze(step.inputs_embeds.gpu[total:])) == pad_before
    assert freeze(runner.model_intermediate_buffer) == freeze(expected["buffers"])
    for req_id, buffer in runner.model_intermediate_buffer.items():
        assert runner.requests[req_id].additional_information_cpu is buffer, "each buffer is its mirror"
    if variant.caps["talker_mtp"]:
        for name, staged in expected["mtp"].items():
            if not staged:
                continue
            got = getattr(runner, name).gpu[: len(staged)]
            assert got.reshape(len(staged), -1).tolist() == [
                s if isinstance(s, list) else [s] for s in staged
            ], name
    assert runner._talker_mtp_generators == {}
