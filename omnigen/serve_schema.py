"""The ``serve`` section of omnigen's config (how ``omnigen run`` and ``omnigen serve`` run a
model's pipeline): typed dataclasses Hydra validates, as ``omnigen.schema`` is for the model.

Its own module so that serving reads its settings' schema without importing the model schema
(the generator's; ``.importlinter``). ``omnigen.schema`` puts it under the root config as ``serve``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional


class PipelineMode(Enum):
    """Where a pipeline's engines run."""

    mp = "mp"
    inproc = "inproc"
    ray = "ray"


class PromptTokens(Enum):
    """How a text prompt becomes the first stage's token ids."""

    model = "model"
    bytes = "bytes"


@dataclass
class RunRequestConf:
    """``omnigen run``'s request options beside ``serve.prompt`` (the HTTP API's fields of the
    same names); a model without a request builder refuses every one that is set."""

    voice: Optional[str] = None
    """A voice of the checkpoint (``GET /v1/audio/voices``); null: the model's default."""

    language: Optional[str] = None
    """The language of the text; null: the model's default (Qwen3-TTS: Auto)."""

    instructions: Optional[str] = None
    """Style instructions (Qwen3-TTS CustomVoice and VoiceDesign)."""

    task_type: Optional[str] = None
    """The model's task (Qwen3-TTS: CustomVoice, VoiceDesign, Base); null: the checkpoint's."""

    ref_audio: Optional[str] = None
    """Reference audio to clone a voice from: a local file or a ``data:`` URI."""

    ref_text: Optional[str] = None
    """The transcript of ``ref_audio``."""

    messages: Optional[List[Dict[str, Any]]] = None
    """A chat model's messages (``'[{role: user, content: Hi}]'``; Qwen3-Omni); null:
    ``serve.prompt`` as one user message. A speech model refuses it."""


@dataclass
class RayStageConf:
    """Where a stage's engines run in ``serve.mode=ray``: each replica is a Ray actor that hosts
    one vLLM engine (docs/ray.md). ``serve.ray.replica`` holds every stage's, and
    ``serve.ray.stages.STAGE`` replaces keys of it for one stage."""

    replicas: int = 1
    """Engines of this stage; each request goes to the replica with the fewest in flight."""

    num_cpus: float = 1.0
    """CPUs Ray reserves for each replica (fractions and 0 are allowed: a reservation, not a limit)."""

    num_gpus: float = 0.0
    """GPUs Ray gives each replica's engine. A stage with tensor or pipeline parallelism
    (``serve.stage_engine.STAGE.tensor_parallel_size`` > 1) leaves it 0: each replica then
    reserves one GPU per rank in a placement group, where vLLM's Ray executor puts its workers."""

    resources: Dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each replica needs, e.g. ``{talker_host: 1}`` for a node started with
    ``ray start --resources='{"talker_host": 1}'``: how a stage is pinned to nodes."""

    label_selector: Dict[str, str] = field(default_factory=dict)
    """Node labels a replica's node must have (``ray start --labels=KEY=VALUE``), e.g.
    ``{ray.io/accelerator-type: H100}``; empty: any node."""

    max_restarts: int = 3
    """How often Ray restarts a replica whose process died (its engine is built again, then takes
    requests); the requests it was running fail (HTTP 503), they are not retried. -1: no limit."""


@dataclass
class RayConf:
    """How ``serve.mode=ray`` uses Ray (read in that mode only)."""

    address: Optional[str] = None
    """The Ray cluster to join (what ``ray start --head`` prints, e.g. ``10.0.0.1:6379``; ``auto``:
    ``RAY_ADDRESS``, else the cluster ``ray start`` runs on this machine); null: start a Ray
    instance for this process alone, stopped when the pipeline closes."""

    namespace: str = "omnigen"
    """The Ray namespace of the stage actors (named ``MODEL-STAGE-N-TOKEN``, a token per pipeline)."""

    env_vars: Dict[str, Any] = field(default_factory=dict)
    """Environment variables of every stage actor (Ray ``runtime_env``), e.g. ``HF_HOME`` or
    ``VLLM_CPU_KVCACHE_SPACE``; a number or boolean is written as text (``1``, ``true``); omnigen
    adds its own plugin's."""

    placement_timeout_s: float = 300.0
    """A replica Ray has not placed on a node after this many seconds fails the start, naming the
    resources it asked for and what the cluster has free."""

    replica: RayStageConf = field(default_factory=RayStageConf)
    """What each stage gets: its replicas, and the resources and restarts of each."""

    stages: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    """Per stage, keys of ``replica`` that replace its values for that stage, e.g.
    ``serve.ray.stages.talker.replicas=2`` or ``'serve.ray.stages.code2wav.resources={gpu_host: 1}'``."""


@dataclass
class ServeConf:
    """How ``omnigen run`` and ``omnigen serve`` run a model's whole pipeline (CONTRACT 8)."""

    checkpoint: Optional[str] = None
    """The checkpoint folder (or hub name) of every stage that ``models`` does not name: the
    released checkpoints of most models are one folder for all their stages."""

    models: Dict[str, Optional[str]] = field(default_factory=dict)
    """Each stage's model where it differs from ``checkpoint``: a checkpoint folder or hub name,
    or ``synthetic:VARIANT`` for a checkpoint the model's ``checkpoint.synthetic`` writer writes
    to a temporary folder (omnigen's tiny test models). A model's serve config
    (``conf/serve/<model>.yaml``) lists its stages, so ``serve.models.STAGE=DIR`` needs no ``+``."""

    mode: PipelineMode = PipelineMode.mp
    """``mp``: one engine-core process per stage; ``inproc``: every engine in this process
    (``run`` on a small machine); ``ray``: each stage's engines as Ray actors, on one machine or
    across a cluster (``serve.ray``, docs/ray.md). ``serve`` needs ``mp`` or ``ray``."""

    ray: RayConf = field(default_factory=RayConf)
    """``serve.mode=ray``: the cluster, and each stage's replicas and resources."""

    engine: Dict[str, Any] = field(default_factory=dict)
    """vLLM engine arguments of every stage (``max_model_len``, ``dtype``, ...)."""

    stage_engine: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    """Per stage, engine arguments that add to or replace ``engine``'s."""

    tokenizer: PromptTokens = PromptTokens.model
    """``model``: the first stage's tokenizer turns text into prompt ids; ``bytes``: each UTF-8
    byte is a token id (offset by 10; for tokenizer-less test models)."""

    max_tokens: int = 256
    """The first autoregressive stages' token budget per request."""

    temperature: float = 0.0
    """Sampling temperature of the autoregressive stages."""

    sampling: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    """Per stage, vLLM ``SamplingParams`` fields of every request (``temperature``, ``top_k``,
    ``min_tokens``, ``repetition_penalty``, ``max_tokens``, ``detokenize``, ...); they replace
    ``max_tokens`` and ``temperature`` for that stage. A request's own seed and token budget win."""

    seed: Optional[int] = None
    """A request's seed (also its code predictor's, ``tts_local_seed``); null: unseeded."""

    sample_rate: Optional[int] = None
    """Samples per second of the final audio stage (the WAV header); null: what the checkpoint
    says (the model's request builder reads it), else 24000."""

    prompt: str = "Hello from omnigen."
    """``omnigen run``'s text prompt."""

    prompt_token_ids: Optional[List[int]] = None
    """``omnigen run``'s prompt as token ids (instead of ``prompt``)."""

    request: RunRequestConf = field(default_factory=RunRequestConf)
    """``omnigen run``'s request options (voice, language, ...)."""

    allowed_local_media_path: Optional[str] = None
    """The folder under which a request's ``ref_audio`` may name a file on the server; null: only
    ``data:`` URIs (as vLLM's ``--allowed-local-media-path``)."""

    output: str = "omnigen.wav"
    """Where ``omnigen run`` writes the audio."""

    stream: bool = False
    """``omnigen run``: write the audio to ``output`` as it is made (``OUTPUT.part`` until the take
    is whole), for a model whose edge into its audio stage streams (``stages.S.stream``); false:
    the whole take at once, from the full payload."""

    host: str = "127.0.0.1"
    """``omnigen serve``'s address."""

    port: int = 8000
    """``omnigen serve``'s port."""

    api_key: Optional[str] = None
    """The bearer token every route but ``/health`` requires (``Authorization: Bearer KEY``);
    null: the environment's ``OMNIGEN_API_KEY``, and without that no key (any caller is served).
    Prefer the environment variable: a key on the command line shows in the process list."""

    max_concurrent_requests: int = 64
    """Requests the pipeline runs at once; more wait in the queue."""

    max_queued_requests: int = 256
    """Requests that may wait for a slot; beyond that a request is answered 429 (``Retry-After``)."""

    request_timeout_s: float = 600.0
    """A request still running after this many seconds is aborted in every stage (504)."""

    max_body_bytes: int = 16777216
    """The largest request body (413 beyond it); 16 MiB holds a 30 s reference clip as a data URI."""
