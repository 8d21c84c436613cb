"""Tests of the differential harness itself, run against the installed oracle.

(a) the oracle against itself on the same seed gives identical observations for
    300+ steps under several policy combinations (the harness is deterministic and
    its snapshots are deep);
(b) the scenario covers what it claims, and the observations show each hook kind,
    seeded MTP rows, chunked-prefill tails, span-2 decodes, and so on;
(c) ``compare`` has teeth: a runner with a realistic bug is caught, with a readable
    message, and the oracle-to-contract key mapping does exactly what it says.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import pytest
import torch

from omnigen_testing.oracle.dummy_model import ModelFlags, make_model
from omnigen_testing.oracle.harness import (
    IDENTITY,
    MTP_ATTRIBUTES,
    ORACLE_EXTRA_KEYS,
    ORACLE_VS_CONTRACT,
    RUNNER_ATTRIBUTES,
    ObservationMismatch,
    Policy,
    Scenario,
    ScenarioConfig,
    build_runner,
    compare,
    compare_runs,
    coverage,
    differences,
    harness_patches,
    oracle_runner_class,
    run_scenario,
)

# Found, not imported: importing vllm_omni patches vLLM process-wide, so it happens only when an
# oracle test runs, and those run in a pytest process of their own (``-m oracle``, scripts/test).
if importlib.util.find_spec("vllm_omni") is None:
    pytest.skip(
        "vllm-omni (the comparison oracle) is not installed: it is tied to vLLM 0.30 (requirements/vllm-0.30)",
        allow_module_level=True,
    )
pytestmark = pytest.mark.oracle

NUM_STEPS = 300
SAMPLING = {"do_sample": True, "temperature": 0.9, "top_k": 32, "top_p": 1.0}

POLICIES: dict[str, Policy] = {
    # scalar hooks; several MTP rows with a seeded one -> one predictor call per row
    "mtp_scalar_fallback": Policy(flags=ModelFlags(mtp=True)),
    # qwen3_tts-like eager: 5-tuple decode batching, per-row generators in one call
    "mtp_rowgen_batched": Policy(
        flags=ModelFlags(mtp=True, per_row_generators=True, decode_batching="mtp", batch_hook=True)
    ),
    # graph-safe predictor under a full graph: wrapped, MTP batch padded to capture sizes
    "mtp_batched_graph": Policy(
        flags=ModelFlags(mtp=True, decode_batching="mtp", mtp_graph_safe=True), cudagraph="full"
    ),
    # legacy auto (separate talker -> safe), moss-like output key kept GPU-resident,
    # deployment sampling params, decode-step metadata hooks, forward driven too
    "mtp_auto_moss_key_forward": Policy(
        flags=ModelFlags(
            mtp=True,
            separate_talker=True,
            mtp_output_key=("audio_codes", "current"),
            gpu_resident_keys=frozenset({("audio_codes", "current"), ("hidden_states", "last")}),
            decode_step_metadata=True,
        ),
        cudagraph="full",
        subtalker_sampling_params=SAMPLING,
        forward=True,
    ),
    # explicitly unsafe under a full graph: never wrapped; greedy sub-talker
    "mtp_unsafe_rowgen_greedy": Policy(
        flags=ModelFlags(mtp=True, mtp_graph_safe=False, per_row_generators=True),
        cudagraph="full",
        subtalker_sampling_params={"do_sample": False},
    ),
    # higgs-like 3-tuple decode batching, with snapshot replacement on
    "plain_batched_replace": Policy(
        flags=ModelFlags(mtp=False, decode_batching="plain", replace_snapshots=True)
    ),
    # per-row hooks, replacement on, async-chunk (no local payload sync), forward
    "rows_replace_async_forward": Policy(
        flags=ModelFlags(mtp=False, replace_snapshots=True), async_chunk=True, forward=True
    ),
    # a GEN stage: no hooks, buffers refreshed from the scheduler every step
    "gen_refresh_forward": Policy(
        flags=ModelFlags(mtp=False, has_preprocess=False, refresh_buffers=True), forward=True
    ),
    # multimodal wrapper (input_ids None) + MiMo request-feature attachment
    "mm_inputs_mimo": Policy(
        flags=ModelFlags(mtp=False, multimodal_inputs=True, attach_request_features=True)
    ),
}
SEEDS = {name: i for i, name in enumerate(POLICIES)}


@functools.cache
def scenario(seed: int) -> Scenario:
    return Scenario.generate(ScenarioConfig(seed=seed, num_steps=NUM_STEPS))


@functools.cache
def oracle_run(name: str):
    info: dict = {}
    obs = run_scenario(oracle_runner_class(), POLICIES[name], scenario(SEEDS[name]), info=info)
    return obs, info


# ----------------------------------------------------------------------------- (a)


@pytest.mark.parametrize("name", list(POLICIES))
def test_oracle_against_itself_is_identical(name: str) -> None:
    first, _ = oracle_run(name)
    second = run_scenario(oracle_runner_class(), POLICIES[name], scenario(SEEDS[name]))
    assert len(first) == len(second) >= NUM_STEPS
    assert not [o.error for o in first if o.error], "the oracle must run the whole scenario"
    compare_runs(first, second, IDENTITY)


def test_cloned_and_reset_models_give_identical_runs() -> None:
    policy = POLICIES["mtp_rowgen_batched"]
    sc = scenario(SEEDS["mtp_rowgen_batched"])
    model = make_model(policy.flags, seed=0)
    twin = model.clone()
    a = run_scenario(oracle_runner_class(), policy, sc, model=model, steps=120)
    b = run_scenario(oracle_runner_class(), policy, sc, model=twin, steps=120)
    compare_runs(a, b)
    model.reset()
    c = run_scenario(oracle_runner_class(), policy, sc, model=model, steps=120)
    compare_runs(a, c)


def test_scenarios_are_a_pure_function_of_the_seed() -> None:
    a = Scenario.generate(ScenarioConfig(seed=11, num_steps=60))
    b = Scenario.generate(ScenarioConfig(seed=11, num_steps=60))
    assert [s.describe() for s in a.steps] == [s.describe() for s in b.steps]
    assert [s.describe() for s in a.steps] != [
        s.describe() for s in Scenario.generate(ScenarioConfig(seed=12, num_steps=60)).steps
    ]


# ----------------------------------------------------------------------------- (b)


def test_scenario_covers_what_it_claims() -> None:
    obs, _ = oracle_run("mtp_scalar_fallback")
    cov = coverage(scenario(SEEDS["mtp_scalar_fallback"]), obs)
    minimums = {
        "steps": NUM_STEPS,
        "new": 60,
        "finished": 50,
        "resumed": 1,
        "row:prefill": 50,
        "row:prefill_tail1": 10,
        "row:cached_prefill": 5,
        "row:resumed_prefill": 1,
        "row:single_token_prompt": 10,
        "row:decode1": 200,
        "row:decode2": 30,
        "mtp_row:tts_local_seed": 30,
        "mtp_row:seed": 20,
        "mtp_row:both": 10,
        "mtp_row:none": 30,
        "order:reverse": 10,
        "order:shuffle": 10,
        "order:interleave": 5,
        "order:decode_first": 5,
        "steps_with_adjacent_decode1": 30,
        "steps_with_split_decode1": 10,
        "padded_steps": 30,
        "payload:new:model_intermediate_buffer": 20,
        "payload:new:additional_information": 20,
        "payload:cached": 30,
        "payload:marker": 20,
        "payload:local": 10,
        "payload:pending_broadcast": 2,
        # what the oracle did with it
        "hook:preprocess": 300,
        "hook:talker_mtp": 200,
        "mtp:seeded_rows_generator": 50,
        "mtp:batched_calls": 5,
        "steps_with_multiple_mtp_calls": 20,
        "generators_dropped": 20,
    }
    short = {k: (cov.get(k, 0), v) for k, v in minimums.items() if cov.get(k, 0) < v}
    assert not short, f"coverage below minimum (got, want): {short}"
    assert cov.get("errors", 0) == 0


def test_every_row_gets_exactly_one_hook_call() -> None:
    for name in ("mtp_scalar_fallback", "mtp_rowgen_batched", "plain_batched_replace"):
        obs, _ = oracle_run(name)
        sc = scenario(SEEDS[name])
        for o in obs:
            step = sc.steps[o.step]
            seen = [
                rid
                for c in o.calls
                if c["hook"] in ("preprocess", "preprocess_decode_batch")
                for rid in c["req_ids"]
            ]
            assert seen == [r.req_id for r in step.rows], (name, step.describe())


def test_hook_kinds_and_policy_behaviour_show_in_observations() -> None:
    # per-row generators: one batched call, seeded and unseeded rows together
    cov = coverage(scenario(SEEDS["mtp_rowgen_batched"]), oracle_run("mtp_rowgen_batched")[0])
    assert cov["hook:preprocess_decode_batch"] > 50 and cov["hook:preprocess_batch"] == NUM_STEPS
    assert cov["mtp:seeded_rows_generators"] > 30 and cov["mtp:unseeded_rows_in_generators"] > 10
    assert cov.get("steps_with_multiple_mtp_calls", 0) == 0

    # 3-tuple batching and no predictor
    cov = coverage(scenario(SEEDS["plain_batched_replace"]), oracle_run("plain_batched_replace")[0])
    assert cov["hook:preprocess_decode_batch"] > 50 and "hook:talker_mtp" not in cov

    # graph-safe + full graph: wrapped, run in FULL mode padded to a capture size
    obs, info = oracle_run("mtp_batched_graph")
    assert info == {"init_wrapper_lookups": 1, "mtp_wrapped": True, "mtp_runtime_mode": "FULL"}
    contexts = [ctx for o in obs for ctx in o.forward_contexts]
    assert contexts and {mode for mode, _ in contexts} == {"FULL"}
    padded = [(c["rows"], c["forward_context"]) for o in obs for c in o.calls if c["hook"] == "talker_mtp"]
    assert any(rows == 4 and ctx == ("FULL", 4) for rows, ctx in padded)
    assert all(
        o.batch_padding_calls[0]["max_num_scheduled_tokens"] == 1 for o in obs if o.batch_padding_calls
    )

    # explicit unsafe: never wrapped, never looked up at init, eager mode; greedy sampling passed
    obs, info = oracle_run("mtp_unsafe_rowgen_greedy")
    assert info == {"init_wrapper_lookups": 0, "mtp_wrapped": False, "mtp_runtime_mode": None}
    mtp_calls = [c for o in obs for c in o.calls if c["hook"] == "talker_mtp"]
    assert mtp_calls and all(c["forward_context"][0] == "NONE" for c in mtp_calls)
    assert {c["sampling"] for c in mtp_calls} == {(False, None, None, None)}

    # legacy auto with a separate talker: wrapped; moss key; sampling params; metadata; forward
    obs, info = oracle_run("mtp_auto_moss_key_forward")
    assert info["mtp_wrapped"] is True
    assert {c["sampling"] for o in obs for c in o.calls if c["hook"] == "talker_mtp"} == {
        (True, 0.9, 32, 1.0)
    }
    assert any("audio_codes" in b for o in obs for b in o.buffers.values())
    hooks = {c["hook"] for o in obs for c in o.calls}
    assert {"preprocess", "talker_mtp", "forward", "update_decode_step_metadata"} <= hooks
    assert {o.forward["type"] for o in obs} == {"OmniOutput", "tuple", "Tensor"}

    # GEN stage: only the forward runs, yet buffers are refreshed from the scheduler
    obs, _ = oracle_run("gen_refresh_forward")
    assert {c["hook"] for o in obs for c in o.calls} == {"forward"}
    assert sum(len(o.buffers) for o in obs) > 100

    # multimodal wrapper: embed_input_ids used, ids still reach the hook, MiMo infos attached
    obs, _ = oracle_run("mm_inputs_mimo")
    calls = [c for o in obs for c in o.calls]
    assert any(c["hook"] == "embed_input_ids" for c in calls)
    pre = [c for c in calls if c["hook"] == "preprocess"]
    assert pre and all("req_id" in c["keys"][0] for c in pre)
    attached = [(c["req_ids"][0], c["mm_features"][0]) for c in pre if "mm_features" in c["keys"][0]]
    assert attached and all(feats and feats[0].startswith(f"mm:{rid}:") for rid, feats in attached)
    assert all(o.ids is not None and o.ids_persistent for o in obs)


# ----------------------------------------------------------------------------- (c)


# Broken oracles, built when a test asks (building them imports vllm-omni, which patches vLLM).


def _reseed_every_step() -> type:
    class _ReseedEveryStep(oracle_runner_class()):  # a realistic bug: generators not kept across steps
        def _talker_mtp_forward(self, decode_req_ids, inputs_embeds, start_offsets=None):
            self._talker_mtp_generators.clear()
            return super()._talker_mtp_forward(decode_req_ids, inputs_embeds, start_offsets)

    return _ReseedEveryStep


def _numpy_computed_count() -> type:
    class _NumpyComputedCount(oracle_runner_class()):  # a realistic bug: np.int32 where an int is due
        def _update_intermediate_buffer(self, req_id, upd):
            super()._update_intermediate_buffer(req_id, upd)
            buf = self.model_intermediate_buffer.get(req_id)
            if isinstance(buf, dict) and "_omni_num_computed_tokens" in buf:
                buf["_omni_num_computed_tokens"] = self.input_batch.num_computed_tokens_cpu[0]

    return _NumpyComputedCount


def test_compare_catches_a_generator_that_is_not_kept() -> None:
    name = "mtp_scalar_fallback"
    good, _ = oracle_run(name)
    bad = run_scenario(_reseed_every_step(), POLICIES[name], scenario(SEEDS[name]))
    with pytest.raises(ObservationMismatch) as err:
        compare_runs(good, bad)
    text = str(err.value)
    assert "difference(s)" in text and "scenario: step" in text and "obs[" in text


def test_compare_checks_scalar_types() -> None:
    name = "mtp_scalar_fallback"
    good, _ = oracle_run(name)
    bad = run_scenario(_numpy_computed_count(), POLICIES[name], scenario(SEEDS[name]), steps=40)
    with pytest.raises(ObservationMismatch, match=r"int vs int32"):
        compare_runs(good[:40], bad)


def test_oracle_to_contract_mapping_drops_only_the_documented_keys() -> None:
    obs, _ = oracle_run("rows_replace_async_forward")
    assert any(ORACLE_EXTRA_KEYS & set(b) for o in obs for b in o.buffers.values())
    for o in obs[:60]:
        stripped = dataclasses.replace(
            o,
            buffers={
                rid: {k: v for k, v in b.items() if k not in ORACLE_EXTRA_KEYS}
                for rid, b in o.buffers.items()
            },
        )
        compare(o, stripped, ORACLE_VS_CONTRACT)
        if any(ORACLE_EXTRA_KEYS & set(b) for b in o.buffers.values()):
            assert differences(o, stripped, IDENTITY)
    # anything else still counts
    o = next(o for o in obs if o.buffers)
    rid = next(iter(o.buffers))
    changed = dataclasses.replace(o, buffers={**o.buffers, rid: {**o.buffers[rid], "request_id": "other"}})
    with pytest.raises(ObservationMismatch, match="request_id"):
        compare(o, changed, ORACLE_VS_CONTRACT)
    tensor_changed = dataclasses.replace(o, embeds=None if o.embeds is None else o.embeds + 1)
    if o.embeds is not None:
        with pytest.raises(ObservationMismatch, match="embeds"):
            compare(o, tensor_changed, ORACLE_VS_CONTRACT)


def test_build_runner_sets_exactly_the_listed_attributes() -> None:
    cls = oracle_runner_class()
    for name in ("mtp_scalar_fallback", "plain_batched_replace"):
        policy = POLICIES[name]
        with harness_patches():
            runner = build_runner(cls, make_model(policy.flags), policy)
        expected = set(RUNNER_ATTRIBUTES) | (set(MTP_ATTRIBUTES) if policy.flags.mtp else set())
        assert set(vars(runner)) == expected, name
        assert runner.has_talker_mtp is policy.flags.mtp
        if policy.flags.mtp:
            assert tuple(runner.talker_mtp_inputs_embeds.gpu.shape) == (16, 8)
            assert runner.talker_mtp_input_ids.gpu.dtype == torch.int32


def test_patches_are_restored() -> None:
    import vllm.forward_context as fc
    import vllm.v1.worker.gpu_model_runner as vllm_runner
    from vllm.platforms import current_platform
    from vllm_omni.platforms import current_omni_platform

    before = (vllm_runner.get_pp_group, fc.set_forward_context, current_platform.get_static_graph_wrapper_cls)
    omni_before = dict(vars(current_omni_platform))
    with harness_patches(), harness_patches():
        assert vllm_runner.get_pp_group().is_first_rank
    after = (vllm_runner.get_pp_group, fc.set_forward_context, current_platform.get_static_graph_wrapper_cls)
    assert after == before and dict(vars(current_omni_platform)) == omni_before


def test_policy_from_plan_maps_plan_fields_to_flags() -> None:
    from types import SimpleNamespace

    from omnigen_testing.oracle.policy_map import Unexpressible, policy_from_plan

    mtp = SimpleNamespace(
        graph="safe",
        output_key=("codes", "audio"),
        output_key_gpu_resident=False,
        per_row_generators="eager_only",
        sampling_defaults={"do_sample": True, "temperature": 0.9, "top_k": 50, "top_p": 1.0},
    )
    plan = SimpleNamespace(
        model="m", stage="s", mtp=mtp, preprocess_hook=True, refresh_every_step=True,
        batch_preprocess_hook=True, decode_batch="mtp", gpu_resident_keys=(("hidden_states", "last"),),
        replace_on_marker=False, multimodal_outputs=True, decode_step_metadata=False,
        attach_request_features=False, async_chunk=False, sync_payloads_before_rows=True,
        make_omni_output=True, query_start_loc=False, set_batch_req_ids=True,
    )  # fmt: skip
    eager = policy_from_plan(plan)
    assert eager.flags.per_row_generators and eager.flags.mtp_graph_safe and eager.flags.batch_hook
    assert eager.subtalker_sampling_params == mtp.sampling_defaults
    assert eager.flags.gpu_resident_keys == frozenset({("hidden_states", "last")})
    assert eager.flags.make_omni_output and eager.flags.set_batch_req_ids and not eager.flags.query_start_loc
    graphed = policy_from_plan(plan, cudagraph="full", subtalker_sampling_params={"do_sample": False})
    assert not graphed.flags.per_row_generators and graphed.subtalker_sampling_params == {"do_sample": False}
    with pytest.raises(Unexpressible):
        policy_from_plan(SimpleNamespace(**{**vars(plan), "refresh_every_step": False}))
