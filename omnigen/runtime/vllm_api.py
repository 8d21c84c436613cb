"""Everything omnigen takes from vLLM's internal API, in one place.

A rebase onto another vLLM version changes this module (and the templates),
not every generated model. Generated code reaches vLLM only through these names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from vllm import envs
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.sequence import IntermediateTensors
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
"""vLLM's V1 model runner, which every generated V1 runner subclasses (vLLM 0.34 deleted it)."""
V1_REMOVED = "Model Runner V1 has been removed"
"""vLLM's own words for it (``Platform.validate_environ`` of a vLLM without V1)."""


def v1_runner_available() -> bool:
    """Whether the installed vLLM still has its V1 model runner (the module exists)."""
    return importlib.util.find_spec(V1_RUNNER_MODULE) is not None


class V1RunnerRemoved:
    """What ``GPUModelRunner`` names where vLLM has no V1 runner: a generated V1 runner module
    still imports (``omnigen explain`` and ``check`` read it), but building one fails with
    vLLM's reason. The worker never builds it there: it picks the V2 target
    (``runner_target``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{type(self).__name__} is an omnigen V1 runner, and this vLLM cannot run it: {V1_REMOVED} "
            f"({V1_RUNNER_MODULE} does not exist). Load the stage through its generated worker, "
            "which builds the stage's V2 target (<stage>_v2.py) on this vLLM"
        )


if v1_runner_available():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
else:  # vLLM without Model Runner V1 (0.34 on): the V1 side is refused with vLLM's reason.
    GPUModelRunner = V1RunnerRemoved  # type: ignore[misc, assignment]

__all__ = [
    "CUDAGraphMode",
    "GENERATION_DONE_TOKEN",
    "GPUModelRunner",
    "IntermediateTensors",
    "STEP_PAYLOADS_ATTR",
    "apply_stage_model_config",
    "attach_step_payloads",
    "compute_logits_with_sampling_metadata",
    "logits_skipped",
    "dummy_run_forces_eager",
    "full_graph_wrapper_cls",
    "generation_step_output",
    "is_full_graph_wrapped",
    "keep_v1_model_runner",
    "runner_target",
    "set_forward_context",
    "step_payloads_of",
]


@functools.cache
def full_graph_wrapper_cls() -> type:
    """The platform's full-graph wrapper class (``CUDAGraphWrapper`` on CUDA)."""
    from vllm.platforms import current_platform

    return resolve_obj_by_qualname(current_platform.get_static_graph_wrapper_cls())


@functools.cache
def _dummy_run_signature() -> inspect.Signature:
    return inspect.signature(GPUModelRunner._dummy_run)


def dummy_run_forces_eager(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether vLLM's ``_dummy_run(num_tokens, *args, **kwargs)`` runs eager: a profile run, or a
    warm-up with ``cudagraph_runtime_mode=NONE`` (vLLM passes ``force_eager`` for both)."""
    bound = _dummy_run_signature().bind(None, 0, *args, **kwargs)
    bound.apply_defaults()
    arguments = bound.arguments
    return bool(arguments["is_profile"]) or arguments["cudagraph_runtime_mode"] == CUDAGraphMode.NONE


def is_full_graph_wrapped(module: object) -> bool:
    """Whether ``module`` is wrapped in the platform's full-graph wrapper.

    On a platform without a concrete wrapper (vLLM's CPU platform names a typing Protocol,
    which ``isinstance`` rejects), nothing can be wrapped.
    """
    try:
        return isinstance(module, full_graph_wrapper_cls())
    except TypeError:
        return False


logger = init_logger(__name__)


# -- vLLM's V1 model runner (the generated runners are V1 runners) ----------------------------


def keep_v1_model_runner(owner: Any) -> None:
    """Make ``owner`` (a vLLM worker or scheduler, after vLLM's ``__init__``) use vLLM's V1 runner.

    vLLM's worker and scheduler each copy ``vllm_config.use_v2_model_runner`` into
    ``self.use_v2_model_runner`` when they are built and branch on it later: the worker for the
    runner it constructs, the scheduler for the shape of its ``SchedulerOutput``. The generated
    runners subclass the V1 ``GPUModelRunner``, so both must take the V1 branches; vLLM picks V2
    by default where it can (a CUDA machine with Triton). A setting that needs V2 is refused.
    """
    if not getattr(owner, "use_v2_model_runner", False):
        return
    who = type(owner).__name__
    vllm_config = owner.vllm_config
    needs_v2 = [
        name
        for name, value in (
            ("VLLM_USE_V2_MODEL_RUNNER=1", getattr(envs, "VLLM_USE_V2_MODEL_RUNNER", None) is True),
            (
                "attention_config.hisparse_config",
                getattr(getattr(vllm_config, "attention_config", None), "hisparse_config", None) is not None,
            ),
            ("watermark_config", getattr(vllm_config, "watermark_config", None) is not None),
        )
        if value
    ]
    if needs_v2:
        choice = runner_target(vllm_config)
        raise RuntimeError(
            f"{who} serves an omnigen V1 runner here ({choice.reason}), but {', '.join(needs_v2)} "
            "asks for vLLM's V2 model runner; unset it to serve this stage"
        )
    owner.use_v2_model_runner = False
    logger.info("%s: using vLLM's V1 model runner (the generated runner is a V1 runner)", who)


@dataclasses.dataclass(frozen=True)
class RunnerChoice:
    """Which generated target a stage runs on this vLLM, and why (``runner_target``)."""

    target: str
    """``v1`` (the generated runner, ``<stage>.py``) or ``v2`` (the V2 target, ``<stage>_v2.py``)."""
    reason: str


V2_SEAMS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # (module, qualified name, the parameters the V2 target passes or overrides by name)
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.__init__", ("vllm_config", "device")),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.load_model", ()),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.finish_requests", ("scheduler_output",)),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.update_requests", ("scheduler_output",)),
    (
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner.execute_model",
        ("scheduler_output", "intermediate_tensors"),
    ),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sample_tokens", ("grammar_output",)),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.postprocess_num_computed_tokens", ("input_batch",)),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner._dummy_sampler_run", ("hidden_states",)),
    (
        "vllm.v1.worker.gpu.model_runner",
        "init_model_state",
        ("vllm_config", "model", "encoder_cache", "device"),
    ),
    (
        "vllm.v1.worker.gpu.model_states.default",
        "DefaultModelState.__init__",
        ("vllm_config", "model", "encoder_cache", "device"),
    ),
    ("vllm.v1.worker.gpu.model_states.default", "get_rope_state", ()),
    ("vllm.v1.worker.gpu.model_states.interface", "ModelState.add_request", ("req_index", "new_req_data")),
    ("vllm.v1.worker.gpu.model_states.interface", "ModelState.remove_request", ("req_id",)),
    (
        "vllm.v1.worker.gpu.model_states.interface",
        "ModelState.preprocess_state",
        ("input_batch", "block_tables", "kv_cache_config", "num_computed_tokens"),
    ),
    (
        "vllm.v1.worker.gpu.model_states.interface",
        "ModelState.prepare_inputs_embeds",
        ("scheduled_encoder_inputs", "input_batch", "req_states"),
    ),
    ("vllm.v1.worker.gpu.model_states.interface", "ModelState.dummy_inputs_embeds", ("num_tokens",)),
    ("vllm.v1.worker.gpu.model_states.interface", "ModelState.prepare_inputs", ("input_batch", "req_states")),
    (
        "vllm.v1.worker.gpu.model_states.interface",
        "ModelState.prepare_dummy_inputs",
        ("num_reqs", "num_tokens"),
    ),
    (
        "vllm.v1.worker.gpu.model_states.interface",
        "ModelState.capture_inner_cudagraphs",
        ("input_buffers", "block_tables", "attn_groups", "kv_cache_config"),
    ),
    ("vllm.v1.worker.gpu.model_states.interface", "ModelState.custom_sampler", ("sampler",)),
    ("vllm.v1.worker.gpu.input_batch", "InputBatch.make_dummy", ("num_reqs", "num_tokens", "input_buffers")),
    ("vllm.v1.worker.gpu.states", "RequestState.__init__", ()),
    ("vllm.v1.worker.gpu.async_utils", "AsyncOutput.get_output", ()),
)
"""The vLLM Model Runner V2 seams the generated V2 target is built on (docs/model-runner-v2.md,
section 8, lists every name it reads). ``runner_target`` picks V2 only where each is present
with these parameter names; ``tests/test_vllm_surface.py`` checks the full list per version."""


@functools.cache
def v2_missing_seams() -> tuple[str, ...]:
    """The seams of ``V2_SEAMS`` the installed vLLM lacks (empty: the V2 target can run here)."""
    missing = []
    for module_name, qualname, params in V2_SEAMS:
        label = f"{module_name}:{qualname}"
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError:
            missing.append(label)
            continue
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is None:
            missing.append(label)
            continue
        if params:
            try:
                accepted = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                missing.append(label)
                continue
            if any(name not in accepted for name in params):
                missing.append(f"{label}({', '.join(params)})")
    return tuple(missing)


def runner_target(vllm_config: Any) -> RunnerChoice:
    """The target a stage runs on the installed vLLM, detected from its features, never from its
    version string: the same answer in the worker (which runner it builds) and in the engine
    core (the scheduler's output shape), which both hold this ``vllm_config``.

    1. vLLM has no V1 runner (``vllm.v1.worker.gpu_model_runner`` is gone): V2, which must then
       have every seam of ``V2_SEAMS`` (else nothing can serve the stage: an error names them).
    2. vLLM chose its V1 runner (``VllmConfig.use_v2_model_runner`` false or absent: its
       environment variable, no Triton, a feature V2 lacks): V1.
    3. vLLM chose V2 and has every seam the V2 target uses: V2.
    4. Else V1, and ``keep_v1_model_runner`` makes vLLM's worker and scheduler take it.
    """
    if not v1_runner_available():
        missing = v2_missing_seams()
        if missing:
            raise RuntimeError(
                f"this vLLM has no V1 model runner ({V1_REMOVED}) and its Model Runner V2 lacks what "
                f"omnigen's V2 target is built on: {', '.join(missing)}; serve with a vLLM that "
                "has one of the two (tests/test_vllm_surface.py shows what moved)"
            )
        return RunnerChoice("v2", f"vLLM has no V1 model runner: {V1_REMOVED}")
    if not getattr(vllm_config, "use_v2_model_runner", False):
        return RunnerChoice("v1", "vLLM chose its V1 model runner (VllmConfig.use_v2_model_runner is false)")
    missing = v2_missing_seams()
    if missing:
        return RunnerChoice(
            "v1",
            "vLLM chose Model Runner V2, but it lacks what omnigen's V2 target is built on "
            f"({', '.join(missing)}); the stage runs its V1 runner",
        )
    return RunnerChoice("v2", "vLLM chose Model Runner V2, which has every seam the V2 target uses")


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# -- Deployment fields on vLLM's ModelConfig (CONTRACT 7.5) ------------------------------------


def apply_stage_model_config(
    model_config: Any, fields: Mapping[str, Any], text_config_name: str | None
) -> None:
    """Set the fields a stage's model reads from ``model_config`` and, for a stage whose model
    serves several stages, make ``hf_text_config`` the stage's own sub-config.

    vLLM derives the persistent input widths and the vocabulary from ``model_arch_config``,
    which it computes from ``hf_text_config`` when the config is built; both are re-derived
    here, before the runner (and its buffers) and the model exist.
    """
    for name, value in fields.items():
        setattr(model_config, name, value)
    if text_config_name is None:
        return
    stage_config = getattr(model_config.hf_config, text_config_name, None)
    if stage_config is None:
        raise ValueError(
            f"the checkpoint's config ({type(model_config.hf_config).__name__}) has no "
            f"{text_config_name!r}, which this stage's model_config.hf_config_name names; "
            "serve the stage with the checkpoint it was generated for, or fix the config key"
        )
    model_config.hf_text_config = stage_config.get_text_config()
    model_config.model_arch_config = model_config.get_model_arch_config()


# -- Logits with sampling metadata (CONTRACT 7.7) ----------------------------------------------


@contextlib.contextmanager
def compute_logits_with_sampling_metadata(model: Any, sampling_metadata: Callable[[], Any]) -> Iterator[None]:
    """While vLLM's ``execute_model`` runs, its ``model.compute_logits(hidden)`` call also passes
    ``sampling_metadata=`` (read when the call happens: vLLM builds it during the step).

    vLLM calls ``compute_logits`` with the hidden states only; the bound method is shadowed on
    the model instance for the step and the shadow removed afterwards.
    """
    bound = model.compute_logits

    def compute_logits(hidden_states: Any) -> Any:
        return bound(hidden_states, sampling_metadata=sampling_metadata())

    model.compute_logits = compute_logits
    try:
        yield
    finally:
        del model.compute_logits


# -- Generation stages (CONTRACT 7.3) ----------------------------------------------------------


@contextlib.contextmanager
def logits_skipped(model: Any) -> Iterator[None]:
    """While vLLM's ``execute_model`` runs a generation stage's step, ``model.compute_logits``
    answers None: the step samples nothing (7.3). vLLM asks for logits all the same; vllm-omni's
    generation runner never does, and some classes have none for that stage (Qwen3-Omni's
    wrapper delegates to its code2wav module, which has no ``compute_logits``)."""

    def compute_logits(hidden_states: Any, *args: Any, **kwargs: Any) -> None:
        return None

    model.compute_logits = compute_logits
    try:
        yield
    finally:
        del model.compute_logits


GENERATION_DONE_TOKEN = 0
"""The one token a generation request's step emits once all its inputs have run: vLLM's
scheduler then finishes a request sent with ``max_tokens=1`` (nothing is sampled)."""


# -- The output channel (CONTRACT 8.1) --------------------------------------------------------

STEP_PAYLOADS_ATTR = "omnigen_step_payloads"
"""The attribute of a step's ``ModelRunnerOutput`` that carries ``{req_id: {dotted key: host
tensor}}``, the rows the stage publishes this step. ``ModelRunnerOutput`` is a plain dataclass:
vLLM pickles it whole from the worker process to the engine core, so the attribute arrives."""


def attach_step_payloads(output: Any, rows: Mapping[str, Mapping[str, Any]] | None) -> Any:
    """``output`` carrying this step's published rows for the scheduler (``OmniScheduler``).

    An asynchronous output hands the scheduler its inner output (``get_output``), so the rows go
    there: V1's ``AsyncGPUModelRunnerOutput._model_runner_output``, V2's
    ``AsyncOutput.model_runner_output``. vLLM's shared ``EMPTY_MODEL_RUNNER_OUTPUT`` is never
    written to: a copy carries them instead.
    """
    if not rows or output is None:
        return output
    if output is EMPTY_MODEL_RUNNER_OUTPUT:
        output = dataclasses.replace(output)
    inner = getattr(output, "_model_runner_output", None)
    if inner is None and not isinstance(output, ModelRunnerOutput):
        inner = getattr(output, "model_runner_output", None)
    setattr(output if inner is None else inner, STEP_PAYLOADS_ATTR, dict(rows))
    return output


def step_payloads_of(model_runner_output: Any) -> Mapping[str, Mapping[str, Any]]:
    """The rows a step's output carries (``{}`` when the stage published nothing)."""
    return getattr(model_runner_output, STEP_PAYLOADS_ATTR, None) or {}


def generation_step_output(runner: Any, scheduler_output: Any, kv_connector_output: Any) -> ModelRunnerOutput:
    """vLLM's step output for a generation stage: no sampling, ``GENERATION_DONE_TOKEN`` for each
    request whose inputs are all in after this step, nothing for one still being chunked in."""
    req_ids = list(runner.input_batch.req_ids)
    scheduled = scheduler_output.num_scheduled_tokens
    sampled: list[list[int]] = []
    for req_id in req_ids:
        state = runner.requests[req_id]
        done = state.num_computed_tokens + scheduled.get(req_id, 0) >= state.num_prompt_tokens
        sampled.append([GENERATION_DONE_TOKEN] if done else [])
    output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: index for index, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_connector_output,
    )
    return attach_step_payloads(output, runner.published_step_payloads())


# -- The model's own sampler (CONTRACT 7.4) ----------------------------------------------------


def model_sampler_metadata(input_batch: Any) -> Any:
    """vLLM's sampling metadata with each request's output-token history filled in.

    vLLM fills ``output_token_ids`` only when penalties or logits processors need it; a model
    that samples for itself (delay patterns, repetition rules) reads the history. Tokens still
    in flight (``-1`` placeholders of async scheduling) are left out.
    """
    metadata = input_batch.sampling_metadata
    history = [
        list(tokens[: tokens.index(-1)] if -1 in tokens else tokens)
        for tokens in (input_batch.req_output_token_ids[i] or [] for i in range(input_batch.num_reqs))
    ]
    if history == metadata.output_token_ids:
        return metadata
    return dataclasses.replace(metadata, output_token_ids=history)


class _EmbeddingsFedModel:
    """The runner's model for one dummy run: a call without ``inputs_embeds`` gets the runner's
    persistent embeddings for as many rows as it has ids; every other attribute is the model's."""

    def __init__(self, model: Any, runner: Any) -> None:
        self._model = model
        self._runner = runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, input_ids: Any = None, inputs_embeds: Any = None, **kwargs: Any) -> Any:
        if inputs_embeds is None and input_ids is not None:
            inputs_embeds = self._runner.inputs_embeds.gpu[: input_ids.shape[0]]
        return self._model(*args, input_ids=input_ids, inputs_embeds=inputs_embeds, **kwargs)


@contextlib.contextmanager
def dummy_runs_feed_embeddings(runner: Any) -> Iterator[None]:
    """Within: ``GPUModelRunner._dummy_run`` calls the model with the runner's persistent
    ``inputs_embeds`` beside the ids, as a step of a stage with a preprocess hook does (vLLM's
    dummy run passes ids only to a text model). vLLM compiles the model once, from its warm-up
    dummy run, without re-checking Dynamo's guards, and captures CUDA graphs from dummy runs:
    made on ids alone, the compiled model would read the ids and ignore the embeddings the hook
    writes. vllm-omni's runner passes both in its dummy run for a model with ``has_preprocess``."""
    model = runner.model
    runner.model = _EmbeddingsFedModel(model, runner)
    try:
        yield
    finally:
        runner.model = model
