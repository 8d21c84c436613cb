"""Every plan and every generated class against tests/spec_matrix.yaml (hand-written from docs/models.md).

A config change that silently flips a capability makes a plan, or the class generated from
it, disagree with the matrix.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import yaml

from omnigen import paths, pipeline

MATRIX = yaml.safe_load((Path(__file__).parent / "spec_matrix.yaml").read_text())
CELLS = [(model, stage) for model, stages in MATRIX.items() for stage in stages["_order"]]


def test_matrix_covers_exactly_the_configured_models_and_stages():
    assert sorted(MATRIX) == paths.model_names()
    for model, entry in MATRIX.items():
        plan = pipeline.model_plan(model)
        assert [s.stage for s in plan.stages] == entry["_order"], model
        assert sorted(k for k in entry if k != "_order") == sorted(entry["_order"]), model


@pytest.mark.parametrize(("model", "stage"), CELLS, ids=[f"{m}.{s}" for m, s in CELLS])
def test_plan_has_the_capabilities_the_matrix_states(model, stage):
    expected = MATRIX[model][stage]
    actual = pipeline.model_plan(model).stage(stage).capabilities()
    assert sorted(actual) == sorted(expected), "capability keys differ"
    wrong = {key: (actual[key], expected[key]) for key in expected if actual[key] != expected[key]}
    assert not wrong, f"{model}.{stage}: (plan, matrix) = {wrong}"


def _own(cls: type, name: str) -> bool:
    """Whether the generated class itself (not a base) defines ``name``."""
    return name in vars(cls)


@pytest.mark.parametrize(("model", "stage"), CELLS, ids=[f"{m}.{s}" for m, s in CELLS])
def test_generated_class_has_exactly_the_matrix_paths(model, stage):
    caps = MATRIX[model][stage]
    plan = pipeline.model_plan(model).stage(stage)
    module = importlib.import_module(plan.module)
    runner = getattr(module, plan.runner_class)
    source = inspect.getsource(module)

    assert _own(runner, "_talker_mtp_forward") is caps["talker_mtp"]
    assert _own(runner, "_init_talker_mtp") is caps["talker_mtp"]
    assert ("talker_mtp" in source) is caps["talker_mtp"]
    assert _own(runner, "_preprocess_rows") is caps["preprocess_hook"]
    assert ("preprocess_decode_batch" in source) is (caps["decode_batch"] != "none")
    assert ("index_select" in source) is (caps["decode_batch"] == "mtp")
    assert ("check_contiguous_runs" in source) is (caps["decode_batch"] == "plain")
    assert _own(runner, "_update_additional_information") is caps["replace_on_marker"]
    assert ("is_replace_marker" in source) is caps["replace_on_marker"]
    assert _own(runner, "_attach_request_features") is caps["attach_request_features"]
    assert _own(runner, "_filter_mrope_kwargs_for_model") is caps["mrope"]
    assert ("update_decode_step_metadata" in source) is caps["decode_step_metadata"]
    assert ("restore_flattened_omni_output" in source) is caps["multimodal_outputs"]
    assert ("self._update_additional_information(scheduler_output)" in source) is caps["refresh_every_step"]
    assert runner.GPU_RESIDENT_KEYS == frozenset(tuple(k.split(".")) for k in caps["gpu_resident_keys"])
    if caps["talker_mtp"]:
        assert runner.MTP_OUTPUT_KEY == tuple(caps["mtp_output_key"])
        assert bool(runner.MTP_SAMPLING_DEFAULTS) is caps["mtp_sampling_defaults"]
        assert ("full_graph_wrapper_cls" in source) is (caps["mtp_graph"] == "safe")
        assert f"self.model_config.{caps['mtp_hidden_size_from']}" in source
        assert ("mtp.forward_row_by_row(" in source) is (caps["mtp_per_row_generators"] != "always")

    bare = object.__new__(runner)
    bare.omni_prefix_cache = None
    assert bare._should_accumulate_full_payload_output() is caps["accumulates_full_payload"]
    assert bare._should_defer_full_payload_d2h() is caps["defers_full_payload_d2h"]
    assert ("_accumulate_request_payloads" in source) is caps["accumulates_full_payload"]

    # CONTRACT 7: each path exists exactly where the matrix says.
    generation = caps["kind"] == "generation"
    assert _own(runner, "sample_tokens") is generation
    assert _own(runner, "_dummy_sampler_run") is generation
    assert _own(runner, "_finish_step") is not generation
    assert ("self.model.postprocess(" in source) is (caps["postprocess"] is not None)
    if caps["postprocess"] is not None:
        uses = caps["postprocess"]
        assert ("step.hidden[start:end]" in source) is uses["hidden_states"]
        assert ("multimodal_outputs=step.payload" in source) is uses["multimodal_outputs"]
        assert ("postprocess_infos" in source) is uses["req_infos"]
    assert ("self.model.make_omni_output(" in source) is caps["make_omni_output"]
    assert ("include_hidden=True" in source) is caps["payload_hidden"]
    assert ('forward_kwargs["request_token_spans"]' in source) is caps["request_token_spans"]
    assert ('forward_kwargs["omni_query_start_loc"]' in source) is caps["query_start_loc"]
    assert ("self.model.set_batch_req_ids(" in source) is caps["set_batch_req_ids"]
    # execute_model is wrapped for the sampling metadata of 7.7, or, on a generation stage, to
    # answer vLLM's logits call with none (7.3: nothing is sampled).
    assert _own(runner, "execute_model") is (caps["logits_sampling_metadata"] or caps["kind"] == "generation")
    if caps["kind"] == "generation":
        assert "vllm_api.logits_skipped(self.model)" in source
    assert _own(runner, "_sample") is (caps["sampler"] == "model")
    assert _own(runner, "_update_states") is caps["on_requests_finished"]
    assert _own(runner, "_init_mrope_positions") is caps["mrope_fallback"]
    assert ('forward_kwargs["seq_token_counts"]' in source) is (
        "seq_token_counts" in caps["generation_kwargs"]
    )
    assert ('forward_kwargs["request_ids"]' in source) is ("request_ids" in caps["generation_kwargs"])

    worker = getattr(module, plan.worker_class)
    assert worker.runner_class is runner
    assert worker.model_config_fields == caps["model_config"]
    assert worker.text_config_name == caps["text_config"]


@pytest.mark.parametrize(
    ("model", "stage", "override"),
    [
        ("qwen3_tts", "qwen3_tts", "postprocess.hook=false"),
        ("higgs_audio_v3", "talker", "sampler=vllm"),
        ("qwen3_tts", "code2wav", "outputs.make_omni_output=false"),
        ("qwen3_omni", "talker", "model_config.hf_config_name=null"),
    ],
)
def test_a_config_that_drops_a_real_model_hook_disagrees_with_the_matrix(model, stage, override):
    """CONTRACT 7: turning off a hook the model class needs is a matrix failure, not a silent change."""
    from omnigen import api

    plan = api.stage_plan(model, stage, [f"model.stages.{stage}.{override}"])
    actual, expected = plan.capabilities(), MATRIX[model][stage]
    assert {key for key in expected if actual[key] != expected[key]}, override


@pytest.mark.parametrize(("model", "stage"), CELLS, ids=[f"{m}.{s}" for m, s in CELLS])
def test_generated_v2_target_has_exactly_the_matrix_paths(model, stage):
    """The stage's Model Runner V2 target (``<stage>_v2.py``): the same paths as its V1 runner,
    on the V2 seams the matrix's v2_* keys name (docs/model-runner-v2.md)."""
    caps = MATRIX[model][stage]
    plan = pipeline.model_plan(model).stage(stage)
    module = importlib.import_module(plan.v2_module)
    state = getattr(module, plan.v2.state_class)
    runner = getattr(module, plan.v2.runner_class)
    source = inspect.getsource(module)
    assert runner.MODEL_STATE is state

    # The ModelState hooks vLLM calls: the ones the matrix names, and no more.
    hooks = set(caps["v2_state_hooks"])
    assert _own(state, "add_request")
    assert state.USES_INPUTS_EMBEDS is ("prepare_inputs_embeds" in hooks) is caps["preprocess_hook"]
    assert _own(state, "capture_inner_cudagraphs") is ("capture_inner_cudagraphs" in hooks)
    assert _own(state, "custom_sampler") is ("custom_sampler" in hooks) is (caps["sampler"] == "model")
    rope = {"default": None, "text_only": "TextOnlyRopeState", "filtered_kwargs": "FilteredKwargsRopeState"}
    expected_rope = rope[caps["v2_rope_state"]]
    assert (state.ROPE_STATE and state.ROPE_STATE.__name__) == expected_rope

    # The contract paths the V1 runner has, generated from the same text.
    assert _own(state, "_talker_mtp_forward") is caps["talker_mtp"]
    assert _own(state, "_init_talker_mtp") is caps["talker_mtp"]
    assert _own(state, "_preprocess_rows") is caps["preprocess_hook"]
    assert ("preprocess_decode_batch" in source) is (caps["decode_batch"] != "none")
    assert ("is_replace_marker" in source) is (caps["replace_on_marker"] and caps["refresh_every_step"])
    assert _own(state, "_merge_cached_payloads") is caps["refresh_every_step"]
    assert _own(state, "_attach_request_features") is caps["attach_request_features"]
    assert _own(state, "_filter_mrope_kwargs_for_model") is caps["mrope"]
    assert ("update_decode_step_metadata" in source) is caps["decode_step_metadata"]
    assert ("restore_flattened_omni_output" in source) is caps["multimodal_outputs"]
    assert ("self.model.make_omni_output(" in source) is caps["make_omni_output"]
    assert ("self.model.set_batch_req_ids(" in source) is caps["set_batch_req_ids"]
    assert ("self.model.postprocess(" in source) is (caps["postprocess"] is not None)
    assert state.GPU_RESIDENT_KEYS == frozenset(tuple(k.split(".")) for k in caps["gpu_resident_keys"])
    if caps["talker_mtp"]:
        assert state.MTP_OUTPUT_KEY == tuple(caps["mtp_output_key"])
        assert ("_mtp_dispatch" in source) and ("_determine_batch_execution_and_padding" not in source)
        assert ("mtp.forward_row_by_row(" in source) is (caps["mtp_per_row_generators"] != "always")
    assert ('forward_kwargs["seq_token_counts"]' in source) is (
        "seq_token_counts" in caps["generation_kwargs"]
    )
    assert ('forward_kwargs["request_ids"]' in source) is ("request_ids" in caps["generation_kwargs"])
    assert ('forward_kwargs["omni_query_start_loc"]' in source) is caps["query_start_loc"]
    assert ('forward_kwargs["request_token_spans"]' in source) is caps["request_token_spans"]

    bare = object.__new__(state)
    bare.omni_prefix_cache = None
    assert bare._should_accumulate_full_payload_output() is caps["accumulates_full_payload"]
    assert bare._should_defer_full_payload_d2h() is caps["defers_full_payload_d2h"]

    generation = caps["kind"] == "generation"
    assert _own(state, "_finish_generation_step") is generation
    assert _own(state, "_finish_step") is not generation
    assert _own(runner, "sample_tokens") is (generation or caps["logits_sampling_metadata"])
    assert _own(runner, "_dummy_sampler_run") is generation
    assert _own(runner, "_on_requests_finished") is caps["on_requests_finished"]

    # The worker builds it by name, with the V2 decisions of the plan.
    worker = getattr(importlib.import_module(plan.module), plan.worker_class)
    assert worker.runner_v2 == plan.v2.runner_class
    assert worker.runner_v2_class() is runner
    assert worker.v2_narrow_full_graphs is (caps["v2_full_graph"] == "narrowed")
    assert worker.v2_jit_warmup is caps["v2_jit_warmup"]


@pytest.mark.parametrize(("model", "stage"), CELLS, ids=[f"{m}.{s}" for m, s in CELLS])
def test_the_matrix_v2_keys_follow_its_rules(model, stage):
    """The v2_* keys are derived from the others by the rules the matrix's header states (the
    contract tests derive a config variant's the same way)."""
    from omnigen_testing.contract_support import derived_v2_keys

    caps = MATRIX[model][stage]
    assert {k: caps[k] for k in derived_v2_keys(caps)} == derived_v2_keys(caps)
