"""Validated, frozen model specs built from a composed config.

The schema (``schema.py``) guarantees types and known keys; this layer checks
what only makes sense across fields, and collects every finding before it
raises, each one as ``conf/model/x.yaml: stages.talker.mtp.graph: what is wrong;
how to fix it``. Once built, a spec cannot change (frozen dataclasses), and
every string that will reach generated code has been checked to be an
identifier or a dotted path of identifiers.
"""

from __future__ import annotations

import dataclasses
import keyword
import math
import re
import typing
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from omnigen.features import read_flags
from omnigen.findings import Finding, report
from omnigen.schema import (
    DecodeBatch,
    Device,
    FinalOutput,
    ModelConf,
    MTPGraph,
    PerRowGenerators,
    Sampler,
    StageKind,
    Transport,
    require_choices,
)
from omnigen.streams import StreamSpec

# Matched with fullmatch: ``$`` would also accept a trailing newline.
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}")
_CONF_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
_TITLE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 _.+()/-]{0,59}")
# Stage names become module names inside the model's package, beside its own files.
_RESERVED_STAGE_NAMES = frozenset({"plan"})
# A stage's CUDA_VISIBLE_DEVICES: device indices, comma-separated.
_DEVICES = re.compile(r"\d{1,3}(,\d{1,3}){0,63}")
# A pipeline has a handful of stages; an order beyond this is a typo.
MAX_STAGE_ORDER = 99


class SpecError(ValueError):
    """A config that composes but cannot hold together; lists every finding."""

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        super().__init__(report(findings))


def is_identifier(text: str) -> bool:
    return bool(_IDENTIFIER.fullmatch(text)) and not keyword.iskeyword(text)


def is_dotted_path(text: str) -> bool:
    return bool(text) and all(is_identifier(part) for part in text.split("."))


@dataclass(frozen=True)
class MTPSpec:
    graph: MTPGraph
    owns_talker_module: bool
    hidden_size_from: str
    output_key: tuple[str, str]
    per_row_generators: PerRowGenerators
    sampling: tuple[tuple[str, Any], ...]
    """Configured sampling defaults as sorted ``(name, value)`` pairs, None values kept."""


@dataclass(frozen=True)
class PostprocessSpec:
    uses_hidden_states: bool
    uses_multimodal_outputs: bool
    uses_req_infos: bool


@dataclass(frozen=True)
class CheckpointSpec:
    """How the model's real checkpoints are served (schema ``CheckpointConf``)."""

    provider: str | None = None
    install: str | None = None
    model_type: str | None = None
    config_class: str | None = None
    extra_classes: tuple[tuple[str, str], ...] = ()
    """``(arch, dotted class path)``, sorted."""
    request_builder: str | None = None
    synthetic: str | None = None


@dataclass(frozen=True)
class StageSpec:
    name: str
    order: int
    kind: StageKind
    arch: str
    final_output: FinalOutput
    next_stage_input: str | None
    full_payload: bool
    transport: Transport
    publish: tuple[str, ...]
    input_function: str | None
    devices: str | None
    preprocess_hook: bool
    batch_preprocess_hook: bool
    decode_batch: DecodeBatch
    attach_request_features: bool
    mtp: MTPSpec | None
    gpu_resident_keys: tuple[tuple[str, str], ...]
    refresh_every_step: bool
    replace_on_marker: bool
    multimodal_outputs: bool
    decode_step_metadata: bool
    has_finish_decode_step: bool
    request_end_payload: bool
    mrope: bool
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
    model_stage: str | None
    hf_config_name: str | None
    model_class: str | None = None
    stream: StreamSpec | None = None
    """The edge to the next stage streams (None: full payload at request end)."""

    def __post_init__(self) -> None:
        """What ``_stage_spec`` guarantees whatever the config (a user's mistake is a finding,
        reported with its key, before any of this could fail): choices stay their enums."""
        require_choices(
            f"spec of stage {self.name}",
            self,
            {
                "kind": StageKind,
                "final_output": FinalOutput,
                "decode_batch": DecodeBatch,
                "transport": Transport,
            },
        )
        if (self.seq_token_counts or self.request_ids) and self.kind is not StageKind.generation:
            raise ValueError(f"spec of stage {self.name}: generation kwargs on a {self.kind.value} stage")
        # Sorted here; a key listed twice is the user's finding (buffers.gpu_resident), not this.
        if list(self.gpu_resident_keys) != sorted(self.gpu_resident_keys):
            raise ValueError(f"spec of stage {self.name}: gpu_resident_keys must be sorted")

    @property
    def producer(self) -> bool:
        return self.next_stage_input is not None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    title: str
    arch: str
    async_chunk: bool
    stages: tuple[StageSpec, ...]
    source: str
    """Config file the model came from, relative to the config root (``conf/model/x.yaml``)."""
    checkpoint: CheckpointSpec = CheckpointSpec()

    def stage(self, name: str) -> StageSpec:
        for stage in self.stages:
            if stage.name == name:
                return stage
        known = ", ".join(s.name for s in self.stages)
        raise KeyError(f"model {self.name!r} has no stage {name!r}; its stages are: {known}")


@dataclass(frozen=True)
class BuildSpec:
    """One model plus the build-wide choices (device, graph preset)."""

    model: ModelSpec
    device: Device
    mtp_graph_preset: MTPGraph | None


def resolve_mtp_graph(
    mtp: MTPSpec, preset: MTPGraph | None, key: str
) -> tuple[MTPGraph, str, tuple[str, ...]]:
    """The stage's effective MTP graph policy (``safe`` or ``unsafe``), why, and the keys behind it."""
    if preset is not None:
        graph, reason, keys = preset, f"graph preset sets every MTP stage to {preset.value}", ("mtp_graph",)
    else:
        graph, reason, keys = mtp.graph, f"mtp.graph={mtp.graph.value}", (f"{key}.mtp.graph",)
    if graph is MTPGraph.auto:
        keys = (*keys, f"{key}.mtp.owns_talker_module")
        if mtp.owns_talker_module:
            return (
                MTPGraph.safe,
                "mtp.graph=auto resolves to safe: the stage owns a separate talker module",
                keys,
            )
        return (
            MTPGraph.unsafe,
            "mtp.graph=auto resolves to unsafe: the stage owns no separate talker module",
            keys,
        )
    return graph, reason, keys


def model_source(name: str) -> str:
    """How messages and headers name a model's file: ``conf/model/NAME.yaml`` for omnigen's own,
    the file's path (relative to the working directory when under it) for one from ``-cd DIR``."""
    from omnigen import paths

    if paths.is_shipped_model(name) or "/" in name or "\\" in name:
        return f"conf/model/{name}.yaml"
    return paths.shown(paths.model_file(name))


class _Findings:
    def __init__(self, source: str):
        self.source = source
        self.items: list[Finding] = []

    def add(self, key: str, problem: str) -> None:
        self.items.append(Finding(self.source, key, problem))


def build_spec(cfg: DictConfig, file_stem: str | None = None) -> BuildSpec:
    """Turn a composed root config into a frozen, checked ``BuildSpec``.

    ``file_stem`` is the model config that was read (``model=NAME``): findings name that file,
    and the config's ``name:`` must be the same.
    """
    model_cfg = cfg.model
    name = str(model_cfg.get("name", "?"))
    findings = _Findings(model_source(file_stem or name))
    # Hydra's '+key=value' opens the struct, so unknown keys are looked for here as well.
    for key in _unknown_keys(OmegaConf.to_container(model_cfg, resolve=False), ModelConf, ""):
        findings.add(key, "no such key: remove it or fix its spelling (omnigen/schema.py lists the keys)")
    if findings.items:
        raise SpecError(findings.items)
    try:
        model: ModelConf = OmegaConf.to_object(model_cfg)  # type: ignore[assignment]
    except MissingMandatoryValue as exc:
        findings.add(_error_key(exc), "is required and missing; set it (omnigen/schema.py documents it)")
        raise SpecError(findings.items) from exc
    except Exception as exc:  # an unknown key added with '+'
        findings.add(
            _error_key(exc), f"{_first_line(exc)}; remove it or fix its spelling (see omnigen/schema.py)"
        )
        raise SpecError(findings.items) from exc
    spec = _model_spec(model, findings, file_stem)
    device = Device(cfg.device.value if isinstance(cfg.device, Device) else cfg.device)
    preset_raw = cfg.get("mtp_graph")
    preset = None if preset_raw is None else MTPGraph(getattr(preset_raw, "value", preset_raw))
    if spec is not None:
        for stage in spec.stages:
            if stage.mtp is None:
                continue
            graph, reason, _ = resolve_mtp_graph(stage.mtp, preset, f"stages.{stage.name}")
            if graph is MTPGraph.safe and stage.mtp.per_row_generators is PerRowGenerators.always:
                findings.add(
                    f"stages.{stage.name}.mtp.per_row_generators",
                    f"always, but the predictor may be graph-captured ({reason}), and a captured "
                    "predictor replays one random stream; use eager_only (per-row generators when "
                    "eager, one call per seeded row when captured) or mtp.graph: unsafe",
                )
    if findings.items:
        raise SpecError(findings.items)
    assert spec is not None
    return BuildSpec(model=spec, device=device, mtp_graph_preset=preset)


def _unknown_keys(node: Any, cls: type, prefix: str) -> list[str]:
    """Keys of ``node`` (a plain container) that the dataclass ``cls`` does not declare."""
    if not isinstance(node, dict):
        return []
    hints = typing.get_type_hints(cls)
    found = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        if key not in hints:
            found.append(path)
            continue
        hint = hints[key]
        if typing.get_origin(hint) is dict:
            item = _dataclass_in(typing.get_args(hint)[1])
            if item is not None and isinstance(value, dict):
                for sub_key, sub_value in value.items():
                    found += _unknown_keys(sub_value, item, f"{path}.{sub_key}.")
            continue
        target = _dataclass_in(hint)
        if target is not None:
            found += _unknown_keys(value, target, f"{path}.")
    return found


def _dataclass_in(hint: Any) -> type | None:
    candidates = [hint, *typing.get_args(hint)]
    for candidate in candidates:
        if dataclasses.is_dataclass(candidate) and isinstance(candidate, type):
            return candidate
    return None


def _error_key(exc: Exception) -> str:
    key = getattr(exc, "full_key", None)
    return str(key).removeprefix("model.") if key else "model"


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _model_spec(model: ModelConf, findings: _Findings, file_stem: str | None) -> ModelSpec | None:
    if not _CONF_NAME.fullmatch(model.name) or keyword.iskeyword(model.name):
        findings.add(
            "name",
            f"{model.name!r} is not a lowercase identifier; name the model like its file "
            "(letters, digits, underscores, at most 64 characters, not a Python keyword)",
        )
    if file_stem is not None and model.name != file_stem:
        findings.add(
            "name",
            f"{model.name!r} differs from the file's name; set name: {file_stem} (the generated "
            f"package is named after the model, and another model's name would overwrite it)",
        )
    if not is_dotted_path(model.arch):
        findings.add("arch", f"{model.arch!r} is not a Python identifier; use vLLM's model_arch name")
    if not _TITLE.fullmatch(model.title):
        findings.add(
            "title",
            f"{model.title!r} must be a short human name (letters, digits, spaces and - _ . + ( ) /, "
            "at most 60 characters), e.g. Qwen3-Omni: it is written into generated docstrings",
        )
    if not model.stages:
        findings.add("stages", "no stages; a model needs at least one stage")

    orders: dict[int, str] = {}
    for stage_name, stage in sorted(model.stages.items(), key=lambda kv: (kv[1].order, kv[0])):
        if not 0 <= stage.order <= MAX_STAGE_ORDER:
            findings.add(
                f"stages.{stage_name}.order",
                f"{stage.order} is out of range; orders run from 0 to {MAX_STAGE_ORDER} (0 is the first stage)",
            )
        if stage.order in orders:
            findings.add(
                f"stages.{stage_name}.order",
                f"{stage.order} is also the order of stage {orders[stage.order]!r}; "
                "give every stage a distinct order",
            )
        orders.setdefault(stage.order, stage_name)

    ordered = sorted(model.stages.items(), key=lambda kv: (kv[1].order, kv[0]))
    stages = tuple(
        _stage_spec(model, stage_name, stage, is_last=(i == len(ordered) - 1), findings=findings)
        for i, (stage_name, stage) in enumerate(ordered)
    )
    _check_edges(stages, findings)
    return ModelSpec(
        name=model.name,
        title=model.title,
        arch=model.arch,
        async_chunk=model.async_chunk,
        stages=stages,
        source=model_source(file_stem or model.name),
        checkpoint=_checkpoint_spec(model.checkpoint, stages, findings),
    )


def _checkpoint_spec(checkpoint: Any, stages: tuple[StageSpec, ...], findings: _Findings) -> CheckpointSpec:
    """The checkpoint section: every class a dotted path, a config class with its model_type."""
    for name, what in (("config_class", "Class"), ("request_builder", "Class"), ("synthetic", "function")):
        value = getattr(checkpoint, name)
        if value is not None and not is_dotted_path(value):
            findings.add(f"checkpoint.{name}", f"{value!r} is not a dotted path; write package.module.{what}")
    for arch, path in checkpoint.extra_classes.items():
        if not is_identifier(arch):
            findings.add(f"checkpoint.extra_classes.{arch}", f"{arch!r} is not an architecture name")
        if not is_dotted_path(path):
            findings.add(
                f"checkpoint.extra_classes.{arch}",
                f"{path!r} is not a dotted path; write package.module.Class",
            )
    if checkpoint.provider is not None and not re.fullmatch(
        r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", checkpoint.provider
    ):
        findings.add(
            "checkpoint.provider",
            f"{checkpoint.provider!r} is not a distribution name (letters, digits, . _ -), e.g. vllm-omni",
        )
    for name in ("install", "model_type"):
        value = getattr(checkpoint, name)
        if value is not None and (not value.strip() or len(value) > 200 or any(c in value for c in "\n\r\0")):
            findings.add(f"checkpoint.{name}", f"{value!r} must be one line of at most 200 characters")
    if (checkpoint.config_class is None) != (checkpoint.model_type is None):
        findings.add(
            "checkpoint.model_type",
            "config_class and model_type go together: the class is registered under the "
            "checkpoint's model_type; set both or neither",
        )
    if checkpoint.provider is not None and not any(s.model_class for s in stages):
        findings.add(
            "checkpoint.provider",
            f"{checkpoint.provider!r} provides no class: name each stage's model_class, or drop the provider",
        )
    return CheckpointSpec(
        provider=checkpoint.provider,
        install=checkpoint.install,
        model_type=checkpoint.model_type,
        config_class=checkpoint.config_class,
        extra_classes=tuple(sorted(checkpoint.extra_classes.items())),
        request_builder=checkpoint.request_builder,
        synthetic=checkpoint.synthetic,
    )


def _check_preprocess(pre: Any, is_gen: bool, key: str, add: Any) -> None:
    """``stages.S.preprocess``: the row hook and decode batching."""
    if pre.decode_batch is not DecodeBatch.none and not pre.hook:
        add(
            f"{key}.preprocess.decode_batch",
            f"{pre.decode_batch.value} needs preprocess.hook: true (rows outside a decode batch "
            "go to model.preprocess); enable the hook or set decode_batch: none",
        )
    if pre.attach_request_features and not pre.hook:
        add(
            f"{key}.preprocess.attach_request_features",
            "attaches features to the preprocess hook's infos; set preprocess.hook: true or turn it off",
        )
    if is_gen and pre.decode_batch is not DecodeBatch.none:
        add(
            f"{key}.preprocess.decode_batch", "a generation stage has no decode steps; set decode_batch: none"
        )


def _mtp_spec(mtp_cfg: Any, pre: Any, is_gen: bool, key: str, add: Any) -> MTPSpec | None:
    """``stages.S.mtp``: the talker's code predictor, or None where it is off."""
    mtp: MTPSpec | None = None
    # String keys are checked whether or not their feature is on: none may reach generated code
    # (or its header) unchecked.
    if len(mtp_cfg.output_key) != 2 or not all(is_identifier(p) for p in mtp_cfg.output_key):
        add(
            f"{key}.mtp.output_key",
            f"{list(mtp_cfg.output_key)!r} must be two identifiers [type, qualifier], e.g. [codes, audio]",
        )
    if not is_dotted_path(mtp_cfg.hidden_size_from):
        add(
            f"{key}.mtp.hidden_size_from",
            f"{mtp_cfg.hidden_size_from!r} is not an attribute path under model_config, "
            "e.g. hf_text_config.hidden_size",
        )
    _check_sampling(mtp_cfg.sampling, f"{key}.mtp.sampling", add)
    if mtp_cfg.enabled:
        if is_gen:
            add(
                f"{key}.mtp.enabled",
                "a talker MTP runs after an autoregressive talker step; a generation stage "
                "cannot have one (set kind: ar or mtp.enabled: false)",
            )
        if not pre.hook:
            add(
                f"{key}.mtp.enabled",
                "the MTP inputs come from the preprocess hook (update['mtp_inputs']); "
                "set preprocess.hook: true",
            )
        if pre.decode_batch is DecodeBatch.plain:
            add(
                f"{key}.preprocess.decode_batch",
                "plain batching sends single-token decode rows to the 3-tuple hook, so they would "
                "never reach the talker MTP; use decode_batch: mtp (the 5-tuple hook) or none",
            )
        mtp = MTPSpec(
            graph=mtp_cfg.graph,
            owns_talker_module=mtp_cfg.owns_talker_module,
            hidden_size_from=mtp_cfg.hidden_size_from,
            output_key=tuple(mtp_cfg.output_key) if len(mtp_cfg.output_key) == 2 else ("codes", "audio"),  # type: ignore[arg-type]
            per_row_generators=mtp_cfg.per_row_generators,
            sampling=tuple(sorted(vars(mtp_cfg.sampling).items())),
        )
    else:
        if pre.decode_batch is DecodeBatch.mtp:
            add(
                f"{key}.preprocess.decode_batch",
                "mtp batching feeds the talker MTP; set mtp.enabled: true or decode_batch: plain",
            )
        if mtp_cfg.per_row_generators is not PerRowGenerators.never:
            add(
                f"{key}.mtp.per_row_generators",
                "only an MTP stage takes generators; set mtp.enabled: true or per_row_generators: never",
            )
    return mtp


def _gpu_resident_keys(raw_keys: Any, key: str, add: Any) -> list[tuple[str, str]]:
    """``stages.S.buffers.gpu_resident``: ``type.qualifier`` keys kept on the device."""
    gpu_keys: list[tuple[str, str]] = []
    for i, raw in enumerate(raw_keys):
        parts = raw.split(".")
        if len(parts) != 2 or not all(is_identifier(p) for p in parts):
            add(
                f"{key}.buffers.gpu_resident[{i}]",
                f"{raw!r} must be 'type.qualifier' (two identifiers), e.g. codes.audio",
            )
            continue
        gpu_keys.append((parts[0], parts[1]))
    if len(set(gpu_keys)) != len(gpu_keys):
        add(f"{key}.buffers.gpu_resident", "lists a key twice; keep each key once")
    return gpu_keys


def _check_outputs(stage: Any, is_gen: bool, key: str, add: Any) -> None:
    """``stages.S.outputs`` (and the positions and final output they go with)."""
    outputs = stage.outputs
    if outputs.request_end_payload and stage.next_stage_input is None:
        add(
            f"{key}.outputs.request_end_payload",
            "defers a payload that this stage never sends (next_stage_input is null); "
            "set next_stage_input or turn request_end_payload off",
        )
    if outputs.request_end_payload and not stage.full_payload:
        add(
            f"{key}.outputs.request_end_payload",
            "defers the full payload but full_payload is false; set full_payload: true",
        )
    if outputs.has_finish_decode_step and not outputs.decode_step_metadata:
        add(
            f"{key}.outputs.has_finish_decode_step",
            "is only called around decode-step metadata; set outputs.decode_step_metadata: true or turn it off",
        )
    if is_gen and outputs.decode_step_metadata:
        add(f"{key}.outputs.decode_step_metadata", "a generation stage has no decode steps; turn it off")
    if is_gen and stage.positions.mrope:
        add(f"{key}.positions.mrope", "M-RoPE positions belong to an autoregressive stage; turn it off")
    if stage.final_output is FinalOutput.audio and not outputs.multimodal:
        add(
            f"{key}.outputs.multimodal",
            "a stage that publishes audio returns it as a multimodal output; set outputs.multimodal: true",
        )


def _stage_spec(model: ModelConf, name: str, stage: Any, *, is_last: bool, findings: _Findings) -> StageSpec:
    key = f"stages.{name}"
    add = findings.add
    if not is_identifier(name) or name.startswith("_") or name in _RESERVED_STAGE_NAMES:
        add(
            key,
            f"stage name {name!r} must be a Python identifier (at most 100 characters, not a keyword) "
            f"that does not start with an underscore and is not {', '.join(sorted(_RESERVED_STAGE_NAMES))} (it names a module beside the "
            "package's own files); rename it (letters, digits, underscores)",
        )
    arch = stage.arch or model.arch
    if stage.arch is not None and not is_identifier(stage.arch):
        add(f"{key}.arch", f"{stage.arch!r} is not a Python identifier; use vLLM's model_arch name")
    if stage.model_class is not None and not is_dotted_path(stage.model_class):
        add(f"{key}.model_class", f"{stage.model_class!r} is not a dotted path; write package.module.Class")
    is_gen = stage.kind is StageKind.generation

    if stage.next_stage_input is not None:
        _check_glue_name(stage.next_stage_input, f"{key}.next_stage_input", add)
        if is_last:
            add(
                f"{key}.next_stage_input",
                "the last stage has no next stage to feed; set it to null or add the consuming stage",
            )

    _check_serving_keys(stage, key, add)

    pre = stage.preprocess
    _check_preprocess(pre, is_gen, key, add)
    mtp = _mtp_spec(stage.mtp, pre, is_gen, key, add)
    gpu_keys = _gpu_resident_keys(stage.buffers.gpu_resident, key, add)
    _check_outputs(stage, is_gen, key, add)
    _check_real_model_keys(stage, key, is_gen, add)
    post = stage.postprocess
    deployment = stage.model_config

    return StageSpec(
        name=name,
        order=stage.order,
        kind=stage.kind,
        arch=arch,
        final_output=stage.final_output,
        next_stage_input=stage.next_stage_input,
        full_payload=stage.full_payload,
        transport=stage.transport,
        publish=tuple(stage.publish),
        input_function=stage.input_function,
        devices=stage.devices,
        decode_batch=pre.decode_batch,
        mtp=mtp,
        gpu_resident_keys=tuple(sorted(gpu_keys)),
        refresh_every_step=stage.buffers.refresh_every_step,
        postprocess=PostprocessSpec(
            uses_hidden_states=post.uses_hidden_states,
            uses_multimodal_outputs=post.uses_multimodal_outputs,
            uses_req_infos=post.uses_req_infos,
        )
        if post.hook
        else None,
        model_sampler=stage.sampler is Sampler.model,
        model_class=stage.model_class,
        model_stage=deployment.model_stage,
        hf_config_name=deployment.hf_config_name,
        stream=_stream_spec(stage.stream),
        # The one-switch features (omnigen.features): each read from its key.
        **read_flags(stage, is_generation=is_gen),
    )


def _stream_spec(stream: Any) -> StreamSpec | None:
    if not stream.enabled:
        return None
    return StreamSpec(
        window=stream.window,
        chunk_frames=stream.chunk_frames,
        left_context_frames=stream.left_context_frames,
        initial_chunk_frames=stream.initial_chunk_frames,
        ramp=tuple(stream.ramp),
        coalesce=stream.coalesce,
        playback_rate_hz=stream.playback_rate_hz,
        playback_lead_s=stream.playback_lead_s,
    )


def _check_edges(stages: tuple[StageSpec, ...], findings: _Findings) -> None:
    """Each edge has at most one glue function: the producer's or the consumer's (CONTRACT 8.2)."""
    if stages and stages[0].input_function is not None:
        findings.add(
            f"stages.{stages[0].name}.input_function",
            "the first stage has no previous stage; its input is the caller's prompt: remove it",
        )
    if stages and stages[-1].stream is not None and stages[-1].next_stage_input is None:
        # (A last stage with a next_stage_input has its own finding.)
        findings.add(
            f"stages.{stages[-1].name}.stream.enabled",
            "streams to the next stage, but the last stage feeds none; turn it off",
        )
    for before, after in zip(stages, stages[1:], strict=False):
        if before.stream is not None and before.next_stage_input is None and after.input_function is None:
            # The windows replace the edge's glue, so the edge must have one (on either side).
            findings.add(
                f"stages.{before.name}.stream.enabled",
                f"streams to {after.name!r}, but the edge has no glue function (next_stage_input is null "
                f"and {after.name!r} names no input_function); turn it off",
            )
        if before.stream is not None and after.kind is not StageKind.generation:
            findings.add(
                f"stages.{before.name}.stream.enabled",
                f"windows are decoded by a generation stage, and {after.name!r} is {after.kind.value}; "
                "turn streaming off for this edge",
            )
        if before.next_stage_input is not None and after.input_function is not None:
            findings.add(
                f"stages.{after.name}.input_function",
                f"stage {before.name!r} already names the edge's function (next_stage_input: "
                f"{before.next_stage_input}); keep one of the two",
            )


def _check_glue_name(name: str, key: str, add: Any) -> None:
    """A glue function's name: a dotted path, and not one of vllm-omni's (never imported)."""
    if not is_dotted_path(name):
        add(key, f"{name!r} is not a dotted path; write package.module.function")
    elif name.startswith("vllm_omni."):
        add(key, _vllm_omni_glue_problem(name))


def _vllm_omni_glue_problem(name: str) -> str:
    from omnigen.vllm_omni_ports import VLLM_OMNI_EQUIVALENTS

    ours = [own for own, theirs in VLLM_OMNI_EQUIVALENTS.items() if name in theirs]
    instead = f"use omnigen's port, {ours[0]}" if ours else "port it to omnigen/glue (see its README)"
    return f"{name!r} is vllm-omni's; nothing omnigen runs imports vllm_omni: {instead}"


def _check_serving_keys(stage: Any, key: str, add: Any) -> None:
    """The keys of serving a pipeline (CONTRACT 8): published keys, transport, devices."""
    for i, name in enumerate(stage.publish):
        if not is_dotted_path(name):
            add(
                f"{key}.publish[{i}]",
                f"{name!r} is not a payload key; write a dotted key such as audio or codes.audio",
            )
    if len(set(stage.publish)) != len(stage.publish):
        add(f"{key}.publish", f"{list(stage.publish)} names a key twice; name each once")
    if stage.transport is not Transport.inline and stage.next_stage_input is None:
        add(
            f"{key}.transport",
            f"{stage.transport.value}, but the stage feeds no next stage (next_stage_input is null); "
            "remove it or set next_stage_input",
        )
    if stage.input_function is not None:
        _check_glue_name(stage.input_function, f"{key}.input_function", add)
    _check_stream(stage, key, add)
    if stage.devices is not None and not _DEVICES.fullmatch(stage.devices):
        add(
            f"{key}.devices",
            f'{stage.devices!r} is not a device list; write CUDA_VISIBLE_DEVICES form, e.g. "0" or "1,2"',
        )


def _check_stream(stage: Any, key: str, add: Any) -> None:
    """A streaming edge needs a producer, a window function and windows of at least a frame."""
    stream = stage.stream
    for name in ("chunk_frames", "initial_chunk_frames"):
        if getattr(stream, name) < 1:
            add(f"{key}.stream.{name}", f"{getattr(stream, name)} frames: a window holds at least 1 frame")
    if stream.left_context_frames < 0:
        add(f"{key}.stream.left_context_frames", f"{stream.left_context_frames}: write 0 or more frames")
    for i, size in enumerate(stream.ramp):
        if size < 1:
            add(f"{key}.stream.ramp[{i}]", f"{size} frames: a window holds at least 1 frame")
    if stream.playback_rate_hz is not None:
        if not stream.playback_rate_hz > 0:
            add(
                f"{key}.stream.playback_rate_hz",
                f"{stream.playback_rate_hz}: write frames per second above 0, or null",
            )
        if not stream.coalesce:
            add(
                f"{key}.stream.playback_rate_hz",
                "holding windows for playback needs coalesce (a held window takes every frame ready); "
                "set coalesce: true or playback_rate_hz: null",
            )
    if not stream.playback_lead_s >= 0:
        add(f"{key}.stream.playback_lead_s", f"{stream.playback_lead_s}: write 0 or more seconds")
    if stream.window is not None:
        _check_glue_name(stream.window, f"{key}.stream.window", add)
    if not stream.enabled:
        return
    if stream.window is None:
        add(
            f"{key}.stream.window",
            "a streaming edge needs its window function; name one (e.g. omnigen.glue.qwen3_tts.talker2code2wav_window)",
        )


def _check_real_model_keys(stage: Any, key: str, is_gen: bool, add: Any) -> None:
    """The CONTRACT 7 keys that cannot hold together, or not on this kind of stage."""
    outputs = stage.outputs
    post = stage.postprocess
    if not post.hook and not (
        post.uses_hidden_states and post.uses_multimodal_outputs and post.uses_req_infos
    ):
        add(
            f"{key}.postprocess",
            "says what the hook uses but postprocess.hook is false; set hook: true or drop the uses_* keys",
        )
    if is_gen and post.hook:
        add(
            f"{key}.postprocess.hook",
            "postprocess runs after a step's sampling, and a generation stage samples nothing; "
            "turn it off (or set kind: ar)",
        )
    if is_gen and stage.sampler is Sampler.model:
        add(f"{key}.sampler", "a generation stage samples nothing; set sampler: vllm")
    if is_gen and outputs.logits_sampling_metadata:
        add(f"{key}.outputs.logits_sampling_metadata", "a generation stage computes no logits; turn it off")
    if not is_gen and stage.generation.request_ids:
        add(
            f"{key}.generation.request_ids",
            "only a generation stage's forward gets request_ids; turn it off or set kind: generation",
        )
    if outputs.make_omni_output and not outputs.multimodal:
        add(
            f"{key}.outputs.make_omni_output",
            "assembles an OmniOutput, so the stage has multimodal outputs; set outputs.multimodal: true",
        )
    if stage.positions.mrope and stage.positions.mrope_fallback:
        add(
            f"{key}.positions.mrope_fallback",
            "the model computes its own M-RoPE positions (positions.mrope: true); keep one of the two",
        )
    if is_gen and stage.positions.mrope_fallback:
        add(
            f"{key}.positions.mrope_fallback",
            "M-RoPE positions belong to an autoregressive stage; turn it off",
        )
    deployment = stage.model_config
    for field_name in ("model_stage", "hf_config_name"):
        value = getattr(deployment, field_name)
        if value is not None and not is_identifier(value):
            add(
                f"{key}.model_config.{field_name}",
                f"{value!r} is not an identifier; use the name the model class reads (e.g. talker, "
                "talker_config)",
            )


def _check_sampling(sampling: Any, key: str, add: Any) -> None:
    if sampling.temperature is not None and not 0 < sampling.temperature < math.inf:
        add(f"{key}.temperature", f"{sampling.temperature} must be a finite number > 0 (or null)")
    if sampling.top_p is not None and not 0 < sampling.top_p <= 1:
        add(f"{key}.top_p", f"{sampling.top_p} must be in (0, 1] (or null)")
    if sampling.top_k is not None and sampling.top_k < 0:
        add(f"{key}.top_k", f"{sampling.top_k} must be >= 0 (0 disables; or null)")
