"""The runtime corpus (tests/corpus/runtime/*.yaml): bad hook outputs and their messages (issue 9).

Each case arms one fault (``_faults.FAULTS``) on one call of one hook of a stage variant, or gives
a step hand-made offsets, and must raise its error with every expected substring (message and
notes), leave ``runner_state`` as it was before the step, and run no MTP. The file format is
described in tests/corpus/runtime/README.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from omnigen_testing.contract_support import HOOK_VARIANTS, ROW_KINDS, Step, rig, rows_of, runner_state

from ._faults import FAULTS, HookFailure, arm, hook_message

CORPUS = Path(__file__).parents[1] / "corpus" / "runtime"
VARIANTS = {v.id: v for v in HOOK_VARIANTS}
ERRORS = {"ValueError": ValueError, "RuntimeError": RuntimeError, "HookFailure": HookFailure}
KEYS = {"id", "variant", "kinds", "offsets", "hook", "fault", "call", "error", "message"}


def load_cases() -> list[dict[str, Any]]:
    cases = []
    for path in sorted(CORPUS.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        for case in data["cases"]:
            cases.append({**data.get("defaults", {}), **case, "file": path.name})
    return cases


CASES = load_cases()


def test_the_corpus_is_well_formed():
    assert len(CASES) >= 40
    assert len({c["id"] for c in CASES}) == len(CASES), "case ids are unique"
    for case in CASES:
        assert set(case) - {"file"} <= KEYS, f"{case['id']}: unknown keys {set(case) - KEYS - {'file'}}"
        assert case["variant"] in VARIANTS, f"{case['id']}: no variant {case['variant']}"
        assert all(kind in ROW_KINDS for kind in case["kinds"]), case["id"]
        assert case["error"] in ERRORS, case["id"]
        assert case["message"] and all(isinstance(m, str) for m in case["message"]), case["id"]
        if case["hook"] == "none":
            assert "offsets" in case and "fault" not in case, case["id"]
        else:
            assert case["fault"] in FAULTS[case["hook"]], f"{case['id']}: no fault {case['fault']}"


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_a_corpus_case_fails_with_its_message_and_changes_nothing(case, recorder, ctx, graph):
    variant = VARIANTS[case["variant"]]
    graph.for_policy(variant.caps["mtp_graph"] or "unsafe")
    step = Step(rows_of(case["kinds"]), offsets=case.get("offsets"))
    buffers = {
        row.req_id: {"meta": {"tag": row.tag}, "codes": {"audio": torch.ones(1, 2)}} for row in step.rows[:2]
    }
    r = rig(variant, step, recorder, ctx, buffers=buffers)
    if case["hook"] != "none":
        arm(r.runner.model, case["hook"], case["fault"], case["call"])
    before = runner_state(r.runner)
    with pytest.raises(ERRORS[case["error"]]) as err:
        r.runner._preprocess_rows(step.sched, step.ids(), step.embeds())
    message = hook_message(err.value)
    for fragment in case["message"]:
        assert fragment in message, f"{case['file']}: {case['id']}"
    assert runner_state(r.runner) == before
    assert recorder.of("talker_mtp") == []
    if case["hook"] == "none":
        assert recorder.events == [], "offsets are checked before any hook"
    elif case["hook"] != "preprocess_batch":
        assert len(recorder.of(case["hook"])) == case["call"] + 1, "the armed call was the last"
