"""From a frozen spec to per-stage plans: every decision the templates need, with its reason.

Pure functions, no I/O. A plan names the classes, the base classes, the
constants and which contract paths exist; each decision records the config keys
behind it so ``plan.yaml`` and ``omnigen explain`` show reviewers why the
generated code looks the way it does. The plans of all shipped models are the
spec matrix that ``tests/spec_matrix.yaml`` holds them to.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from omnigen.built import COMMITTED_PACKAGE, SCHEDULER_CLS
from omnigen.features import FLAGS
from omnigen.schema import (
    DecodeBatch,
    Device,
    FinalOutput,
    MTPGraph,
    PerRowGenerators,
    StageKind,
    Transport,
    require_choices,
)
from omnigen.spec import (
    BuildSpec,
    CheckpointSpec,
    ModelSpec,
    PostprocessSpec,
    StageSpec,
    StreamSpec,
    resolve_mtp_graph,
)

# Contract clauses (section numbers of docs/contract.md) and what each covers.
CLAUSES: dict[str, str] = {
    "1.1": "_model_forward with the stage's kwargs",
    "1.1-omni-output": "rebuild an OmniOutput flattened by a CUDA-graph weak reference",
    "1.2": "decode-step metadata hooks around the forward",
    "1.3": "extract_multimodal_outputs",
    "2.1": "_init_talker_mtp and the four MTP buffers",
    "2.2": "MTP graph policy",
    "2.3": "_talker_mtp_forward (seeding, sampling, write-back)",
    "3.1": "runner-owned keys in each row's buffer",
    "3.2": "MTP routing of single-token decode rows",
    "3.3": "per-row preprocess hook",
    "3.3-batch-mtp": "batched decode preprocessing feeding the MTP (5-tuple hook)",
    "3.3-batch-plain": "batched decode preprocessing without MTP (3-tuple hook, in place)",
    "3.4": "MTP rows run once after the rows",
    "3.5": "bad batch input fails before anything changes",
    "3.6": "hook sees the scheduled ids when a wrapper passes none",
    "3.7": "_filter_mrope_kwargs_for_model",
    "3.8": "_attach_request_features",
    "4.1": "_update_intermediate_buffer (merge, GPU-resident keys, mirror)",
    "4.2": "_update_additional_information and payload serialization",
    "4.2-every-step": "buffers refreshed from the scheduler every step",
    "4.3": "snapshot replacement on a producer marker",
    "4.4": "_update_streaming_input_additional_info",
    "4.5": "_sync_local_stage_payloads",
    "5.1": "accumulate_full_payload_output",
    "5.2": "_should_accumulate_full_payload_output",
    "5.3": "_should_defer_full_payload_d2h (request-end payload)",
    "6": "worker class and finished-request cleanup",
    "7.1": "postprocess after each step, merged into the buffers before the next",
    "7.2": "each request's step payload published under dotted keys",
    "7.2-make-omni-output": "make_omni_output assembles the step's OmniOutput",
    "7.3": "generation step: forward with per-request counts, no sampler, requests finish",
    "7.3-finished": "on_requests_finished when requests end",
    "7.4": "the model's own sampler, vLLM's as fallback",
    "7.5": "deployment fields on model_config set by the worker",
    "7.5-text-config": "the stage's own text config (hf_config_name)",
    "7.6": "text-only M-RoPE positions for a model without get_mrope_input_positions",
    "7.7-query-start-loc": "omni_query_start_loc to the decode-step metadata and the forward",
    "7.7-batch-req-ids": "set_batch_req_ids after the forward",
    "7.7-logits-metadata": "compute_logits with sampling metadata",
    "7.8": "payloads in omnigen's and vllm-omni's serialized forms",
    "8.1": "each step's published rows reach the scheduler; a finished request's payload in kv_transfer_params['omnigen']",
    "8.2": "a producer's payload reaches the next stage's request inline or as a shared-memory handle",
}


@dataclass(frozen=True)
class Decision:
    name: str
    value: Any
    reason: str
    keys: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"value": self.value, "reason": self.reason, "keys": list(self.keys)}


@dataclass(frozen=True)
class MTPPlan:
    graph: MTPGraph
    """Resolved graph policy: ``safe`` or ``unsafe``."""
    hidden_size_from: str
    output_key: tuple[str, str]
    output_key_gpu_resident: bool
    per_row_generators: PerRowGenerators
    """``never``, ``always`` or ``eager_only`` (``eager_only`` with graph ``unsafe`` resolves to ``always``)."""
    sampling_defaults: dict[str, Any] | None

    def __post_init__(self) -> None:
        if self.graph not in (MTPGraph.safe, MTPGraph.unsafe):
            raise ValueError(f"an MTP plan's graph is resolved to safe or unsafe, not {self.graph!r}")
        require_choices("an MTP plan", self, {"per_row_generators": PerRowGenerators})


@dataclass(frozen=True)
class V2Plan:
    """The stage's Model Runner V2 target (``<stage>_v2.py``), generated beside its V1 runner from
    the same config; the worker builds it where ``vllm_api.runner_target`` says V2
    (docs/model-runner-v2.md)."""

    state_class: str
    """``<Stage>ModelState``: the stage's V2 ``ModelState`` (the omni state and the hook bodies)."""
    runner_class: str
    """``<Stage>RunnerV2``: the V2 runner that builds the state (finished requests, payloads)."""
    full_graph: str
    """``kept`` or ``narrowed``: a forward that returns its payload itself cannot replay a full
    CUDA graph on V2 (it replays the hidden states only), so its worker narrows the mode."""
    jit_warmup: bool
    """Whether V2's warm-up may drive real steps with synthetic requests (no stage payload)."""
    rope_state: str
    """``default`` (vLLM's), ``text_only`` (7.6) or ``filtered_kwargs`` (3.7)."""
    state_hooks: tuple[str, ...]
    """The vLLM ``ModelState`` hooks the target implements for this stage."""
    runner_overrides: tuple[str, ...]
    """The V2 ``GPUModelRunner`` methods the target's runner overrides."""

    def as_dict(self, module: str) -> dict[str, Any]:
        return {
            "module": module,
            "state_class": self.state_class,
            "runner_class": self.runner_class,
            "state_hooks": list(self.state_hooks),
            "runner_overrides": list(self.runner_overrides),
            "full_graph": self.full_graph,
            "jit_warmup": self.jit_warmup,
            "rope_state": self.rope_state,
        }


# vLLM's ``scheduler_cls`` for every omnigen stage (vLLM's scheduler with the output channel, 8.1),
# and the committed tree's package (a variant built with ``out=DIR`` names its own): defined where
# serving reads the built package (omnigen.built).


@dataclass(frozen=True)
class StagePlan:
    model: str
    model_title: str
    stage: str
    order: int
    source: str
    module: str
    runner_class: str
    worker_class: str
    device: Device
    kind: StageKind
    arch: str
    final_output: FinalOutput
    producer: bool
    next_stage_input: str | None
    accumulates_full_payload: bool
    preprocess_hook: bool
    batch_preprocess_hook: bool
    decode_batch: DecodeBatch
    mtp: MTPPlan | None
    gpu_resident_keys: tuple[tuple[str, str], ...]
    refresh_every_step: bool
    sync_payloads_before_rows: bool
    replace_on_marker: bool
    multimodal_outputs: bool
    decode_step_metadata: bool
    has_finish_decode_step: bool
    request_end_payload: bool
    defers_full_payload_d2h: bool
    attach_request_features: bool
    mrope: bool
    async_chunk: bool
    clauses: tuple[str, ...]
    mrope_fallback: bool
    postprocess: PostprocessSpec | None
    make_omni_output: bool
    payload_hidden: bool
    request_token_spans: bool
    query_start_loc: bool
    set_batch_req_ids: bool
    logits_sampling_metadata: bool
    model_sampler: bool
    on_requests_finished: bool
    seq_token_counts: bool
    request_ids: bool
    model_config_fields: tuple[tuple[str, Any], ...]
    """``(name, value)`` pairs the worker sets on vLLM's ``model_config`` (7.5), sorted."""
    text_config_name: str | None
    published_keys: tuple[str, ...] | None
    """The payload keys each step publishes (8.1); None: every key (a full-payload producer)."""
    input_function: str | None
    """The glue this stage applies to the previous stage's output (when that stage names none)."""
    transport: Transport
    devices: str | None
    decisions: tuple[Decision, ...]
    model_class: str | None
    """The class vLLM builds for ``arch`` (registered wherever the model is served), or None."""
    v2: V2Plan | None
    """The stage's Model Runner V2 target (always set by the planner)."""
    stream: StreamSpec | None
    """How the edge to the next stage streams (None: the next stage gets the full payload)."""

    def __post_init__(self) -> None:
        """What a plan may never say, whatever the config (a planner bug, not a user's error)."""
        where = f"plan of {self.model}.{self.stage}"
        require_choices(
            where,
            self,
            {
                "device": Device,
                "kind": StageKind,
                "final_output": FinalOutput,
                "decode_batch": DecodeBatch,
                "transport": Transport,
            },
        )
        implied = {
            "accumulates_full_payload needs a producer": not self.accumulates_full_payload or self.producer,
            "defers_full_payload_d2h needs accumulates_full_payload and request_end_payload": (
                not self.defers_full_payload_d2h
                or (self.accumulates_full_payload and self.request_end_payload)
            ),
            "sync_payloads_before_rows needs refresh_every_step outside async-chunk mode": (
                not self.sync_payloads_before_rows or (self.refresh_every_step and not self.async_chunk)
            ),
            "an MTP runs on an autoregressive stage": self.mtp is None or self.kind is StageKind.ar,
            "decode_batch mtp needs an MTP": self.decode_batch is not DecodeBatch.mtp or self.mtp is not None,
            "every stage has its Model Runner V2 target": self.v2 is not None,
            "clauses are known, unique and in CLAUSES order": list(self.clauses)
            == [c for c in CLAUSES if c in self.clauses],
            "module, runner and worker are the stage's": self.module.endswith(f".{self.model}.{self.stage}")
            and self.runner_class.endswith("Runner")
            and self.worker_class.endswith("Worker"),
        }
        broken = [rule for rule, holds in implied.items() if not holds]
        if broken:
            raise ValueError(f"{where}: " + "; ".join(broken))

    @property
    def is_generation(self) -> bool:
        return self.kind is StageKind.generation

    def pipeline_dict(self) -> dict[str, Any]:
        """What the pipeline runs this stage with (``plan.yaml``'s ``pipeline``; ``omnigen.built``)."""
        return {
            "next_stage_input": self.next_stage_input,
            "input_function": self.input_function,
            "transport": self.transport.value,
            "devices": self.devices,
            "published_keys": None if self.published_keys is None else list(self.published_keys),
            "model_class": self.model_class,
            "stream": None if self.stream is None else self.stream.as_dict(),
        }

    def capabilities(self) -> dict[str, Any]:
        """The per-stage facts ``tests/spec_matrix.yaml`` states, under its key names."""
        return {
            "kind": self.kind,
            "arch": self.arch,
            "final_output": self.final_output,
            "producer": self.producer,
            "accumulates_full_payload": self.accumulates_full_payload,
            # The one-switch features (omnigen.features) the matrix states by name.
            **{flag.name: getattr(self, flag.name) for flag in FLAGS if flag.in_matrix},
            "decode_batch": self.decode_batch,
            "talker_mtp": self.mtp is not None,
            "mtp_graph": self.mtp.graph if self.mtp else None,
            "mtp_output_key": list(self.mtp.output_key) if self.mtp else None,
            "mtp_hidden_size_from": self.mtp.hidden_size_from if self.mtp else None,
            "mtp_per_row_generators": self.mtp.per_row_generators if self.mtp else None,
            "mtp_sampling_defaults": bool(self.mtp and self.mtp.sampling_defaults),
            "gpu_resident_keys": sorted(f"{t}.{q}" for t, q in self.gpu_resident_keys),
            "refresh_every_step": self.refresh_every_step,
            "defers_full_payload_d2h": self.defers_full_payload_d2h,
            "async_chunk": self.async_chunk,
            "postprocess": None
            if self.postprocess is None
            else {
                "hidden_states": self.postprocess.uses_hidden_states,
                "multimodal_outputs": self.postprocess.uses_multimodal_outputs,
                "req_infos": self.postprocess.uses_req_infos,
            },
            "sampler": "model" if self.model_sampler else ("none" if self.is_generation else "vllm"),
            "generation_kwargs": [
                name for name in ("seq_token_counts", "request_ids") if getattr(self, name)
            ],
            "model_config": dict(self.model_config_fields),
            "text_config": self.text_config_name,
            "v2_state_hooks": list(self.v2.state_hooks) if self.v2 else None,
            "v2_full_graph": self.v2.full_graph if self.v2 else None,
            "v2_jit_warmup": self.v2.jit_warmup if self.v2 else None,
            "v2_rope_state": self.v2.rope_state if self.v2 else None,
        }

    @property
    def worker_cls(self) -> str:
        return f"{self.module}.{self.worker_class}"

    @property
    def v2_module(self) -> str:
        """The module of the stage's V2 target (beside the V1 module, imported only when chosen)."""
        return f"{self.module}_v2"

    @property
    def serve_command(self) -> str:
        return f"vllm serve MODEL_PATH --worker-cls {self.worker_cls} --scheduler-cls {SCHEDULER_CLS}"


def _check_flag_fields() -> None:
    """Every one-switch feature of ``omnigen.features`` is a field of the spec and the plan that
    carry it (a feature declared there and forgotten here fails when omnigen is imported)."""
    for carrier in (StageSpec, StagePlan):
        fields = {field.name for field in dataclasses.fields(carrier)}
        missing = [flag.name for flag in FLAGS if flag.name not in fields]
        if missing:
            raise TypeError(f"omnigen.features names {missing}, which {carrier.__name__} has no field for")


_check_flag_fields()


@dataclass(frozen=True)
class ModelPlan:
    name: str
    title: str
    arch: str
    source: str
    async_chunk: bool
    device: Device
    stages: tuple[StagePlan, ...]
    checkpoint: CheckpointSpec

    def __post_init__(self) -> None:
        names = [s.stage for s in self.stages]
        orders = [s.order for s in self.stages]
        packages = {s.module.rsplit(".", 2)[0] for s in self.stages}
        if not self.stages or len(set(names)) != len(names) or orders != sorted(set(orders)):
            raise ValueError(f"plan of {self.name}: stages must be unique and in ascending order: {names}")
        if len(packages) != 1 or any(s.model != self.name for s in self.stages):
            raise ValueError(f"plan of {self.name}: every stage must be this model's, in one package")

    @property
    def model_classes(self) -> dict[str, str]:
        """Every ``arch -> dotted class path`` the model declares: its stages' and the extra ones."""
        found = {s.arch: s.model_class for s in self.stages if s.model_class}
        found.update(self.checkpoint.extra_classes)
        return dict(sorted(found.items()))

    @property
    def package(self) -> str:
        """The package the model's folder imports under (``omnigen.generated`` for the committed tree)."""
        return self.stages[0].module.rsplit(".", 2)[0]

    def in_package(self, package: str) -> ModelPlan:
        """The same plan with its modules under ``package`` (a variant built with ``out=DIR``)."""
        stages = tuple(dataclasses.replace(s, module=f"{package}.{self.name}.{s.stage}") for s in self.stages)
        return dataclasses.replace(self, stages=stages)

    def stage(self, name: str) -> StagePlan:
        for stage in self.stages:
            if stage.stage == name:
                return stage
        known = ", ".join(s.stage for s in self.stages)
        raise KeyError(f"model {self.name!r} has no stage {name!r}; its stages are: {known}")

    def as_dict(self) -> dict[str, Any]:
        """The serializable plan (``generated/<model>/plan.yaml``): plain data, enums as their values."""
        return _plain(
            {
                "model": self.name,
                "title": self.title,
                "arch": self.arch,
                "source": self.source,
                "async_chunk": self.async_chunk,
                "device": self.device,
                "checkpoint": {
                    "provider": self.checkpoint.provider,
                    "install": self.checkpoint.install,
                    "model_type": self.checkpoint.model_type,
                    "config_class": self.checkpoint.config_class,
                    "model_classes": self.model_classes,
                    "request_builder": self.checkpoint.request_builder,
                    "synthetic": self.checkpoint.synthetic,
                },
                "stages": {
                    s.stage: {
                        "order": s.order,
                        "module": s.module,
                        "runner_class": s.runner_class,
                        "worker_class": s.worker_class,
                        "serve": s.serve_command,
                        "capabilities": s.capabilities(),
                        "contract_clauses": list(s.clauses),
                        "pipeline": s.pipeline_dict(),
                        "v2": s.v2.as_dict(s.v2_module) if s.v2 else None,
                        "decisions": {d.name: d.as_dict() for d in s.decisions},
                    }
                    for s in self.stages
                },
            }
        )


def _plain(value: Any) -> Any:
    """``value`` with every enum replaced by its value (YAML writes plain data only)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def camel(name: str) -> str:
    """``qwen3_omni`` -> ``Qwen3Omni``; ``code2wav`` -> ``Code2wav``."""
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"_+", name) if part)


def class_prefix(model: str, stage: str) -> str:
    """Class-name prefix that names the matrix cell: model, then stage (once if they coincide)."""
    model_part = camel(model)
    stage_part = camel(stage)
    return model_part if stage_part == model_part else model_part + stage_part


def plan_build(build: BuildSpec) -> ModelPlan:
    model = build.model
    return ModelPlan(
        name=model.name,
        title=model.title,
        arch=model.arch,
        source=model.source,
        async_chunk=model.async_chunk,
        device=build.device,
        checkpoint=model.checkpoint,
        stages=tuple(
            _plan_stage(model, stage, build, feeds_input_function=_next_input_function(model, i) is not None)
            for i, stage in enumerate(model.stages)
        ),
    )


def _next_input_function(model: ModelSpec, index: int) -> str | None:
    following = model.stages[index + 1] if index + 1 < len(model.stages) else None
    return None if following is None else following.input_function


def _plan_stage(
    model: ModelSpec, stage: StageSpec, build: BuildSpec, *, feeds_input_function: bool
) -> StagePlan:
    decisions: list[Decision] = []
    key = f"stages.{stage.name}"

    def decide(name: str, value: Any, reason: str, *keys: str) -> Any:
        decisions.append(Decision(name, value, reason, tuple(keys)))
        return value

    prefix = class_prefix(model.name, stage.name)
    kind = stage.kind
    decide("kind", kind.value, f"{kind.value} stage", f"{key}.kind")
    device = build.device
    _decide_runner_base(device, decide)
    producer = stage.producer
    accumulates, defers = _decide_full_payload(model, stage, decide, key)
    mtp_plan = _decide_mtp(stage, build, decide, key)
    decode_batch, refresh, sync_before_rows = _decide_rows(model, stage, decide, key)
    published = _decide_publishing(stage, accumulates, feeds_input_function, decide, key)
    # What a streaming edge's windows read: the payload a producer accumulates, or, where the next
    # stage's input_function is the edge's glue, every key this stage publishes (the same fold).
    readable = accumulates or (feeds_input_function and not model.async_chunk)
    _decide_streaming(stage, readable, feeds_input_function, decide, key)
    _decide_step_outputs(stage, decide, key)
    model_config_fields = _decide_model_config(model, stage, decide, key)
    v2_plan = _decide_v2(stage, prefix, mtp_plan, decide, key)
    clauses = _contract_clauses(stage, accumulates=accumulates, defers=defers, published=published)

    return StagePlan(
        model=model.name,
        model_title=model.title,
        stage=stage.name,
        order=stage.order,
        source=model.source,
        module=f"{COMMITTED_PACKAGE}.{model.name}.{stage.name}",
        runner_class=f"{prefix}Runner",
        worker_class=f"{prefix}Worker",
        device=device,
        kind=kind,
        arch=stage.arch,
        final_output=stage.final_output,
        producer=producer,
        next_stage_input=stage.next_stage_input,
        accumulates_full_payload=accumulates,
        decode_batch=decode_batch,
        mtp=mtp_plan,
        gpu_resident_keys=stage.gpu_resident_keys,
        refresh_every_step=refresh,
        sync_payloads_before_rows=sync_before_rows,
        defers_full_payload_d2h=defers,
        async_chunk=model.async_chunk,
        clauses=clauses,
        postprocess=stage.postprocess,
        model_sampler=stage.model_sampler,
        model_config_fields=model_config_fields,
        text_config_name=stage.hf_config_name,
        published_keys=published,
        input_function=stage.input_function,
        transport=stage.transport,
        devices=stage.devices,
        decisions=tuple(decisions),
        model_class=stage.model_class,
        v2=v2_plan,
        stream=stage.stream,
        # The one-switch features (omnigen.features), as the spec read them.
        **{flag.name: getattr(stage, flag.name) for flag in FLAGS},
    )


def _decide_runner_base(device: Device, decide: Any) -> None:
    """The vLLM runner the generated runner subclasses (``device``)."""
    if device is Device.auto:
        decide(
            "runner_base",
            "GPUModelRunner on a GPU platform, CPUModelRunner on a CPU-only one",
            "device=auto: the worker asks vLLM's current platform when vLLM loads it",
            "device",
        )
    elif device is Device.cpu:
        decide("runner_base", "CPUModelRunner", "device=cpu", "device")
    else:
        decide("runner_base", "GPUModelRunner", "device=cuda", "device")


def _decide_full_payload(model: ModelSpec, stage: StageSpec, decide: Any, key: str) -> tuple[bool, bool]:
    """Whether the stage accumulates a full payload for the next stage (CONTRACT 5), and whether
    it defers that payload's device-to-host copy to the request's end (5.3)."""
    producer = stage.producer
    accumulates = producer and stage.full_payload and not model.async_chunk
    if not producer:
        reason = "the stage feeds no next stage (next_stage_input is null)"
    elif not stage.full_payload:
        reason = "the producer sends no full payload (full_payload: false)"
    elif model.async_chunk:
        reason = "async-chunk mode streams chunks instead of a full payload"
    else:
        reason = "a producer with a full-payload function, not in async-chunk mode"
    decide(
        "accumulates_full_payload",
        accumulates,
        reason,
        f"{key}.next_stage_input",
        f"{key}.full_payload",
        "async_chunk",
    )

    defers = accumulates and stage.request_end_payload
    decide(
        "defers_full_payload_d2h",
        defers,
        "request-end payload on an accumulating stage (and, at run time, no prefix cache)"
        if defers
        else (
            "no request-end payload declared"
            if not stage.request_end_payload
            else "declares a request-end payload but does not accumulate a full payload"
        ),
        f"{key}.outputs.request_end_payload",
    )
    return accumulates, defers


def _decide_mtp(stage: StageSpec, build: BuildSpec, decide: Any, key: str) -> MTPPlan | None:
    """The talker's multi-token code predictor (``stages.S.mtp``; CONTRACT 2), or None."""
    mtp_plan: MTPPlan | None = None
    if stage.mtp is not None:
        mtp = stage.mtp
        graph, graph_reason, graph_keys = resolve_mtp_graph(mtp, build.mtp_graph_preset, key)
        decide("mtp.graph", graph.value, graph_reason, *graph_keys)

        per_row = mtp.per_row_generators
        per_row_reason = f"mtp.per_row_generators={per_row.value}"
        if per_row is PerRowGenerators.eager_only and graph is MTPGraph.unsafe:
            per_row = PerRowGenerators.always
            per_row_reason = "eager_only with a never-wrapped predictor (graph unsafe) always accepts them"
        decide("mtp.per_row_generators", per_row.value, per_row_reason, f"{key}.mtp.per_row_generators")

        gpu_codes = mtp.output_key in stage.gpu_resident_keys
        decide(
            "mtp.output_key",
            list(mtp.output_key),
            "codes stay on the device (GPU-resident key)" if gpu_codes else "codes move to CPU",
            f"{key}.mtp.output_key",
            f"{key}.buffers.gpu_resident",
        )
        decide(
            "mtp.hidden_size",
            f"model_config.{mtp.hidden_size_from}",
            "read when the model loads",
            f"{key}.mtp.hidden_size_from",
        )
        sampling = {name: value for name, value in mtp.sampling if value is not None}
        decide(
            "mtp.sampling_defaults",
            sampling or None,
            "stage defaults; model_config.subtalker_sampling_params overrides key by key"
            if sampling
            else "no stage defaults: only a deployment's subtalker_sampling_params, else None",
            f"{key}.mtp.sampling",
        )
        mtp_plan = MTPPlan(
            graph=graph,
            hidden_size_from=mtp.hidden_size_from,
            output_key=mtp.output_key,
            output_key_gpu_resident=gpu_codes,
            per_row_generators=per_row,
            sampling_defaults=sampling or None,
        )
    else:
        decide("talker_mtp", False, "mtp.enabled is false: no MTP code", f"{key}.mtp.enabled")
    return mtp_plan


def _decide_rows(model: ModelSpec, stage: StageSpec, decide: Any, key: str) -> tuple[DecodeBatch, bool, bool]:
    """How a step's rows are prepared: decode batching (``preprocess``) and when buffers take the
    scheduler's payloads (``buffers``)."""
    decode_batch = stage.decode_batch
    decide(
        "decode_batch",
        decode_batch.value,
        f"preprocess.decode_batch={decode_batch.value}",
        f"{key}.preprocess.decode_batch",
    )

    refresh = stage.refresh_every_step
    decide(
        "refresh_every_step",
        refresh,
        "buffers.refresh_every_step: the scheduler's payloads merge on every step"
        if refresh
        else "buffers take the scheduler's payloads only when a request is admitted",
        f"{key}.buffers.refresh_every_step",
    )
    sync_before_rows = refresh and not model.async_chunk
    decide(
        "sync_payloads_before_rows",
        sync_before_rows,
        "full-payload mode: connector-delivered payloads override earlier infos before the rows"
        if sync_before_rows
        else ("async-chunk mode" if refresh else "no per-step refresh"),
        "async_chunk",
        f"{key}.buffers.refresh_every_step",
    )
    return decode_batch, refresh, sync_before_rows


def _contract_clauses(
    stage: StageSpec, *, accumulates: bool, defers: bool, published: tuple[str, ...] | None
) -> tuple[str, ...]:
    """The contract clauses the stage implements, in ``CLAUSES`` order."""
    producer = stage.producer
    refresh = stage.refresh_every_step
    clauses = ["1.1", "1.3", "4.1", "4.2", "4.4", "4.5", "5.2", "6", "7.2", "7.5", "7.8"]
    for flag in FLAGS:
        if getattr(stage, flag.name):
            clauses += flag.clauses
    if stage.postprocess is not None:
        clauses.append("7.1")
    if stage.kind.value == "generation":
        clauses.append("7.3")
    if stage.model_sampler:
        clauses.append("7.4")
    if stage.hf_config_name is not None:
        clauses.append("7.5-text-config")
    if stage.mtp is not None:
        clauses += ["2.1", "2.2", "2.3", "3.2", "3.4"]
    if stage.decode_batch is DecodeBatch.mtp:
        clauses += ["3.3-batch-mtp", "3.5"]
    if stage.decode_batch is DecodeBatch.plain:
        clauses += ["3.3-batch-plain", "3.5"]
    if refresh:
        clauses.append("4.2-every-step")
    if accumulates:
        clauses.append("5.1")
    if published is None or published:
        clauses.append("8.1")
    if producer:
        clauses.append("8.2")
    if defers:
        clauses.append("5.3")
    return tuple(c for c in CLAUSES if c in set(clauses))


def _decide_streaming(
    stage: StageSpec, readable: bool, feeds_input_function: bool, decide: Any, key: str
) -> None:
    """Whether the edge to the next stage streams (windows decoded while this stage runs)."""
    if not stage.producer and not feeds_input_function:
        return
    stream = stage.stream
    if stream is None:
        decide(
            "stream",
            False,
            "the next stage starts when this one finishes, from its full payload",
            f"{key}.stream.enabled",
        )
        return
    if not readable:
        # async_chunk: vllm-omni's own connector hands the chunks over; the stage publishes none.
        decide(
            "stream",
            False,
            "async_chunk=true: the stage accumulates nothing for omnigen's windows to read",
            "async_chunk",
            f"{key}.stream.enabled",
        )
        return
    ramp = f", then {list(stream.ramp)}" if stream.ramp else ""
    decide(
        "stream",
        {
            "window": stream.window,
            "initial_chunk_frames": stream.initial_chunk_frames,
            "ramp": list(stream.ramp),
            "chunk_frames": stream.chunk_frames,
            "left_context_frames": stream.left_context_frames,
            "coalesce": stream.coalesce,
            "playback_rate_hz": stream.playback_rate_hz,
            "playback_lead_s": stream.playback_lead_s,
        },
        f"windows of {stream.initial_chunk_frames}{ramp}, then {stream.chunk_frames} frames, each "
        f"decoded with {stream.left_context_frames} frames before it, while this stage runs "
        f"({stream.window}); "
        + (
            "one at a time per request, the next taking every window ready (they grow when the next stage lags)"
            if stream.coalesce
            else "each its own size, several decoding at once"
        )
        + (
            f"; after the first, held until the caller has {stream.playback_lead_s} s of audio left "
            f"to play at {stream.playback_rate_hz} frames/s"
            if stream.playback_rate_hz
            else ""
        ),
        f"{key}.stream",
    )


def _decide_v2(stage: StageSpec, prefix: str, mtp: MTPPlan | None, decide: Any, key: str) -> V2Plan:
    """The stage's Model Runner V2 target: the decisions only V2 needs (docs/model-runner-v2.md)."""
    decide(
        "v2.target",
        "the V1 runner, or the V2 target where vllm_api.runner_target says V2",
        "decided when the stage is served, from vLLM's features (never its version): V2 where vLLM has "
        "no V1 runner, or chose V2 and has every seam the target uses (vllm_api.V2_SEAMS); else V1",
    )
    assembles_payload = stage.multimodal_outputs and not stage.make_omni_output
    full_graph = "narrowed" if assembles_payload else "kept"
    decide(
        "v2.full_graph",
        full_graph,
        "the forward returns the step's payload itself, and V2 replays only the hidden states of a full "
        "CUDA graph: the worker narrows the model's graph mode (FULL_AND_PIECEWISE to PIECEWISE, FULL to NONE)"
        if assembles_payload
        else (
            "make_omni_output assembles the payload from the replayed hidden states after the forward"
            if stage.make_omni_output
            else "the forward returns hidden states only: vLLM's graph mode is kept"
        ),
        f"{key}.outputs.multimodal",
        f"{key}.outputs.make_omni_output",
    )
    reads_payloads = [
        name
        for name, on in (
            ("a preprocess hook", stage.preprocess_hook),
            ("a post-forward hook", stage.postprocess is not None),
            ("a generation forward", stage.kind.value == "generation"),
            ("decode-step metadata", stage.decode_step_metadata),
            ("make_omni_output", stage.make_omni_output),
            ("a multimodal forward", stage.multimodal_outputs),
        )
        if on
    ]
    jit_warmup = not reads_payloads
    decide(
        "v2.jit_warmup",
        jit_warmup,
        "vLLM's warm-up may drive real steps with its synthetic requests: nothing of the stage reads a payload"
        if jit_warmup
        else f"off: V2's warm-up would run {', '.join(reads_payloads)} on synthetic requests that carry no "
        "stage payload; the first real step compiles V2's kernels instead",
        f"{key}.preprocess.hook",
        f"{key}.postprocess.hook",
        f"{key}.kind",
    )
    if stage.mrope_fallback:
        rope_state, rope_reason = "text_only", "positions.mrope_fallback: text-only M-RoPE positions (7.6)"
    elif stage.mrope:
        rope_state, rope_reason = (
            "filtered_kwargs",
            "positions.mrope: get_mrope_input_positions gets only the keyword arguments it accepts (3.7)",
        )
    else:
        rope_state, rope_reason = "default", "vLLM's rope state (an M-RoPE checkpoint gets vLLM's positions)"
    decide(
        "v2.rope_state", rope_state, rope_reason, f"{key}.positions.mrope", f"{key}.positions.mrope_fallback"
    )
    hooks = ["add_request", "preprocess_state", "prepare_inputs"]
    if stage.preprocess_hook:
        hooks.append("prepare_inputs_embeds")
    if mtp is not None and mtp.graph == "safe":
        hooks.append("capture_inner_cudagraphs")
    if stage.model_sampler:
        hooks.append("custom_sampler")
    overrides = ["load_model", "finish_requests", "update_requests", "execute_model", "sample_tokens"]
    if stage.kind.value == "generation":
        overrides.append("_dummy_sampler_run")
    return V2Plan(
        state_class=f"{prefix}ModelState",
        runner_class=f"{prefix}RunnerV2",
        full_graph=full_graph,
        jit_warmup=jit_warmup,
        rope_state=rope_state,
        state_hooks=tuple(hooks),
        runner_overrides=tuple(overrides),
    )


_TRANSPORT_REASONS = {
    "inline": "inline: the payload rides in the next request's SamplingParams.extra_args",
    "shm": "shm: the next request carries a shared-memory handle its consumer releases",
    "ray": "ray: the payload is an object in Ray's object store, freed once the consumer has read it",
}


def _decide_publishing(
    stage: StageSpec, accumulates: bool, feeds_input_function: bool, decide: Any, key: str
) -> tuple[str, ...] | None:
    """Which payload keys each step publishes to the scheduler (8.1), and how a producer's
    payload travels to the next stage (8.2)."""
    if accumulates:
        published = None
        reason = "a full-payload producer publishes every key: the next stage gets the whole payload"
    elif feeds_input_function:
        published = None
        reason = "the next stage's input_function reads this stage's output: every key is published"
    elif stage.publish:
        published = tuple(stage.publish)
        reason = "the keys the stage publishes to its caller"
    elif stage.final_output.value != "none":
        published = None
        reason = f"final_output={stage.final_output.value} and no publish list: the caller gets every key of the stage's output (as vllm-omni's clients do)"
    else:
        published = ()
        reason = "the stage publishes no payload (publish is empty)"
    decide("published_keys", "all" if published is None else list(published), reason, f"{key}.publish")
    if stage.producer:
        decide(
            "transport",
            stage.transport.value,
            _TRANSPORT_REASONS[stage.transport.value],
            f"{key}.transport",
        )
    return published


def _decide_step_outputs(stage: StageSpec, decide: Any, key: str) -> None:
    """How the step runs after the forward: the execute path, the sampler, the post-forward hook."""
    if stage.kind.value == "generation":
        decide(
            "execute_path",
            "generation",
            "a generation stage samples nothing: its forward gets the per-request token counts, "
            "each request's output is published, and a request finishes once its inputs are in",
            f"{key}.kind",
            f"{key}.generation",
        )
    else:
        decide(
            "execute_path",
            "sampling",
            "an autoregressive stage: vLLM's execute_model and sampling",
            f"{key}.kind",
        )
        decide(
            "sampler",
            "model" if stage.model_sampler else "vllm",
            "sampler=model: the model's sample(logits, sampling_metadata), vLLM's when it returns None"
            if stage.model_sampler
            else "sampler=vllm",
            f"{key}.sampler",
        )
    post = stage.postprocess
    if post is None:
        decide(
            "postprocess", False, "postprocess.hook is false: no post-forward hook", f"{key}.postprocess.hook"
        )
    else:
        uses = [
            name
            for name, on in (
                ("the row's hidden states", post.uses_hidden_states),
                ("the step's multimodal outputs", post.uses_multimodal_outputs),
                ("the row's buffer", post.uses_req_infos),
            )
            if on
        ]
        decide(
            "postprocess",
            True,
            "postprocess.hook: once per row after sampling, given " + (", ".join(uses) or "nothing it uses"),
            f"{key}.postprocess",
        )
    decide(
        "make_omni_output",
        stage.make_omni_output,
        "outputs.make_omni_output: a forward result that is not an OmniOutput goes through it"
        if stage.make_omni_output
        else "the forward returns the step's output as it is",
        f"{key}.outputs.make_omni_output",
    )
    decide(
        "mrope_fallback",
        stage.mrope_fallback,
        "positions.mrope_fallback: text-only M-RoPE positions instead of vLLM's assertion"
        if stage.mrope_fallback
        else "vLLM's M-RoPE path (the model's get_mrope_input_positions, where the checkpoint uses M-RoPE)",
        f"{key}.positions.mrope_fallback",
    )


def _decide_model_config(
    model: ModelSpec, stage: StageSpec, decide: Any, key: str
) -> tuple[tuple[str, Any], ...]:
    """The deployment fields the worker sets on vLLM's model_config (7.5)."""
    fields: dict[str, Any] = {"async_chunk": model.async_chunk}
    keys = ["async_chunk"]
    if stage.model_stage is not None:
        fields["model_stage"] = stage.model_stage
        keys.append(f"{key}.model_config.model_stage")
    ordered = tuple(sorted(fields.items()))
    decide(
        "model_config",
        dict(ordered),
        "set by the worker before the model is built; the model reads them from model_config",
        *keys,
    )
    decide(
        "text_config",
        stage.hf_config_name,
        f"hf_text_config is hf_config.{stage.hf_config_name}'s text config: the stage's own widths"
        if stage.hf_config_name
        else "vLLM's hf_text_config",
        f"{key}.model_config.hf_config_name",
    )
    return ordered
