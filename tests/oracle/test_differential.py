"""Differential test: omnigen's generated runners against the oracle, step by step.

Every cell below drives the installed oracle (``vllm_omni``'s ``OmniGPUModelRunner``) and
omnigen's runner class for one ``(model, stage, overrides)`` through the same seeded random
scheduler steps (mixed prefill / chunked-prefill tails / cached prefixes / preemptions /
single- and two-token decodes, shuffled batch orders, padding, payloads, seeded and
unseeded MTP rows) with identical dummy models, and requires identical observations:
returned and persistent ids and embeddings, every request's buffer and its mirror, MTP
codes and buffers, generators kept, the model-hook call sequence with what each hook was
given, forward contexts, batch-padding queries and the forward output (harness.py).

Where omnigen deliberately differs from the oracle, the comparison says so by name: each
entry of ``DELIBERATE_DIFFERENCES`` is either a *mapping* (a function, applied to the two
normalized observations, that removes exactly that difference) or a *setting* (how the
oracle or the scenario is set up so that both runners are asked the same question). Each
has a docstring saying what differs, why, and the contract clause. Nothing is ignored
wholesale. ``test_deliberate_differences_are_exactly_the_ones_used`` checks that the list
is exactly what the cells needed, and ``test_each_deliberate_difference_is_needed`` that
dropping any one of them makes its cell fail. Two negative controls prove the comparison
can fail at all.

Steps through each runner: 12 main cells x 300 (3600), 19 override variants x 150 (2850),
the 10 remaining spec-matrix stages x 100 (1000): 7450; plus 120-step reruns for the
necessity checks of the 6 settings and the 2 negative controls, and one bad-offset run.
About 50 s on 2 CPU cores.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from omnigen_testing.oracle.harness import (
    KeyMapping,
    Observation,
    ObservationMismatch,
    Policy,
    Scenario,
    ScenarioConfig,
    Step,
    compare,
    compare_runs,
    coverage,
    oracle_runner_class,
    run_scenario,
)
from omnigen_testing.oracle.policy_map import policy_from_plan

# Found, not imported: importing vllm_omni patches vLLM process-wide, so it happens only when an
# oracle test runs, and those run in a pytest process of their own (``-m oracle``, scripts/test).
if importlib.util.find_spec("vllm_omni") is None:
    pytest.skip(
        "vllm-omni (the comparison oracle) is not installed: it is tied to vLLM 0.30 (requirements/vllm-0.30)",
        allow_module_level=True,
    )
pytestmark = pytest.mark.oracle

import omnigen.api  # noqa: E402
import omnigen.runtime.mtp  # noqa: E402
import omnigen.runtime.phases  # noqa: E402
import omnigen.runtime.vllm_api  # noqa: E402

RUNNER_KEYS = ("request_id", "_omni_prompt_len", "_omni_num_computed_tokens", "_omni_is_prefill")
ORACLE_ROW_KEYS = ("duplex_token_offset", "duplex_prompt_len", "_omni_max_tokens", "_omni_seed")
CONTIGUITY_PHRASE = "Non-MTP batched decode preprocessing requires contiguous in-bounds token offsets"


# =============================================================================
# The deliberate differences, as docs/differences.md lists them
# =============================================================================

DELIBERATE_DIFFERENCES: dict[str, str] = {
    "oracle_only_row_keys": (
        "mapping, 3.1: the oracle also writes duplex_token_offset, duplex_prompt_len, _omni_max_tokens "
        "and _omni_seed into each hooked row's infos/buffer; the contract's runner keys are only "
        "request_id, _omni_prompt_len, _omni_num_computed_tokens, _omni_is_prefill"
    ),
    "oracle_generated_len": (
        "mapping, 1.1: the oracle's forward writes generated_len into every non-empty buffer; the "
        "contract's forward passes the buffers and adds nothing to them"
    ),
    "oracle_request_token_spans": (
        "mapping, 1.1: the oracle's forward also passes request_token_spans; the contract's forward "
        "passes only the stage's kwargs (model_intermediate_buffer, runtime_additional_information)"
    ),
    "generation_forward_kwargs": (
        "mapping, 7.3: omnigen's generation stages pass seq_token_counts (and request_ids where the "
        "model keys state by request) to the forward; the oracle's base runner driven here does not "
        "(its GPUGenerationModelRunner does, and the engine-level test compares against that one)"
    ),
    "batch_req_ids_after_the_forward": (
        "mapping, 7.7: omnigen calls set_batch_req_ids(req_ids) right after the forward in "
        "_model_forward; the oracle's AR runner calls it in its own execute_model after the forward, "
        "which this test does not drive (the engine-level test, tests/e2e/real, does)"
    ),
    "oracle_decode_metadata_query_start_loc": (
        "mapping, 1.2: the oracle also passes omni_query_start_loc to update_decode_step_metadata; the "
        "contract's call passes input_ids, positions, inputs_embeds and req_ids"
    ),
    "runner_keys_in_created_buffer": (
        "mapping, 3.1: on a request's first hooked step omnigen creates the request's buffer and keeps "
        "the runner keys in it; the oracle writes them to a throwaway dict when the request has no "
        "buffer yet, so its buffer (if the hook's update creates one) lacks them until the next step"
    ),
    "runner_keys_beside_attached_features": (
        "mapping, 3.1/3.8: on MiMo's fused stage the oracle copies the row's buffer for the request "
        "features first and writes the runner keys into the copy only, so its buffer never holds them; "
        "omnigen writes them into the buffer, then hands the hook a copy with the features"
    ),
    "batch_hook_sees_created_buffer": (
        "setting, 3.1: with a batch hook (qwen3_tts), a buffer that exists in omnigen but not yet in "
        "the oracle is handed to preprocess_batch, and the two runs drift apart for good; the dummy "
        "model gives no empty update to a request without buffer content (empty_first_update=False)"
    ),
    "generator_none_with_generators": (
        "mapping, 2.3: a batched seeded MTP call gets generator=None next to generators=[...] from "
        "omnigen; the oracle passes only generators"
    ),
    "per_row_mtp_setup_once": (
        "mapping, 2.3: in the one-predictor-call-per-row fallback omnigen asks for the one-row "
        "batch execution once and enters one forward context around all the rows' calls; the "
        "oracle asks and enters once per row (the calls, their inputs, generators and outputs agree)"
    ),
    "finish_decode_step_forward": (
        "mapping, 1.2: a stage declaring has_finish_decode_step gets model.finish_decode_step_forward() "
        "after the forward from omnigen; the oracle never calls it"
    ),
    "contiguity_checked_before_hooks": (
        "mapping, 3.5: bad non-MTP decode-batch offsets raise in omnigen before any hook runs; the "
        "oracle raises when it flushes the batch, after hooking (and merging) the rows before it"
    ),
    "eager_only_per_row_generators": (
        "setting, 2.3: per_row_generators=eager_only is decided when generating; the oracle follows "
        "the model's run-time flag (qwen3_tts declares it unconditionally), so under a full graph "
        "with a wrapped predictor it is told the model accepts none"
    ),
    "async_chunk_fixed_at_generation": (
        "setting, 5.2: omnigen fixes async_chunk (payload sync before the rows or not) when generating; "
        "the oracle reads model_config.async_chunk at run time, so the deployment states the generated value"
    ),
    "mimo_attachment_by_class_name": (
        "setting, 3.8: omnigen attaches request features where the config says so; the oracle only "
        "when the model's class is named MiMoAudioForConditionalGeneration, so the dummy carries that name"
    ),
    "replace_only_on_marker": (
        "setting, 4.3: omnigen replaces a request's buffer only for a payload marked "
        "meta.replace_runtime_additional_information; the oracle replaces on every payload, so "
        "replacement stages are driven with every payload marked"
    ),
    "payloads_admitted_on_non_refreshing_stages": (
        "setting, 4.2: a stage without hook or per-step refresh merges a new request's payloads into "
        "its buffer in omnigen; the oracle never does (its _decode_and_store_request_payloads is never "
        "called), so those stages are driven without scheduler payloads"
    ),
}


# -----------------------------------------------------------------------------
# Mappings: fn(oracle, ours) on the normalized observations of one step; True if it changed
# anything. Each removes exactly one difference and nothing else.
# -----------------------------------------------------------------------------


def _drop_buffer_keys(side: dict[str, Any], names: tuple[str, ...]) -> bool:
    changed = False
    for buf in side["buffers"].values():
        if isinstance(buf, dict):
            for name in names:
                if name in buf:
                    del buf[name]
                    changed = True
    return changed


def _drop_info_keys(side: dict[str, Any], names: tuple[str, ...]) -> bool:
    changed = False
    for call in side["calls"]:
        for field in ("keys", "req_info_keys"):
            lists = call.get(field)
            if lists is None:
                continue
            trimmed = [[k for k in ks if k not in names] for ks in lists]
            if trimmed != lists:
                call[field] = trimmed
                changed = True
    return changed


def oracle_only_row_keys(oracle: dict[str, Any], ours: dict[str, Any]) -> bool:
    """The oracle's extra per-row keys, removed from the oracle's side only.

    What: before each row's hook the oracle writes ``duplex_token_offset`` (computed tokens
    again), ``duplex_prompt_len``, ``_omni_max_tokens`` (sampling_params.max_tokens) and
    ``_omni_seed`` (sampling_params.seed) into the row's infos -- the request's buffer when
    it has one -- so they show in its buffer and in the key lists the hooks see.
    Why: CONTRACT 3.1 names exactly four runner-owned keys; the others serve models outside
    the contract (duplex models, models sampling inside forward). Contract: 3.1.
    Only the oracle's side is cleaned: omnigen writing any of these would still fail.
    """
    return _drop_buffer_keys(oracle, ORACLE_ROW_KEYS) | _drop_info_keys(oracle, ORACLE_ROW_KEYS)


def oracle_generated_len(oracle: dict[str, Any], ours: dict[str, Any]) -> bool:
    """``generated_len``, removed from the oracle's buffers (and hook key lists) only.

    What: the oracle's ``_model_forward`` gathers the buffers for the forward and writes
    ``generated_len = len(output_token_ids)`` into every non-empty one (for MammothModa2's
    grid constraint); the key then shows in later hook infos.
    Why: CONTRACT 1.1's forward hands the stage's buffers to the model; it does not add
    keys to them. Contract: 1.1.
    """
    return _drop_buffer_keys(oracle, ("generated_len",)) | _drop_info_keys(oracle, ("generated_len",))


def oracle_request_token_spans(oracle: dict[str, Any], ours: dict[str, Any]) -> bool:
    """The oracle's extra forward kwarg ``request_token_spans``, removed from its forward calls.

    What: the oracle also passes per-row ``(start, end)`` token spans to the model's forward.
    Why: CONTRACT 1.1 names the kwargs a stage passes (``model_intermediate_buffer`` /
    ``runtime_additional_information``); a model that needs spans is not one of the
    shipped stages. Contract: 1.1. (A model whose ``make_omni_output`` maps rows by spans
    would get none from omnigen: a real difference, kept visible here by name.)
    """
    return _drop_call_kwargs(oracle, ("forward", "make_omni_output"), ("request_token_spans",))


def generation_forward_kwargs(oracle: dict[str, Any], ours: dict[str, Any]) -> bool:
    """omnigen's generation-stage forward kwargs, removed from its forward calls.

    What: a generation stage's forward gets ``seq_token_counts`` (each request's scheduled
    tokens) and, where the model keys state by request, ``request_ids`` from omnigen.
    Why: CONTRACT 7.3; the oracle runner this test drives is vllm-omni's base
    ``OmniGPUModelRunner``, whose generation subclass (not driven here) adds them; the
    engine-level test (``tests/e2e/real``) compares generation stages against that subclass.
    Contract: 7.3.
    """
    return _drop_call_kwargs(ours, ("forward", "make_omni_output"), ("seq_token_counts", "request_ids"))


def batch_req_ids_after_the_forward(oracle: dict[str, Any], ours: dict[str, Any]) -> bool:
    """omnigen's ``set_batch_req_ids`` calls, removed from its call log.

    What: a stage declaring ``outputs.set_batch_req_ids`` hands the model the step's request ids
    right after the forward. Why: CONTRACT 7.7; the oracle makes the same call from its AR
    runner's ``execute_model`` (gpu_ar_model_runner.py:1161-1168), outside the ``_model_forward``
    this test drives. Contract: 7.7.
    """
    before = len(ours["calls"])
    ours["calls"] = [call for call in ours["calls"] if call["hook"] != "set_batch_req_ids"]
    return len(ours["calls"]) != before


def _drop_call_kwargs(side: dict[str, Any], hooks: tuple[str, ...], names: tuple[str, ...]) -> bool:
    changed = False
    for call in side["calls"]:
        if call["hook"] in hooks and any(name in call["kwargs"] for name in names):
            call["kwargs"] = [k for k in call["kwargs"] if k not in names]
            changed = True
    return changed


def per_row_mtp_setup_once(oracle: dict[str, Any], ours: dict[str, Any]) -> bool:
    """The oracle's repeated one-row set-up in the per-row MTP fallback, collapsed to one.

    What: when seeded rows must run the predictor one call each, the oracle recurses into its
    ``_talker_mtp_forward`` per row, so each row asks ``_determine_batch_execution_and_padding``
    for a one-row batch and enters its own forward context; omnigen asks once and runs every
    row's call inside one context (issue 12: only the call itself is per row).
    Why: CONTRACT 2.3 requires one predictor call per seeded row, with that row from slot 0 and
    its own generator; it says nothing of how often the step's constant set-up is repeated.
    Contract: 2.3. Applied to the oracle's side only, and only to runs of identical one-row
    entries (``num_tokens == 1`` queries, contexts of one padded token): any other repetition,
    and any difference in the queries or contexts themselves, still fails.
    """
    changed = False
    for field, one_row in (
        ("batch_padding_calls", lambda entry: entry.get("num_tokens") == 1 and entry.get("num_reqs") == 1),
        ("forward_contexts", lambda entry: entry[1] == 1),
    ):
        entries = oracle[field]
        kept = [
            entry
            for index, entry in enumerate(entries)
            if not (index and one_row(entry) and entry == entries[index - 1])
        ]
        if len(kept) != len(entries):
            oracle[field] = kept
            changed = True
    return changed


def oracle_decode_metadata_query_start_loc(oracle: dict[str, Any], ours: dict[str, Any]) -> bool:
    """The oracle's extra ``omni_query_start_loc`` kwarg to ``update_decode_step_metadata``.

    What: before the forward, both runners tell a decode-step-metadata model the step's
    rows; the oracle also passes ``omni_query_start_loc`` (None unless its model asks for
    the query start locations as a forward kwarg). Why: CONTRACT 1.2 names the call's
    arguments: ``input_ids``, ``positions``, ``inputs_embeds``, ``req_ids``. Contract: 1.2.
    """
    changed = False
    for call in oracle["calls"]:
        if call["hook"] == "update_decode_step_metadata" and "omni_query_start_loc" in call["kwargs"]:
            call["kwargs"] = [k for k in call["kwargs"] if k != "omni_query_start_loc"]
            changed = True
    return changed


def _unstamp_where_oracle_has_none(oracle: dict[str, Any], ours: dict[str, Any], empty_too: bool) -> bool:
    """Drop the runner keys from omnigen's buffers where the oracle's buffer holds none of them."""
    changed = False
    for rid, mine in list(ours["buffers"].items()):
        if not isinstance(mine, dict):
            continue
        theirs = oracle["buffers"].get(rid)
        stamped = all(k in mine for k in RUNNER_KEYS) and mine["request_id"] == rid
        if theirs is None and ((stamped and set(mine) == set(RUNNER_KEYS)) or (empty_too and mine == {})):
            del ours["buffers"][rid]
            if ours["mirror"].get(rid) == "same":
                ours["mirror"][rid] = "absent"
            changed = True
        elif isinstance(theirs, dict) and stamped and not any(k in theirs for k in RUNNER_KEYS):
            for k in RUNNER_KEYS:
                del mine[k]
            changed = True
    return changed


def runner_keys_in_created_buffer(oracle: dict[str, Any], ours: dict[str, Any]) -> bool:
    """The runner keys omnigen keeps in a buffer the oracle has not created yet.

    What: the oracle reads a row's infos as ``buffer.get(req_id, {})``; for a request
    without a buffer it writes the runner keys into that throwaway dict, and the buffer
    the hook's update then creates (if the update is not empty) lacks them until the
    request's next hooked step. omnigen creates the request's buffer first and writes the
    keys into it, so on that step its buffer holds the four keys and the oracle's either
    does not exist or holds none of them.
    Why: CONTRACT 3.1 writes the keys "into the request's buffer dict", for every row.
    Contract: 3.1.
    Applied only where the oracle's buffer is absent or holds none of the four keys, and
    only to omnigen buffers whose keys are the request's own (``request_id`` matches).
    """
    return _unstamp_where_oracle_has_none(oracle, ours, empty_too=False)


def runner_keys_beside_attached_features(oracle: dict[str, Any], ours: dict[str, Any]) -> bool:
    """On a request-feature stage (MiMo), the runner keys omnigen keeps in the buffer itself.

    What: the oracle first replaces a row's infos by the copy that
    ``_maybe_attach_mimo_audio_req_infos`` returns and then writes the runner keys, so they
    reach the hook but never the request's buffer, on any step. omnigen writes them into
    the buffer (creating it) and then attaches the features to a copy for the hook. (An
    omnigen that stamps only the copy leaves an empty created buffer ``{}`` behind, which
    this also maps.) Why: CONTRACT 3.1 (keys in the request's buffer, every row) together
    with 3.8 (the attached infos are a copy; the input is never mutated). Contract: 3.1, 3.8.
    Applied only where the oracle's buffer is absent or holds none of the four keys.
    """
    return _unstamp_where_oracle_has_none(oracle, ours, empty_too=True)


def generator_none_with_generators(oracle: dict[str, Any], ours: dict[str, Any]) -> bool:
    """``generator=None`` next to ``generators=[...]``, removed from omnigen's MTP calls.

    What: a batched predictor call with seeded rows gets ``generators=[g or None per row]``
    from both runners; omnigen also passes ``generator=None``, the oracle leaves it out.
    Why: CONTRACT 2.3 says so ("generators=[...] and generator=None"), so a predictor whose
    scalar default would otherwise apply never mixes the two. Contract: 2.3.
    Applied only to calls that do carry ``generators`` and whose ``generator`` is None.
    """
    changed = False
    for call in ours["calls"]:
        if call["hook"] != "talker_mtp":
            continue
        kwargs = call["kwargs"]
        if "generators" in kwargs and "generator" in kwargs and not call["generator"]:
            call["kwargs"] = [k for k in kwargs if k != "generator"]
            changed = True
    return changed


def finish_decode_step_forward(oracle: dict[str, Any], ours: dict[str, Any]) -> bool:
    """omnigen's ``finish_decode_step_forward`` calls, removed from its call log.

    What: for a stage that declares decode-step metadata and a finish hook
    (``outputs.has_finish_decode_step``), omnigen calls ``model.finish_decode_step_forward()``
    after the forward, in a ``finally``; the oracle never calls it.
    Why: CONTRACT 1.2 ("where the model has one ... after it, in a finally, even when the
    forward raises"). No shipped config declares one (vllm-omni 0.30 has none); the
    variant cell turns it on. Contract: 1.2.
    """
    calls = [c for c in ours["calls"] if c["hook"] != "finish_decode_step_forward"]
    changed = len(calls) != len(ours["calls"])
    ours["calls"] = calls
    return changed


def contiguity_checked_before_hooks(oracle: dict[str, Any], ours: dict[str, Any]) -> bool:
    """On a step with bad non-MTP decode-batch offsets: what the oracle did before raising.

    What: both runners raise ``RuntimeError`` with the contract's phrase. omnigen checks
    every batch's offsets before any hook (and adds which rows and offsets); the oracle
    checks a batch when it flushes it, after calling the hooks of the rows before it and
    merging their updates; it has also written this step's runner keys into the buffers of
    every row it reached, the failing batch's included. Mapped: both errors to the phrase;
    the oracle's hook calls of the step dropped; the buffers (and mirror, codes) of the rows
    those calls were for, and the four runner keys of every buffer, dropped on both sides --
    the test asserts separately that omnigen left every buffer exactly as it was.
    Why: CONTRACT 3.5 "before any hook is called and with every buffer unchanged".
    Contract: 3.5. Applied only when both errors carry the phrase.
    """
    errors = (oracle["error"] or "", ours["error"] or "")
    if not all(CONTIGUITY_PHRASE in e for e in errors):
        return False
    oracle["error"] = ours["error"] = f"RuntimeError: {CONTIGUITY_PHRASE}"
    hooked = {rid for call in oracle["calls"] for rid in call.get("req_ids") or ()}
    oracle["calls"] = []
    for side in (oracle, ours):
        for field in ("buffers", "mirror", "codes"):
            for rid in hooked:
                side[field].pop(rid, None)
        _drop_buffer_keys(side, RUNNER_KEYS)
    return True


MAPPINGS: dict[str, Callable[[dict[str, Any], dict[str, Any]], bool]] = {
    fn.__name__: fn
    for fn in (
        oracle_only_row_keys,
        oracle_generated_len,
        oracle_request_token_spans,
        generation_forward_kwargs,
        batch_req_ids_after_the_forward,
        oracle_decode_metadata_query_start_loc,
        runner_keys_in_created_buffer,
        runner_keys_beside_attached_features,
        generator_none_with_generators,
        per_row_mtp_setup_once,
        finish_decode_step_forward,
        contiguity_checked_before_hooks,
    )
}


# -----------------------------------------------------------------------------
# Settings: fn(setup, cell, on) -> setup. ``on=False`` is the naive setup (what a test gets
# without the accommodation); each returns the setup unchanged where it does not apply.
# -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    oracle: Policy
    ours: Policy
    scenario: ScenarioConfig


def batch_hook_sees_created_buffer(setup: Setup, cell: Cell, on: bool) -> Setup:
    """No empty hook update for a request without buffer content, on batch-hook stages.

    What: ``preprocess_batch`` (qwen3_tts) runs before the rows and sees the buffers that
    exist. A request whose first hook update is empty has a buffer in omnigen (3.1, see
    ``runner_keys_in_created_buffer``) but none in the oracle; from its next step on the
    batch hook writes into omnigen's buffer only, and the two runs differ for the rest of
    the request's life. Set: the dummy model returns an empty update only to a request
    whose infos already carry ``meta`` (``ModelFlags.empty_first_update=False``); later
    empty updates still happen. Why: CONTRACT 3.1 (the buffer exists from the first
    hooked step). Contract: 3.1.
    """
    if not cell.plan.batch_preprocess_hook:
        return setup
    return dataclasses.replace(
        setup,
        oracle=setup.oracle.with_flags(empty_first_update=not on),
        ours=setup.ours.with_flags(empty_first_update=not on),
    )


def eager_only_per_row_generators(setup: Setup, cell: Cell, on: bool) -> Setup:
    """What the oracle is told about per-row generators for an ``eager_only`` stage.

    What: qwen3_tts's model sets ``talker_mtp_accepts_per_row_generators = True``
    unconditionally and the oracle trusts it, also when the predictor is wrapped in a full
    graph (where one captured call takes one generator). omnigen's ``eager_only`` takes
    per-row generators only from an unwrapped predictor and otherwise runs seeded rows one
    by one. Set: the oracle's model declares the flag only while the predictor runs eager
    (``on=False``: as the real model declares it, always). Why: docs/models.md ("only while the
    predictor runs eager"), decided when generating. Contract: 2.3.
    """
    mtp = cell.plan.mtp
    if mtp is None or mtp.per_row_generators != "eager_only":
        return setup
    wrapped = mtp.graph == "safe" and cell.cudagraph == "full"
    return dataclasses.replace(setup, oracle=setup.oracle.with_flags(per_row_generators=not (on and wrapped)))


def async_chunk_fixed_at_generation(setup: Setup, cell: Cell, on: bool) -> Setup:
    """The deployment's ``model_config.async_chunk``: the value the runner was generated for.

    What: the oracle syncs connector payloads into buffers before the rows exactly when
    ``model_config.async_chunk`` is false at run time; omnigen decides it when generating
    (``sync_payloads_before_rows``) and never reads the setting. Set: both runners see
    ``async_chunk`` as generated (``on=False``: a deployment that says the opposite; the
    oracle follows it, omnigen does not). Why: CONTRACT's rule that a policy the config
    fixes is decided when generating; 5.2 ("decided when generating"). Contract: 5.2.
    """
    if not (cell.plan.preprocess_hook or cell.plan.refresh_every_step):
        return setup  # the oracle reads async_chunk only where it refreshes buffers
    value = cell.plan.async_chunk if on else not cell.plan.async_chunk
    return dataclasses.replace(
        setup,
        oracle=dataclasses.replace(setup.oracle, async_chunk=value),
        ours=dataclasses.replace(setup.ours, async_chunk=value),
    )


def mimo_attachment_by_class_name(setup: Setup, cell: Cell, on: bool) -> Setup:
    """The oracle's model class is named ``MiMoAudioForConditionalGeneration``.

    What: the oracle attaches ``mm_features`` / ``req_id`` to a row's infos only when
    ``type(model).__name__`` is MiMo-Audio's class name; omnigen's fused MiMo stage does it
    because its config says ``attach_request_features``. Set: the oracle's dummy model is
    of a class with that name (``on=False``: any other name -- a subclass, a wrapper).
    Why: CONTRACT 3.8, a stage declaration decided when generating. Contract: 3.8.
    """
    if not cell.plan.attach_request_features:
        return setup
    return dataclasses.replace(setup, oracle=setup.oracle.with_flags(attach_request_features=on))


def replace_only_on_marker(setup: Setup, cell: Cell, on: bool) -> Setup:
    """Every scheduler payload carries a true replace marker, on replacement stages.

    What: on a stage declaring snapshot replacement omnigen replaces a request's buffer
    only for a payload whose ``meta.replace_runtime_additional_information`` is true (a bool
    or a 0-d bool tensor) and merges the others; the oracle replaces on every payload.
    Set: the scenario marks every payload (``on=False``: absent / true / false mixed).
    The merge path is compared on every other stage and in the ``replace_on_marker=false``
    variant. Why: CONTRACT 4.3. Contract: 4.3.
    """
    if not cell.plan.replace_on_marker:
        return setup
    return dataclasses.replace(
        setup, scenario=dataclasses.replace(setup.scenario, replace_marker="always" if on else "mixed")
    )


def payloads_admitted_on_non_refreshing_stages(setup: Setup, cell: Cell, on: bool) -> Setup:
    """No scheduler payloads on a stage without a hook or per-step refresh (a thinker, an llm).

    What: omnigen merges a new request's ``model_intermediate_buffer`` and
    ``additional_information`` into its buffer when the request is admitted
    (``_admit_new_request_payloads``; plan decision ``refresh_every_step=false``: "buffers
    take the scheduler's payloads only when a request is admitted"). The oracle merges
    scheduler payloads only for a model with ``has_preprocess`` or
    ``enable_update_additional_information``; its ``_decode_and_store_request_payloads``
    would cover the others but nothing calls it. Set: the scenario carries no scheduler
    payloads (``ScenarioConfig(payloads=False)``; connector payloads still flow).
    Why: CONTRACT 4.2 (a new request's payloads merge into its buffer). Contract: 4.2.
    """
    if cell.plan.preprocess_hook or cell.plan.refresh_every_step:
        return setup
    return dataclasses.replace(setup, scenario=dataclasses.replace(setup.scenario, payloads=not on))


SETTINGS: dict[str, Callable[[Setup, Cell, bool], Setup]] = {
    fn.__name__: fn
    for fn in (
        batch_hook_sees_created_buffer,
        eager_only_per_row_generators,
        async_chunk_fixed_at_generation,
        mimo_attachment_by_class_name,
        replace_only_on_marker,
        payloads_admitted_on_non_refreshing_stages,
    )
}


# =============================================================================
# Cells
# =============================================================================


@dataclass(frozen=True)
class Cell:
    id: str
    model: str
    stage: str
    overrides: tuple[str, ...] = ()
    cudagraph: str = "none"
    steps: int = 300
    seed: int = 0
    multimodal_inputs: bool = False
    # Tell the oracle the MTP graph policy the legacy way (no explicit talker_mtp_graph_safe;
    # a separate talker module or not) instead of the resolved value: checks that
    # "auto" resolves as the oracle's legacy rule does (2.2).
    legacy_separate_talker: bool | None = None
    # harness.coverage keys the oracle run must show (> 0): the cell exercises what it is for.
    expect: tuple[str, ...] = ()
    # harness.ScenarioConfig fields set other than by default, as (name, value) pairs.
    scenario: tuple[tuple[str, Any], ...] = ()

    @functools.cached_property
    def plan(self) -> Any:
        return omnigen.api.stage_plan(self.model, self.stage, self.overrides)

    @functools.cached_property
    def runner_class(self) -> type:
        return omnigen.api.runner_class(self.model, self.stage, self.overrides)


S = "model.stages"
# The Higgs talker with a per-row hook and plain decode batching: the legacy runner refreshes
# every hooked stage's buffers, so the refresh comes with it.
PLAIN_BATCH = (
    f"{S}.talker.preprocess.hook=true",
    f"{S}.talker.preprocess.decode_batch=plain",
    f"{S}.talker.buffers.refresh_every_step=true",
)
MAIN = [
    Cell("qwen3_omni/thinker", "qwen3_omni", "thinker", seed=101, expect=("hook:forward",)),
    Cell(
        "qwen3_omni/talker[auto,full]", "qwen3_omni", "talker", cudagraph="full", seed=102,
        legacy_separate_talker=True, expect=("mtp:seeded_rows_generator", "steps_with_multiple_mtp_calls"),
    ),
    Cell("qwen3_omni/code2wav", "qwen3_omni", "code2wav", seed=103, expect=("payload:cached",)),
    Cell(
        "qwen3_tts/qwen3_tts[eager]", "qwen3_tts", "qwen3_tts", seed=104,
        expect=("hook:preprocess_batch", "hook:preprocess_decode_batch", "mtp:seeded_rows_generators",
                "mtp:unseeded_rows_in_generators"),
    ),
    Cell(
        "qwen3_tts/qwen3_tts[full]", "qwen3_tts", "qwen3_tts", cudagraph="full", seed=105,
        expect=("hook:preprocess_decode_batch", "steps_with_multiple_mtp_calls"),
    ),
    Cell(
        "moss_tts_local/talker[full]", "moss_tts_local", "talker", cudagraph="full", seed=106,
        expect=("hook:preprocess_decode_batch", "steps_with_multiple_mtp_calls"),
    ),
    Cell(
        "fish_speech/slow_ar[full]", "fish_speech", "slow_ar", cudagraph="full", seed=107,
        expect=("mtp:batched_calls", "steps_with_multiple_mtp_calls"),
    ),
    Cell("higgs_audio_v3/talker", "higgs_audio_v3", "talker", seed=108, expect=("hook:update_decode_step_metadata",)),
    # No shipped stage of vllm-omni 0.30 batches plain decode rows (docs/models.md: it is Breeze-TTS-2's):
    # the 3-tuple path runs on the Higgs talker with the hook turned on.
    Cell(
        "higgs_audio_v3/talker[plain batch]", "higgs_audio_v3", "talker", PLAIN_BATCH, seed=108,
        expect=("hook:preprocess_decode_batch", "hook:update_decode_step_metadata", "steps_with_split_decode1"),
    ),
    Cell("minicpmo_4_5/tts", "minicpmo_4_5", "tts", seed=109, expect=("hook:preprocess", "payload:local")),
    Cell("minicpmo_4_5/code2wav", "minicpmo_4_5", "code2wav", seed=110, expect=("payload:marker",)),
    Cell(
        "mimo_audio/fused_thinker_talker[mm]", "mimo_audio", "fused_thinker_talker", seed=111,
        multimodal_inputs=True, expect=("hook:embed_input_ids", "hook:preprocess"),
    ),
    Cell("indextts2_5/indextts2_5_talker", "indextts2_5", "indextts2_5_talker", seed=112, expect=("hook:preprocess",)),
]  # fmt: skip

TTS = f"{S}.qwen3_tts"
VARIANTS = [
    # MTP graph policy x cudagraph mode
    Cell("qwen3_tts/graph=unsafe,full", "qwen3_tts", "qwen3_tts", (f"{TTS}.mtp.graph=unsafe",), "full", 150, 201,
         expect=("mtp:seeded_rows_generators",)),
    Cell("qwen3_tts/graph=auto,full", "qwen3_tts", "qwen3_tts", (f"{TTS}.mtp.graph=auto",), "full", 150, 202,
         legacy_separate_talker=False),
    Cell("qwen3_tts/graph=safe,none", "qwen3_tts", "qwen3_tts", (f"{TTS}.mtp.graph=safe",), "none", 150, 203),
    Cell("qwen3_omni/talker/graph=unsafe,full", "qwen3_omni", "talker", (f"{S}.talker.mtp.graph=unsafe",), "full",
         150, 204),
    Cell("qwen3_omni/talker/graph=auto,none", "qwen3_omni", "talker", (), "none", 150, 205,
         legacy_separate_talker=True),
    Cell("qwen3_omni/talker/preset graph=eager,full", "qwen3_omni", "talker", ("graph=eager",), "full", 150, 206),
    # Steps of many rows: the per-row hooks' slices are made by one split (phases.SPLIT_ROWS), of
    # inference tensors inside inference mode.
    Cell("qwen3_omni/talker/16 active", "qwen3_omni", "talker", (), "none", 150, 215,
         scenario=(("max_active", 16), ("p_arrive", 0.9), ("max_output", 40)),
         expect=("steps_with_split_rows", "steps_with_multiple_mtp_calls")),
    # per-row generators
    # `always` is refused with a graph-capturable predictor (spec.py), so these cells pair it with graph=unsafe.
    Cell("qwen3_tts/per_row=always,full", "qwen3_tts", "qwen3_tts",
         (f"{TTS}.mtp.graph=unsafe", f"{TTS}.mtp.per_row_generators=always"),
         "full", 150, 207, expect=("mtp:seeded_rows_generators",)),
    Cell("qwen3_tts/per_row=never,none", "qwen3_tts", "qwen3_tts", (f"{TTS}.mtp.per_row_generators=never",),
         "none", 150, 208, expect=("steps_with_multiple_mtp_calls",)),
    Cell("fish_speech/per_row=always,none", "fish_speech", "slow_ar",
         (f"{S}.slow_ar.mtp.graph=unsafe", f"{S}.slow_ar.mtp.per_row_generators=always"),
         "none", 150, 209, expect=("mtp:seeded_rows_generators",)),
    Cell("fish_speech/per_row=eager_only,full", "fish_speech", "slow_ar",
         (f"{S}.slow_ar.mtp.per_row_generators=eager_only",), "full", 150, 210),
    # decode batching
    Cell("qwen3_tts/decode_batch=none", "qwen3_tts", "qwen3_tts", (f"{TTS}.preprocess.decode_batch=none",), "none",
         150, 211),
    Cell("moss_tts_local/decode_batch=none", "moss_tts_local", "talker", (f"{S}.talker.preprocess.decode_batch=none",),
         "full", 150, 212),
    Cell("higgs_audio_v3/hook,decode_batch=none", "higgs_audio_v3", "talker",
         (f"{S}.talker.preprocess.hook=true", f"{S}.talker.buffers.refresh_every_step=true"), "none", 150, 213),
    Cell("fish_speech/decode_batch=mtp", "fish_speech", "slow_ar", (f"{S}.slow_ar.preprocess.decode_batch=mtp",),
         "full", 150, 214, expect=("hook:preprocess_decode_batch",)),
    # snapshot replacement
    Cell("minicpmo_4_5/code2wav/replace=off", "minicpmo_4_5", "code2wav", (f"{S}.code2wav.buffers.replace_on_marker=false",),
         "none", 150, 215, expect=("payload:marker",)),
    Cell("minicpmo_4_5/tts/replace=on", "minicpmo_4_5", "tts", (f"{S}.tts.buffers.replace_on_marker=true",),
         "none", 150, 216),
    # async chunk
    Cell("qwen3_omni/talker/async_chunk=off", "qwen3_omni", "talker", ("model.async_chunk=false",), "full", 150, 217,
         expect=("payload:local",)),
    Cell("minicpmo_4_5/tts/async_chunk=on", "minicpmo_4_5", "tts", ("model.async_chunk=true",), "none", 150, 218),
    # decode-step finish hook; decode-step metadata without the query start locations
    Cell("higgs_audio_v3/finish_decode_step=on", "higgs_audio_v3", "talker",
         (f"{S}.talker.outputs.has_finish_decode_step=true",), "none", 150, 219),
    Cell("higgs_audio_v3/query_start_loc=off", "higgs_audio_v3", "talker",
         (f"{S}.talker.outputs.query_start_loc=false",), "none", 150, 220),
]  # fmt: skip

OTHER_STAGES = [
    Cell(f"{m}/{s}", m, s, steps=100, seed=300 + i)
    for i, (m, s) in enumerate(
        [
            ("qwen2_5_omni", "thinker"),
            ("qwen2_5_omni", "talker"),
            ("qwen2_5_omni", "code2wav"),
            ("qwen3_tts", "code2wav"),
            ("mimo_audio", "code2wav"),
            ("indextts2_5", "s2mel_decoder"),
            ("moss_tts_local", "codec"),
            ("higgs_audio_v3", "code2wav"),
            ("minicpmo_4_5", "llm"),
            ("fish_speech", "dac_decoder"),
        ]
    )
]
ALL_CELLS = {cell.id: cell for cell in MAIN + VARIANTS + OTHER_STAGES}


# =============================================================================
# Running and comparing
# =============================================================================

# name -> number of steps on which the mapping changed something (all comparisons so far)
MAPPING_HITS: Counter[str] = Counter()


def _tracked(name: str) -> Callable[[dict[str, Any], dict[str, Any]], None]:
    fn = MAPPINGS[name]

    def adjust(oracle: dict[str, Any], ours: dict[str, Any]) -> None:
        if fn(oracle, ours):
            MAPPING_HITS[name] += 1

    adjust.__name__ = name
    return adjust


def mapping_for(names: tuple[str, ...]) -> KeyMapping:
    """The comparison of oracle (left) and omnigen (right) under the named mappings."""
    return KeyMapping(adjust=tuple(_tracked(n) for n in names), doc="; ".join(names))


def cell_mappings(cell: Cell) -> tuple[str, ...]:
    """The mappings a cell's plan calls for (each applies only where its difference can show)."""
    plan = cell.plan
    names = ["oracle_generated_len"]  # every cell drives the forward
    if not plan.request_token_spans:
        names.append("oracle_request_token_spans")
    if plan.is_generation:
        names.append("generation_forward_kwargs")
    if plan.set_batch_req_ids:
        names.append("batch_req_ids_after_the_forward")
    if plan.preprocess_hook:
        names.append("oracle_only_row_keys")
        if plan.attach_request_features:
            names.append("runner_keys_beside_attached_features")
        else:
            names.append("runner_keys_in_created_buffer")
    if plan.mtp is not None and plan.mtp.per_row_generators in ("always", "eager_only"):
        names.append("generator_none_with_generators")
    if plan.mtp is not None and plan.mtp.per_row_generators != "always":
        names.append("per_row_mtp_setup_once")
    if plan.decode_step_metadata:
        if not plan.query_start_loc:
            names.append("oracle_decode_metadata_query_start_loc")
        if plan.has_finish_decode_step:
            names.append("finish_decode_step_forward")
    return tuple(names)


def cell_setup(cell: Cell, withhold: str | None = None) -> tuple[Setup, tuple[str, ...]]:
    """Both runners' policies and the scenario config; the settings that changed anything."""
    plan = cell.plan
    policy = policy_from_plan(
        plan, cudagraph=cell.cudagraph, multimodal_inputs=cell.multimodal_inputs, forward=True
    )
    oracle = policy
    if cell.legacy_separate_talker is not None:
        oracle = oracle.with_flags(mtp_graph_safe=None, separate_talker=cell.legacy_separate_talker)
    setup = Setup(
        oracle=oracle,
        ours=policy,
        scenario=ScenarioConfig(seed=cell.seed, num_steps=cell.steps, **dict(cell.scenario)),
    )
    used = []
    for name, fn in SETTINGS.items():
        on, off = fn(setup, cell, True), fn(setup, cell, False)
        if on != off:
            used.append(name)
        setup = off if name == withhold else on
    return setup, tuple(used)


@dataclass
class CellRun:
    cell: Cell
    scenario: Scenario
    oracle: list[Observation]
    ours: list[Observation]
    mappings: tuple[str, ...]
    settings: tuple[str, ...]
    oracle_info: dict[str, Any]
    ours_info: dict[str, Any]


def patch_modules(cls: type) -> tuple[Any, ...]:
    return (sys.modules[cls.__module__], omnigen.runtime.vllm_api)


def run_ours(cell: Cell, policy: Policy, scenario: Scenario, **kw: Any) -> list[Observation]:
    cls = cell.runner_class
    # vllm_api caches the platform's wrapper class: let it see the harness's fake one (and
    # count the lookup) during the run, and nothing of it afterwards.
    lookup = omnigen.runtime.vllm_api.full_graph_wrapper_cls
    lookup.cache_clear()
    try:
        return run_scenario(cls, policy, scenario, extra_patch_modules=patch_modules(cls), **kw)
    finally:
        lookup.cache_clear()


def execute(cell: Cell, withhold: str | None = None, steps: int | None = None) -> CellRun:
    setup, settings = cell_setup(cell, withhold)
    config = setup.scenario if steps is None else dataclasses.replace(setup.scenario, num_steps=steps)
    scenario = Scenario.generate(config)
    oracle_info: dict[str, Any] = {}
    ours_info: dict[str, Any] = {}
    oracle = run_scenario(oracle_runner_class(), setup.oracle, scenario, info=oracle_info)
    ours = run_ours(cell, setup.ours, scenario, info=ours_info)
    return CellRun(cell, scenario, oracle, ours, cell_mappings(cell), settings, oracle_info, ours_info)


@functools.cache
def cell_run(cell_id: str) -> CellRun:
    return execute(ALL_CELLS[cell_id])


def check_cell(run: CellRun) -> None:
    cell = run.cell
    assert len(run.oracle) == len(run.ours) == cell.steps
    compare_runs(run.oracle, run.ours, mapping_for(run.mappings))
    assert not [o.error for o in run.oracle if o.error], "the scenario must run through without errors"
    cov = coverage(run.scenario, run.oracle)
    missing = [key for key in cell.expect if not cov.get(key)]
    assert not missing, f"{cell.id}: the run did not exercise {missing}"
    assert run.oracle_info == run.ours_info, "MTP graph wrapping at init (2.2)"


@functools.cache
def checked_cell_run(cell_id: str) -> CellRun:
    """``cell_run`` compared once (the comparison also counts which mappings changed what)."""
    run = cell_run(cell_id)
    check_cell(run)
    return run


@pytest.mark.parametrize("cell_id", [c.id for c in MAIN])
def test_main_cell_matches_oracle(cell_id: str) -> None:
    assert ALL_CELLS[cell_id].steps >= 300
    checked_cell_run(cell_id)


@pytest.mark.parametrize("cell_id", [c.id for c in VARIANTS + OTHER_STAGES])
def test_variant_matches_oracle(cell_id: str) -> None:
    checked_cell_run(cell_id)


def test_graph_policy_cells_wrap_as_configured() -> None:
    """The graph cells really differ: wrapped and padded to a capture size, or eager."""
    wrapped = {
        "qwen3_omni/talker[auto,full]": True,
        "qwen3_tts/qwen3_tts[full]": True,
        "qwen3_tts/graph=unsafe,full": False,
        "qwen3_tts/graph=auto,full": False,
        "qwen3_tts/graph=safe,none": False,
        "qwen3_omni/talker/graph=unsafe,full": False,
        "qwen3_omni/talker/graph=auto,none": False,
        "qwen3_omni/talker/preset graph=eager,full": False,
    }
    for cell_id, expected in wrapped.items():
        run = cell_run(cell_id)
        assert run.ours_info["mtp_wrapped"] is expected, cell_id
        modes = {ctx[0] for o in run.ours for ctx in o.forward_contexts}
        assert modes == ({"FULL"} if expected else {"NONE"}), cell_id
        if not expected and run.cell.plan.mtp.graph == "unsafe":
            assert run.ours_info["init_wrapper_lookups"] == 0, cell_id  # 2.2: never even looked up


def test_seeded_rows_per_generator_policy() -> None:
    """eager_only: one batched call with per-row generators eager, one call per seeded row wrapped."""
    calls = {
        cell_id: [c for o in cell_run(cell_id).ours for c in o.calls if c["hook"] == "talker_mtp"]
        for cell_id in ("qwen3_tts/qwen3_tts[eager]", "qwen3_tts/qwen3_tts[full]")
    }
    assert any(c["generators"] for c in calls["qwen3_tts/qwen3_tts[eager]"])
    assert not any(c["generators"] for c in calls["qwen3_tts/qwen3_tts[full]"])
    assert any(c["generator"] for c in calls["qwen3_tts/qwen3_tts[full]"])


# =============================================================================
# 3.5: bad offsets (a dedicated run: the random scenario never makes them)
# =============================================================================


def _bad_offset_target(scenario: Scenario) -> tuple[int, int]:
    """A step (and row) with a non-batchable row, then two adjacent decode rows, no payloads."""
    for step in scenario.steps[10:]:
        if step.new_payloads or step.cached_payloads or step.local_payloads or step.finished_req_ids:
            continue
        rows = step.rows
        for i in range(1, len(rows) - 1):
            if rows[i].mtp_eligible and rows[i + 1].mtp_eligible and not rows[0].mtp_eligible:
                return step.index, i
    raise AssertionError("no step with a hooked row before an adjacent decode pair")


def test_bad_decode_batch_offsets_fail_before_any_hook() -> None:
    cell = Cell("higgs_audio_v3/talker[bad offsets]", "higgs_audio_v3", "talker", PLAIN_BATCH, seed=108)
    setup, _ = cell_setup(cell)
    base = Scenario.generate(setup.scenario)
    index, row = _bad_offset_target(base)

    def duplicate_offset(runner: Any, step: Step) -> None:
        if step.index == index:  # row+1 starts where row starts: a duplicate offset
            qsl = runner.query_start_loc
            qsl.np[row + 1] = qsl.np[row]
            qsl.copy_to_gpu()

    oracle = run_scenario(
        oracle_runner_class(), setup.oracle, base, steps=index + 1, after_apply=duplicate_offset
    )
    ours = run_ours(cell, setup.ours, base, steps=index + 1, after_apply=duplicate_offset)
    plain = mapping_for(cell_mappings(cell))
    compare_runs(oracle[:index], ours[:index], plain)
    bad_oracle, bad_ours = oracle[index], ours[index]
    assert CONTIGUITY_PHRASE in (bad_oracle.error or "") and CONTIGUITY_PHRASE in (bad_ours.error or "")
    # The difference shows: the oracle hooked the rows before the batch, omnigen nothing.
    assert bad_oracle.calls and not bad_ours.calls
    with pytest.raises(ObservationMismatch):
        compare(bad_oracle, bad_ours, plain)
    compare(bad_oracle, bad_ours, mapping_for((*cell_mappings(cell), "contiguity_checked_before_hooks")))
    # ... and omnigen left every buffer exactly as the previous step did (no payloads this step).
    before, after = ours[index - 1], bad_ours
    assert after.mirror == before.mirror
    assert _same(after.buffers, before.buffers)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and (a.shape == b.shape and torch.equal(a, b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


# =============================================================================
# The list is exact, and each entry is needed
# =============================================================================

# Where each difference shows (the cell its necessity check runs on).
NEEDED_IN = {
    "oracle_only_row_keys": "minicpmo_4_5/tts",
    "oracle_generated_len": "indextts2_5/indextts2_5_talker",
    "oracle_request_token_spans": "qwen3_omni/code2wav",
    "generation_forward_kwargs": "qwen3_omni/code2wav",
    "oracle_decode_metadata_query_start_loc": "higgs_audio_v3/query_start_loc=off",
    "batch_req_ids_after_the_forward": "qwen3_tts/qwen3_tts[eager]",
    "runner_keys_in_created_buffer": "fish_speech/slow_ar[full]",
    "runner_keys_beside_attached_features": "mimo_audio/fused_thinker_talker[mm]",
    "batch_hook_sees_created_buffer": "qwen3_tts/qwen3_tts[eager]",
    "generator_none_with_generators": "qwen3_tts/qwen3_tts[eager]",
    "per_row_mtp_setup_once": "qwen3_omni/talker[auto,full]",
    "finish_decode_step_forward": "higgs_audio_v3/finish_decode_step=on",
    "contiguity_checked_before_hooks": "higgs_audio_v3/talker[bad offsets]",
    "eager_only_per_row_generators": "qwen3_tts/qwen3_tts[full]",
    "async_chunk_fixed_at_generation": "qwen3_omni/talker[auto,full]",
    "mimo_attachment_by_class_name": "mimo_audio/fused_thinker_talker[mm]",
    "replace_only_on_marker": "minicpmo_4_5/code2wav",
    "payloads_admitted_on_non_refreshing_stages": "qwen3_omni/thinker",
}
NECESSITY_STEPS = 120


def test_deliberate_differences_are_documented() -> None:
    assert set(DELIBERATE_DIFFERENCES) == set(MAPPINGS) | set(SETTINGS) == set(NEEDED_IN)
    assert not set(MAPPINGS) & set(SETTINGS)
    for name, fn in {**MAPPINGS, **SETTINGS}.items():
        doc = fn.__doc__ or ""
        assert "What:" in doc and "Why:" in doc and "Contract:" in doc, name
        kind = "mapping" if name in MAPPINGS else "setting"
        assert DELIBERATE_DIFFERENCES[name].startswith(kind + ", "), name


def test_deliberate_differences_are_exactly_the_ones_used() -> None:
    """Every listed difference is applied somewhere and changes something there; nothing else is."""
    applied: set[str] = set()
    for cell_id in ALL_CELLS:
        run = checked_cell_run(cell_id)
        applied |= set(run.mappings) | set(run.settings)
    test_bad_decode_batch_offsets_fail_before_any_hook()
    applied.add("contiguity_checked_before_hooks")
    hit = {name for name, count in MAPPING_HITS.items() if count}
    assert applied == set(DELIBERATE_DIFFERENCES)
    assert set(MAPPINGS) <= hit, f"mappings that never changed anything: {set(MAPPINGS) - hit}"


@pytest.mark.parametrize("name", list(DELIBERATE_DIFFERENCES))
def test_each_deliberate_difference_is_needed(name: str) -> None:
    """Without the one mapping (or with the naive setting) the cell's comparison fails."""
    cell_id = NEEDED_IN[name]
    if name == "contiguity_checked_before_hooks":
        return  # asserted inside test_bad_decode_batch_offsets_fail_before_any_hook
    if name in MAPPINGS:
        run = cell_run(cell_id)
        assert name in run.mappings
        compare_runs(run.oracle, run.ours, mapping_for(run.mappings))
        without = tuple(n for n in run.mappings if n != name)
        with pytest.raises(ObservationMismatch):
            compare_runs(run.oracle, run.ours, mapping_for(without))
        return
    cell = ALL_CELLS[cell_id]
    assert name in cell_setup(cell)[1], f"{name} does not apply to {cell_id}"
    naive = execute(cell, withhold=name, steps=NECESSITY_STEPS)
    with pytest.raises(ObservationMismatch):
        compare_runs(naive.oracle, naive.ours, mapping_for(naive.mappings))
    if name == "async_chunk_fixed_at_generation":
        # omnigen ignores the run-time setting: its run is the same either way.
        same = execute(cell, steps=NECESSITY_STEPS)
        compare_runs(same.ours, naive.ours)


# =============================================================================
# Negative controls: a broken omnigen must fail the comparison
# =============================================================================


def _segments_without_split(batchable: Any) -> list[tuple[int, int, bool]]:
    """A decode-batch grouping that lets a non-batchable row join the run around it (a bug)."""
    flags = [bool(x) for x in batchable.tolist()]
    if not any(flags):
        return [(i, i + 1, False) for i in range(len(flags))]
    first = flags.index(True)
    last = len(flags) - flags[::-1].index(True)
    return (
        [(i, i + 1, False) for i in range(first)]
        + [(first, last, True)]
        + [(i, i + 1, False) for i in range(last, len(flags))]
    )


def _generators_dropped_each_step(cache: dict, requests: Any, req_ids: list[str], device: Any) -> list:
    cache.clear()  # a bug: a seeded request restarts its random stream every step
    return _ROW_GENERATORS(cache, requests, req_ids, device)


_ROW_GENERATORS = omnigen.runtime.mtp.row_generators


@pytest.mark.parametrize(
    ("cell_id", "target", "broken"),
    [
        ("qwen3_tts/qwen3_tts[eager]", omnigen.runtime.phases, ("segments", _segments_without_split)),
        ("fish_speech/slow_ar[full]", omnigen.runtime.mtp, ("row_generators", _generators_dropped_each_step)),
    ],
    ids=["segments_do_not_split", "generators_dropped_each_step"],
)
def test_negative_control_broken_omnigen_fails(cell_id: str, target: Any, broken: tuple, monkeypatch) -> None:
    cell = ALL_CELLS[cell_id]
    good = cell_run(cell_id)
    attr, replacement = broken
    monkeypatch.setattr(target, attr, replacement)
    setup, _ = cell_setup(cell)
    bad = run_ours(cell, setup.ours, good.scenario, steps=NECESSITY_STEPS)
    with pytest.raises(ObservationMismatch):
        compare_runs(good.oracle[:NECESSITY_STEPS], bad, mapping_for(good.mappings))
