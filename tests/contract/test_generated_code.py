"""The generated code itself: no run-time model probes, only the hooks a stage has, the contract's
method names and signatures, explicit raises (also under ``python -O``).

``tests/test_spec_matrix.py`` checks the shipped classes against the matrix by name; this file
extends that to every config variant the contract tests use, to the AST of the sources, and to
signatures.
"""

from __future__ import annotations

import ast
import inspect
import re

import pytest

from omnigen import paths
from omnigen.runtime import vllm_api
from omnigen_testing.contract_support import (
    HOOK_VARIANTS,
    MTP_VARIANTS,
    ids,
    shipped,
    stage_plan,
    stage_source,
)

from .test_buffers import MERGING, REPLACING
from .test_forward_outputs import METADATA
from .test_mrope_and_features import ATTACH
from .test_payloads import ASYNC_FLIPPED, REQUEST_END

ALL = shipped()
EVERY_VARIANT = list(
    {
        v.id: v
        for v in ALL
        + HOOK_VARIANTS
        + MTP_VARIANTS
        + METADATA
        + REPLACING
        + MERGING
        + ATTACH
        + ASYNC_FLIPPED
        + REQUEST_END
    }.values()
)
PROBE = re.compile(r"\b(?:getattr|hasattr)\(\s*(?:self\.model\b|model\s*,)")
GENERATED_FILES = sorted(p for p in paths.generated_dir().rglob("*.py"))
RUNTIME_FILES = sorted((paths.generated_dir().parent / "omnigen" / "runtime").glob("*.py"))


def model_hooks_used(source: str) -> set[str]:
    """Names read as ``self.model.<name>`` anywhere in a module."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "model"
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"
        ):
            found.add(node.attr)
    return found


def expected_hooks(variant) -> set[str]:
    caps, facts = variant.caps, variant.facts
    hooks = set()
    if caps["preprocess_hook"]:
        hooks.add("preprocess")
    if caps["decode_batch"] != "none":
        hooks.add("preprocess_decode_batch")
    if facts["batch_hook"]:
        hooks.add("preprocess_batch")
    if caps["talker_mtp"]:
        hooks.add("talker_mtp")
    if caps["decode_step_metadata"]:
        hooks.add("update_decode_step_metadata")
        if facts["has_finish"]:
            hooks.add("finish_decode_step_forward")
    # CONTRACT 7: the hooks the real model classes define.
    if caps["postprocess"] is not None:
        hooks.add("postprocess")
    if caps["make_omni_output"]:
        hooks.add("make_omni_output")
    if caps["set_batch_req_ids"]:
        hooks.add("set_batch_req_ids")
    if caps["sampler"] == "model":
        hooks.add("sample")
    if caps["on_requests_finished"]:
        hooks.add("on_requests_finished")
    return hooks


@pytest.mark.parametrize(
    "path",
    GENERATED_FILES + RUNTIME_FILES,
    ids=[str(p.relative_to(paths.generated_dir().parent)) for p in GENERATED_FILES + RUNTIME_FILES],
)
def test_no_runtime_model_probes_in_generated_or_runtime_code(path):
    """Contract preamble: a policy the config fixes is decided when generating, not probed with getattr."""
    text = path.read_text()
    assert not PROBE.findall(text), f"{path.name} probes the model: {PROBE.findall(text)}"


@pytest.mark.parametrize("variant", EVERY_VARIANT, ids=ids(EVERY_VARIANT))
def test_each_variant_calls_exactly_the_hooks_its_config_declares(variant):
    """No probes, and a stage without MTP / decode batching / metadata has no code that calls them."""
    source = stage_source(variant.model, variant.stage, variant.overrides)
    assert not PROBE.findall(source)
    assert model_hooks_used(source) == expected_hooks(variant)
    caps = variant.caps
    assert ("talker_mtp" in source) is caps["talker_mtp"]
    assert ("preprocess_decode_batch" in source) is (caps["decode_batch"] != "none")
    assert ("check_contiguous_runs" in source) is (caps["decode_batch"] == "plain")
    assert ("is_replace_marker" in source) is caps["replace_on_marker"]
    assert ("_attach_request_features" in source) is caps["attach_request_features"]
    assert ("update_decode_step_metadata" in source) is caps["decode_step_metadata"]
    assert ("restore_flattened_omni_output" in source) is caps["multimodal_outputs"]
    graph_code = "full_graph_wrapper_cls" in source or "is_full_graph_wrapped" in source
    assert graph_code is (caps["mtp_graph"] == "safe"), "unsafe / no MTP: no graph-wrapper code at all"
    if caps["talker_mtp"]:
        assert ("mtp.forward_row_by_row(" in source) is (caps["mtp_per_row_generators"] != "always")


@pytest.mark.parametrize("variant", EVERY_VARIANT, ids=ids(EVERY_VARIANT))
def test_variants_have_the_capabilities_their_overrides_state(variant):
    """The expectations of the variant tests: each override does what the test expects of it."""
    actual = stage_plan(variant.model, variant.stage, variant.overrides).capabilities()
    wrong = {k: (actual[k], v) for k, v in variant.caps.items() if actual[k] != v}
    assert not wrong, f"(plan, expected) = {wrong}"


def test_generated_runners_and_phase_checks_use_explicit_raises():
    """3.5: no ``assert`` statements where the contract needs errors (they vanish under python -O)."""
    for path in GENERATED_FILES + RUNTIME_FILES:
        tree = ast.parse(path.read_text())
        asserts = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
        assert not asserts, f"{path}: assert at lines {asserts}"


# The checks of optimized_check.FAULT_CHECKS (issue 9: hook results, MTP offsets, raising hooks).
FAULT_MARKERS = (
    "MTP_OFFSETS_RAISED",
    "MTP_OFFSETS_OUT_OF_BOUNDS_RAISED",
    "BATCH_ARITY_RAISED",
    "BATCH_WIDTH_RAISED",
    "BATCH_DTYPE_RAISED",
    "BATCH_IDS_DTYPE_RAISED",
    "BATCH_UPDATE_RAISED",
    "BATCH_MTP_HIDDEN_RAISED",
    "BATCH_RAISE_UNDONE",
    "STEP_HOOK_RAISE_UNDONE",
    "ROW_ARITY_RAISED",
    "ROW_IDS_DTYPE_RAISED",
    "ROW_MTP_INPUTS_RAISED",
)


def test_invalid_batches_raise_under_python_O(optimized_run):
    """3.5: the RuntimeError / ValueError hold under ``python -O`` (see optimized_check.py)."""
    code, out = optimized_run
    assert code == 0, out[-3000:]
    for marker in ("OPTIMIZED", "CONTIGUITY_RAISED", "SHORT_OUTPUT_RAISED", *FAULT_MARKERS):
        assert marker in out, out[-3000:]


# -- names and signatures ------------------------------------------------------------------------

REQ = inspect.Parameter.empty
ANY = object()
VAR_KW = "**"

# docs/contract.md's names: (parameter name or ANY, default or REQ or ANY), VAR_KW for **kwargs.
COMMON = {
    "_model_forward": [
        ("input_ids", None),
        ("positions", None),
        ("intermediate_tensors", None),
        ("inputs_embeds", None),
        VAR_KW,
    ],
    "extract_multimodal_outputs": [(ANY, REQ)],
    "_preprocess": [("scheduler_output", REQ), ("num_input_tokens", REQ), ("intermediate_tensors", None)],
    "_update_intermediate_buffer": [("req_id", REQ), ("update", REQ)],
    "_update_additional_information": [("scheduler_output", REQ)],
    "_update_streaming_input_additional_info": [("new_req_data", REQ), ("req_id", REQ)],
    "_sync_local_stage_payloads": [],
    "accumulate_full_payload_output": [("req_id", REQ), ("pooler_output", REQ), ("request", REQ)],
    "_materialize_full_payload_entry": [("entry", REQ)],
    "_should_accumulate_full_payload_output": [],
    "_should_defer_full_payload_d2h": [],
    "_build_omni_step_outputs": [
        ("pooler_inter", REQ),
        ("pooler_client", REQ),
        ("defer_full_payload_d2h", ANY),
    ],
}
BY_FEATURE = {
    "talker_mtp": {
        "_init_talker_mtp": [],
        "_talker_mtp_forward": [("req_ids", REQ), ("inputs_embeds", REQ), ("start_offsets", None)],
    },
    "mrope": {"_filter_mrope_kwargs_for_model": [("model", REQ), ("kwargs", REQ)]},
    "attach_request_features": {
        "_attach_request_features": [("req_state", REQ), ("req_infos", REQ), ("req_id", REQ)],
    },
}
STATE = {
    "model_intermediate_buffer": dict,
    "_pending_full_payload_send": dict,
    "_local_stage_payload_cache": dict,
    "_full_payload_pending_broadcast_req_ids": set,
    "_talker_mtp_generators": dict,
}


def check_signature(method, expected):
    params = list(inspect.signature(method).parameters.values())
    var_kw = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    fixed = [
        p for p in params if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    ]
    wants_var_kw = VAR_KW in expected
    expected = [e for e in expected if e is not VAR_KW]
    assert bool(var_kw) is wants_var_kw, f"**kwargs: {params}"
    assert len(fixed) == len(expected), f"parameters {params} vs {expected}"
    for param, (name, default) in zip(fixed, expected, strict=True):
        if name is not ANY:
            assert param.name == name, f"{param.name} != {name}"
        if default is not ANY:
            assert param.default is default or param.default == default, (
                f"{param.name} default {param.default!r}"
            )


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
def test_contract_methods_exist_with_their_signatures(variant):
    """The names and signatures docs/contract.md lists, on every class that has the feature."""
    cls = variant.cls()
    runner = object.__new__(cls)
    methods = dict(COMMON)
    for feature, named in BY_FEATURE.items():
        if variant.caps[feature]:
            methods.update(named)
        else:
            for name in named:
                assert not hasattr(cls, name), f"{name} on a stage without {feature}"
    for name, expected in methods.items():
        assert callable(getattr(cls, name, None)), f"missing {name}"
        check_signature(getattr(runner, name), expected)


@pytest.mark.parametrize("variant", ALL, ids=ids(ALL))
def test_a_constructed_runner_keeps_the_contract_state(variant, monkeypatch):
    """The omni state the contract names exists, empty, on a runner vLLM constructs."""
    monkeypatch.setattr(vllm_api.GPUModelRunner, "__init__", lambda self, *args, **kwargs: None)
    runner = variant.cls()("vllm_config", "device")
    for name, kind in STATE.items():
        value = getattr(runner, name)
        assert type(value) is kind and not value, name
    assert runner.omni_prefix_cache is None
