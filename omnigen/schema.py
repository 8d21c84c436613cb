"""The typed shape of an omnigen config: what a user may write in ``conf/``.

These are OmegaConf structured configs: Hydra validates every composed config
against them, so an unknown key or a value outside an enum fails at compose
time with the full key. Each field carries a docstring (the string literal
after it); ``omnigen explain`` and the schema tests read them with ``ast``.

Semantic checks that span fields (an MTP on a generation stage, a payload with
nowhere to go) belong to ``spec.py``, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

# The serve section: its own module, which serving reads without the model schema.
from omnigen.serve_schema import (  # noqa: F401  (re-exported: the schema is the whole config's)
    PipelineMode,
    PromptTokens,
    RayConf,
    RayStageConf,
    RunRequestConf,
    ServeConf,
)


# The config's choices. StrEnums: a member equals its value and formats as it, so the templates,
# plan.yaml and explain read a choice as its text while the spec and the plan keep the enum.
class StageKind(StrEnum):
    """How vLLM drives a stage."""

    ar = "ar"
    generation = "generation"


class FinalOutput(StrEnum):
    """What a stage publishes to the user, if anything."""

    none = "none"
    text = "text"
    audio = "audio"


class DecodeBatch(StrEnum):
    """How adjacent single-token decode rows reach the model's hooks."""

    none = "none"
    mtp = "mtp"
    plain = "plain"


class MTPGraph(StrEnum):
    """Whether the talker code predictor may be captured in a full CUDA graph."""

    auto = "auto"
    safe = "safe"
    unsafe = "unsafe"


class PerRowGenerators(StrEnum):
    """Whether one batched predictor call may take a list of per-row generators."""

    never = "never"
    always = "always"
    eager_only = "eager_only"


class Sampler(StrEnum):
    """Who turns a step's logits into tokens."""

    vllm = "vllm"
    model = "model"


class Transport(StrEnum):
    """How a producer's payload travels to the next stage's request."""

    inline = "inline"
    shm = "shm"
    ray = "ray"


class Device(StrEnum):
    """Which vLLM runner and worker a generated worker builds on."""

    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


@dataclass
class PreprocessConf:
    """The model hooks that rewrite a step's inputs before the forward (CONTRACT 3)."""

    hook: bool = False
    """The model has ``preprocess(input_ids, input_embeds, **req_infos)``, called once per row."""

    batch_hook: bool = False
    """The model has ``preprocess_batch(req_ids, model_intermediate_buffer, device)``, called
    once per step before the rows."""

    decode_batch: DecodeBatch = DecodeBatch.none
    """Adjacent single-token decode rows go to ``preprocess_decode_batch`` in one call:
    ``mtp`` (5-tuple, feeds the talker MTP), ``plain`` (3-tuple, written in place), or ``none``."""

    attach_request_features: bool = False
    """Each row's infos get the request's ``mm_features`` and ``req_id`` (MiMo-Audio's fused stage)."""


@dataclass
class PostprocessConf:
    """The model hook that reads a step's outputs after sampling (CONTRACT 7.1)."""

    hook: bool = False
    """The model has ``postprocess(hidden_states, multimodal_outputs=..., **req_infos)``, called
    once per row after each step; its update is merged into the row's buffer before the next
    step's preprocess."""

    uses_hidden_states: bool = True
    """The hook gets the row's own text hidden states (else the step's, whole)."""

    uses_multimodal_outputs: bool = True
    """The hook gets the step's multimodal outputs (else None)."""

    uses_req_infos: bool = True
    """The hook gets the row's buffer as keyword arguments, less ``hidden_states`` (else none)."""


@dataclass
class MTPSamplingConf:
    """Default sampling of the code predictor; a deployment's
    ``model_config.subtalker_sampling_params`` overrides it key by key."""

    do_sample: Optional[bool] = None
    """Sample (true) or take the argmax (false); null leaves it to the predictor."""

    temperature: Optional[float] = None
    """Softmax temperature, > 0; null leaves it to the predictor."""

    top_k: Optional[int] = None
    """Keep the k most likely codes, >= 0 (0 disables); null leaves it to the predictor."""

    top_p: Optional[float] = None
    """Nucleus mass in (0, 1]; null leaves it to the predictor."""


@dataclass
class MTPConf:
    """The talker's multi-token code predictor, run after the talker step (CONTRACT 2)."""

    enabled: bool = False
    """The stage runs ``model.talker_mtp`` on its single-token decode rows."""

    graph: MTPGraph = MTPGraph.auto
    """``safe``: wrap the predictor in the platform's full-graph wrapper when full CUDA graphs
    are on; ``unsafe``: never wrap; ``auto``: safe for a stage that owns a separate talker
    module, unsafe otherwise (resolved when generating)."""

    owns_talker_module: bool = False
    """The stage's model holds the talker as a separate module (decides ``graph: auto``)."""

    hidden_size_from: str = "hf_text_config.hidden_size"
    """Attribute path under vLLM's ``model_config`` that gives the width of the MTP buffers,
    read when the model loads (e.g. ``hf_config.talker_config.hidden_size`` for a TTS talker)."""

    output_key: List[str] = field(default_factory=lambda: ["codes", "audio"])
    """Where the predicted codes land in a request's buffer: ``[type, qualifier]``."""

    per_row_generators: PerRowGenerators = PerRowGenerators.never
    """Whether a batched predictor call accepts ``generators=[...]`` (one per row):
    ``always``, ``never`` (seeded rows then run one call each), or ``eager_only`` (only when
    the predictor is not graph-wrapped)."""

    sampling: MTPSamplingConf = field(default_factory=MTPSamplingConf)
    """Default sampling parameters passed to the predictor."""


@dataclass
class BuffersConf:
    """The per-request buffer ``model_intermediate_buffer[req_id]`` (CONTRACT 4)."""

    gpu_resident: List[str] = field(default_factory=list)
    """``type.qualifier`` keys whose tensors stay on the device; every other tensor moves to CPU."""

    refresh_every_step: bool = False
    """Merge the scheduler's per-request payloads into the buffer on every step."""

    replace_on_marker: bool = False
    """A payload with ``meta.replace_runtime_additional_information`` true replaces the buffer
    instead of merging into it."""


@dataclass
class OutputsConf:
    """What the stage's forward produces beside text hidden states (CONTRACT 1, 5)."""

    multimodal: bool = False
    """The forward returns an ``OmniOutput`` with a multimodal payload."""

    decode_step_metadata: bool = False
    """Call ``model.update_decode_step_metadata`` before each forward and
    ``model.finish_decode_step_forward`` after it."""

    has_finish_decode_step: bool = False
    """The model defines ``finish_decode_step_forward`` (only with ``decode_step_metadata``)."""

    request_end_payload: bool = False
    """Keep the full payload on the device until the request ends (defer the device-to-host copy)."""

    make_omni_output: bool = False
    """The model has ``make_omni_output(output, **forward_kwargs)``, which assembles the step's
    ``OmniOutput`` from a forward that returned something else (CONTRACT 7.2)."""

    payload_hidden: bool = False
    """Each request's step payload also carries its text hidden rows as ``hidden`` (7.2)."""

    request_token_spans: bool = False
    """The forward (and ``make_omni_output``) get ``request_token_spans``: each row's
    ``(start, end)`` hidden rows."""

    query_start_loc: bool = False
    """``update_decode_step_metadata`` and the forward get ``omni_query_start_loc``, vLLM's
    ``query_start_loc`` of the step (7.7)."""

    set_batch_req_ids: bool = False
    """The model has ``set_batch_req_ids(req_ids)``, called after each forward, before the
    logits (7.7)."""

    logits_sampling_metadata: bool = False
    """The model's ``compute_logits`` takes ``sampling_metadata=`` and is given vLLM's (7.7)."""


@dataclass
class PositionsConf:
    """How positions are computed for the stage's forward."""

    mrope: bool = False
    """The stage uses multimodal rotary positions (``get_mrope_input_positions``)."""

    mrope_fallback: bool = False
    """The stage's checkpoints use M-RoPE but its model has no ``get_mrope_input_positions``:
    text-only positions are computed instead of vLLM's assertion (CONTRACT 7.6)."""


@dataclass
class GenerationConf:
    """What a generation stage's forward is told about the step's requests (CONTRACT 7.3)."""

    seq_token_counts: bool = True
    """The forward gets ``seq_token_counts``: each request's scheduled token count."""

    request_ids: bool = False
    """The forward gets ``request_ids``: the step's request ids in row order."""


@dataclass
class StageModelConfigConf:
    """Fields of vLLM's ``model_config`` the generated worker sets for this stage (CONTRACT 7.5)."""

    model_stage: Optional[str] = None
    """For a model class that serves several stages: which one this is (``model_stage``)."""

    hf_config_name: Optional[str] = None
    """The checkpoint sub-config that is this stage's text config (e.g. ``talker_config``), so
    vLLM's input widths and vocabulary are the stage's; null keeps vLLM's."""


@dataclass
class StreamConf:
    """How a producer hands its output to the next stage while it still runs (a streaming edge).

    The producer publishes what it has accumulated at window boundaries; the pipeline cuts the
    next stage's input into windows of codec frames, each decoded by one request of the next
    (generation) stage with ``left_context_frames`` frames before it, and hands each window's
    audio to the caller as it comes. Off: the next stage starts when this one finishes."""

    enabled: bool = False
    """The edge to the next stage streams (``window`` must then name the window function)."""

    window: Optional[str] = None
    """Dotted path of the glue function that turns the producer's payload so far and one window
    (``omnigen.glue.types.Window``) into the next stage's request, e.g.
    ``omnigen.glue.qwen3_tts.talker2code2wav_window``."""

    chunk_frames: int = 25
    """Codec frames per window after the first ones."""

    left_context_frames: int = 25
    """Frames before a window that its request decodes again and drops, so the vocoder sees the
    history its receptive field needs (the audio at a seam then matches a one-shot decode)."""

    initial_chunk_frames: int = 25
    """Frames of the first window: smaller gives the first audio sooner, at a seam sooner."""

    ramp: List[int] = field(default_factory=list)
    """Sizes of the windows after the first, before ``chunk_frames`` takes over (e.g.
    ``[4, 8, 16]``); empty: none."""

    coalesce: bool = True
    """A request's windows are decoded one after another, and the next takes every window of
    frames ready by then: when the next stage lags (under load), windows grow, so it gets fewer
    requests and decodes less left context again. False: each window its own size, up to four
    decoding at once. Either way the window edges lie on the same grid."""

    playback_rate_hz: Optional[float] = None
    """Codec frames per second of the audio the next stage makes (Qwen3-TTS-12Hz: 12.5). Set, a
    request's windows after the first are held while the caller still has more than
    ``playback_lead_s`` of audio to play (counted from its first audio, played in real time),
    then take every frame ready: a producer faster than real time sends fewer, larger windows.
    Needs ``coalesce``. Null: each window goes as soon as it is ready."""

    playback_lead_s: float = 1.0
    """With ``playback_rate_hz``: how much audio the caller still has to play when the next
    window is sent (covers decoding it and the trip to the caller)."""


@dataclass
class CheckpointConf:
    """How a real checkpoint of the model is served: who provides its classes, how a request
    becomes the first stage's input. Registered with vLLM in every process that serves the model."""

    provider: Optional[str] = None
    """The distribution that provides the model classes (``vllm-omni``); null: omnigen or vLLM."""

    install: Optional[str] = None
    """The command that installs the provider (named in the error when it is missing)."""

    model_type: Optional[str] = None
    """The checkpoint's ``config.json`` ``model_type``, registered with transformers' ``AutoConfig``
    and vLLM's config registry when ``config_class`` is set."""

    config_class: Optional[str] = None
    """Dotted path of the checkpoint's HF config class; null: transformers knows ``model_type``."""

    extra_classes: Dict[str, str] = field(default_factory=dict)
    """Further ``arch: dotted.path.Class`` a stage's class builds through vLLM's registry (the parts
    of a wrapper class)."""

    request_builder: Optional[str] = None
    """Dotted path of the class that turns a user's request into the first stage's prompt and
    payload (``omnigen.requests``); null: the first stage takes the text (or token ids) as given."""

    synthetic: Optional[str] = None
    """Dotted path of a function ``(folder, variant) -> model path`` that writes a synthetic
    checkpoint of one stage (random weights) into ``folder``: ``serve.models.STAGE=synthetic:VARIANT``
    calls it (omnigen's tiny test models declare ``omnigen_testing.tiny_omni.write_synthetic``)."""


@dataclass
class StageConf:
    """One stage of a model's pipeline, run by one generated runner."""

    order: int = MISSING
    """Position of the stage in the pipeline (ascending); the stages dict is keyed by name."""

    kind: StageKind = MISSING
    """``ar`` (autoregressive LLM) or ``generation`` (vocoder, codec decoder)."""

    arch: Optional[str] = None
    """The ``model_arch`` vLLM sees for this stage; null means the model's ``arch``."""

    model_class: Optional[str] = None
    """Dotted path of the model class vLLM builds for ``arch``, registered with vLLM's
    ``ModelRegistry`` wherever the model is served; null: a class vLLM knows by itself."""

    final_output: FinalOutput = FinalOutput.none
    """What the stage publishes to the user: ``none``, ``text`` or ``audio``."""

    next_stage_input: Optional[str] = None
    """Dotted path of the function that turns this stage's output into the next stage's
    input (the stage is a producer); null for a stage that feeds nothing."""

    full_payload: bool = True
    """The producer also sends a full payload when the request ends (unless async chunks
    are on); ignored when ``next_stage_input`` is null."""

    input_function: Optional[str] = None
    """Dotted path of the glue function this stage applies to the previous stage's finished
    request, where the previous stage names none (vllm-omni's consumer-side input functions,
    e.g. ``omnigen.glue.minicpmo_4_5.llm2tts``); the previous stage then publishes every key."""

    transport: Transport = Transport.inline
    """How this producer's payload reaches the next stage's request: ``inline`` (in its
    ``SamplingParams.extra_args``), ``shm`` (a shared-memory segment the consumer releases;
    the request carries its handle; one machine) or ``ray`` (an object in Ray's object store,
    freed once the consumer's replica has read it; ``serve.mode=ray`` only, docs/ray.md).
    Ignored when ``next_stage_input`` is null."""

    publish: List[str] = field(default_factory=list)
    """Payload keys this stage publishes to its caller (``RequestOutput.kv_transfer_params
    ["omnigen"]``, CONTRACT 8.1), e.g. ``[audio]``; a key names itself and the dotted keys under
    it. Empty on a stage with a ``final_output``: every key. A producer also publishes everything
    it accumulates for the next stage."""

    stream: StreamConf = field(default_factory=StreamConf)
    """Whether this producer's edge to the next stage streams, and its windows."""

    devices: Optional[str] = None
    """The devices of this stage's engine in a pipeline with one engine-core process per stage
    (``CUDA_VISIBLE_DEVICES``, e.g. ``"0"`` or ``"1,2"``); null: the process's own. Not in
    ``serve.mode=ray``, where Ray assigns them (``serve.ray.stages.STAGE.num_gpus``)."""

    preprocess: PreprocessConf = field(default_factory=PreprocessConf)
    """Model hooks that rewrite the step's inputs."""

    mtp: MTPConf = field(default_factory=MTPConf)
    """Talker multi-token prediction."""

    buffers: BuffersConf = field(default_factory=BuffersConf)
    """Per-request buffer policies."""

    outputs: OutputsConf = field(default_factory=OutputsConf)
    """Output policies."""

    positions: PositionsConf = field(default_factory=PositionsConf)
    """Position policies."""

    postprocess: PostprocessConf = field(default_factory=PostprocessConf)
    """The model hook after the forward."""

    sampler: Sampler = Sampler.vllm
    """``vllm``: vLLM's sampler; ``model``: the model's ``sample(logits, sampling_metadata)``,
    falling back to vLLM's when it returns None (CONTRACT 7.4)."""

    on_requests_finished: bool = False
    """The model has ``on_requests_finished(finished_req_ids)``, called when requests end (7.3)."""

    generation: GenerationConf = field(default_factory=GenerationConf)
    """Forward arguments of a generation stage (ignored on an autoregressive one)."""

    model_config: StageModelConfigConf = field(default_factory=StageModelConfigConf)
    """Deployment fields the worker sets on vLLM's ``model_config``."""


@dataclass
class ModelConf:
    """A model served as a pipeline of stages."""

    name: str = MISSING
    """The config name: ``conf/model/<name>.yaml`` and ``omnigen.generated.<name>``."""

    title: str = MISSING
    """Human name used in docstrings, e.g. ``Qwen3-Omni``."""

    arch: str = MISSING
    """The ``model_arch`` vLLM sees (architecture in the HF config)."""

    async_chunk: bool = False
    """Producers stream chunks to the next stage while running instead of a full payload at
    request end (a deployment choice)."""

    stages: Dict[str, StageConf] = field(default_factory=dict)
    """The stages, keyed by stage name (a Python identifier); ``order`` sets their sequence."""

    checkpoint: CheckpointConf = field(default_factory=CheckpointConf)
    """How the model's real checkpoints are served (classes, provider, request builder)."""


@dataclass
class OmniGenConfig:
    """The root config that ``omnigen build`` composes."""

    model: ModelConf = MISSING
    """The model to generate (``model=NAME`` picks ``conf/model/NAME.yaml``)."""

    device: Device = Device.auto
    """Which vLLM runner/worker the generated worker builds on: ``cuda``, ``cpu``, or ``auto``
    (decided when vLLM loads the worker, from vLLM's current platform)."""

    mtp_graph: Optional[MTPGraph] = None
    """Preset that overrides ``mtp.graph`` of every MTP stage (set by the ``graph`` group); null
    keeps each stage's own setting."""

    out: Optional[str] = None
    """Output directory; null writes the package's ``generated/`` tree. Required with ``--multirun``."""

    package: Optional[str] = None
    """The dotted name ``out=DIR`` imports as (its serve lines and ``WORKERS`` name it); null: the
    folder's own name (``out=/x/my_variant`` is ``my_variant``). A stated name must end in the
    folder's path (``package=acme.variants`` for ``out=/src/acme/variants``)."""

    serve: ServeConf = field(default_factory=ServeConf)
    """How ``omnigen run`` and ``omnigen serve`` run the pipeline; not read by ``build``."""


def require_choices(where: str, holder: object, fields: dict[str, type[StrEnum]]) -> None:
    """Each named field of ``holder`` is a member of its choice enum, not text (the spec and the
    plan check this when built; ``where`` names the holder in the error)."""
    for name, enum in fields.items():
        value = getattr(holder, name)
        if not isinstance(value, enum):
            raise TypeError(f"{where}: {name} must be a {enum.__name__}, not {value!r}")


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    # The model node of the root schema is typed ModelConf, so every conf/model/*.yaml
    # merged into it is validated without a schema entry in the model group.
    cs.store(name="omnigen_schema", node=OmniGenConfig)


SCHEMA_CLASSES: tuple[type, ...] = (
    PreprocessConf,
    PostprocessConf,
    MTPSamplingConf,
    MTPConf,
    BuffersConf,
    OutputsConf,
    PositionsConf,
    GenerationConf,
    StageModelConfigConf,
    StageConf,
    ModelConf,
    RayStageConf,
    RayConf,
    ServeConf,
    OmniGenConfig,
)

ENUMS: tuple[type[Enum], ...] = (
    StageKind,
    FinalOutput,
    DecodeBatch,
    MTPGraph,
    PerRowGenerators,
    Sampler,
    Transport,
    PipelineMode,
    PromptTokens,
    Device,
)


def field_docs() -> dict[str, dict[str, str]]:
    """``{ClassName: {field: docstring}}`` read from the sources of this module and the serve
    section's (``omnigen.serve_schema``)."""
    import ast
    import inspect
    import sys

    from omnigen import serve_schema

    body = [
        node
        for module in (sys.modules[__name__], serve_schema)
        for node in ast.parse(inspect.getsource(module)).body
    ]
    docs: dict[str, dict[str, str]] = {}
    for node in body:
        if not isinstance(node, ast.ClassDef):
            continue
        per_field: dict[str, str] = {}
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                nxt = body[i + 1] if i + 1 < len(body) else None
                if (
                    isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ):
                    per_field[stmt.target.id] = " ".join(nxt.value.value.split())
                else:
                    per_field[stmt.target.id] = ""
        docs[node.name] = per_field
    return docs
