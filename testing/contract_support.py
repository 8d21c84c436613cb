"""Shared pieces of the contract tests: stage variants, step builders, fakes, snapshots.

Runners are built the way vLLM's own runner unit tests build them: ``object.__new__(Cls)``
plus only the attributes a method reads, on real vLLM types (``CpuGpuBuffer``,
``CachedRequestState``, ``SchedulerOutput``, ...). The fakes here record every call the
runner makes into the model, the code predictor, the forward context and the graph wrapper.

Expectations come from ``tests/spec_matrix.yaml`` (hand-written from docs/models.md) plus, for a
config variant, the capability changes its overrides are meant to make; a test in
``test_variants.py`` checks that each variant's plan really has those capabilities.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import yaml
from vllm.config import CUDAGraphMode
from vllm.forward_context import BatchDescriptor
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker.gpu_input_batch import CachedRequestState

from omnigen import api, paths, pipeline

CPU = torch.device("cpu")
HIDDEN = 8
MAX_REQS = 16
MATRIX: dict[str, Any] = yaml.safe_load(
    (Path(__file__).parents[1] / "tests" / "spec_matrix.yaml").read_text()
)
CELLS: list[tuple[str, str]] = [(m, s) for m, entry in MATRIX.items() for s in entry["_order"]]

# Stage facts a config states that the spec matrix does not carry (read from conf/model).
BATCH_HOOK_STAGES = {("qwen3_tts", "qwen3_tts")}


@functools.cache
def runner_class(model: str, stage: str, overrides: tuple[str, ...] = ()) -> type:
    """``omnigen.api.runner_class``, once per variant (composing the configs costs ~0.1 s)."""
    return api.runner_class(model, stage, overrides)


@functools.cache
def model_state_class(model: str, stage: str, overrides: tuple[str, ...] = ()) -> type:
    """``omnigen.api.model_state_class``, once per variant."""
    return api.model_state_class(model, stage, overrides)


TARGETS = ("v1", "v2")
"""The two generated targets of a stage: the V1 runner and the Model Runner V2 target. A clause
that applies to both is tested on both (``rig(..., target=)``), through each target's own seam."""


@functools.cache
def stage_plan(model: str, stage: str, overrides: tuple[str, ...] = ()) -> Any:
    return api.stage_plan(model, stage, overrides)


@functools.cache
def _model_sources(model: str, overrides: tuple[str, ...]) -> dict[str, str]:
    """Every stage module of ``model`` under ``overrides``, as ``omnigen build`` writes them (one render)."""
    return pipeline.model_files(api.model_plan(model, overrides), overrides)


def stage_source(model: str, stage: str, overrides: tuple[str, ...] = ()) -> str:
    """A stage module's source: the committed file for a shipped stage (``omnigen check`` keeps it
    equal to a fresh render), else a render of the variant."""
    if not overrides:
        return (paths.generated_dir() / model / f"{stage}.py").read_text()
    return _model_sources(model, overrides)[f"{model}/{stage}.py"]


# -- stage variants ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """A stage of the spec matrix, optionally under Hydra overrides."""

    model: str
    stage: str
    overrides: tuple[str, ...] = ()
    changes: tuple[tuple[str, Any], ...] = ()
    """Capabilities (spec-matrix keys) the overrides change."""
    extra: tuple[tuple[str, Any], ...] = ()
    """Facts outside the matrix: ``batch_hook``, ``has_finish``, ``sampling`` (exact defaults)."""

    @property
    def caps(self) -> dict[str, Any]:
        caps = {**MATRIX[self.model][self.stage], **dict(self.changes)}
        # The worker sets model_config.async_chunk from the model's async_chunk (CONTRACT 7.5).
        caps["model_config"] = {**caps["model_config"], "async_chunk": caps["async_chunk"]}
        if self.changes:
            # The Model Runner V2 keys follow from the others (the matrix header's rules).
            caps.update(derived_v2_keys(caps))
        return caps

    @property
    def facts(self) -> dict[str, Any]:
        base = {"batch_hook": (self.model, self.stage) in BATCH_HOOK_STAGES, "has_finish": False}
        return {**base, **dict(self.extra)}

    @property
    def id(self) -> str:
        name = f"{self.model}.{self.stage}"
        if self.overrides:
            name += "[" + ",".join(o.split(".")[-1] if "stages." in o else o for o in self.overrides) + "]"
        return name

    def cls(self) -> type:
        return runner_class(self.model, self.stage, self.overrides)

    def state_cls(self) -> type:
        """The stage's generated Model Runner V2 model state (``<stage>_v2.py``)."""
        return model_state_class(self.model, self.stage, self.overrides)

    def runner_v2_cls(self) -> type:
        return api.runner_v2_class(self.model, self.stage, self.overrides)

    @property
    def mtp_accepts_generators_when(self) -> dict[bool, bool]:
        """``{wrapped: batched call takes generators=[...]}``."""
        policy = self.caps["mtp_per_row_generators"]
        return {False: policy in ("always", "eager_only"), True: policy == "always"}


def derived_v2_keys(caps: dict[str, Any]) -> dict[str, Any]:
    """The spec matrix's ``v2_*`` keys of a stage, by the rules its header states."""
    hooks = ["add_request", "preprocess_state", "prepare_inputs"]
    if caps["preprocess_hook"]:
        hooks.append("prepare_inputs_embeds")
    if caps["talker_mtp"] and caps["mtp_graph"] == "safe":
        hooks.append("capture_inner_cudagraphs")
    if caps["sampler"] == "model":
        hooks.append("custom_sampler")
    reads = (
        caps["preprocess_hook"],
        caps["postprocess"] is not None,
        caps["kind"] == "generation",
        caps["decode_step_metadata"],
        caps["make_omni_output"],
        caps["multimodal_outputs"],
    )
    return {
        "v2_state_hooks": hooks,
        "v2_full_graph": "narrowed"
        if caps["multimodal_outputs"] and not caps["make_omni_output"]
        else "kept",
        "v2_jit_warmup": not any(reads),
        "v2_rope_state": "text_only"
        if caps["mrope_fallback"]
        else ("filtered_kwargs" if caps["mrope"] else "default"),
    }


def shipped(pred=lambda caps: True) -> list[Variant]:
    return [Variant(m, s) for m, s in CELLS if pred(MATRIX[m][s])]


def ov(
    model: str,
    stage: str,
    *pairs: tuple[str, Any],
    changes: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    raw: Sequence[str] = (),
) -> Variant:
    """A variant: ``pairs`` are ``("mtp.graph", "unsafe")`` under ``model.stages.<stage>``."""
    overrides = tuple(f"model.stages.{stage}.{key}={value}" for key, value in pairs) + tuple(raw)
    return Variant(
        model, stage, overrides, tuple(sorted((changes or {}).items())), tuple(sorted((extra or {}).items()))
    )


def ids(variants: Sequence[Variant]) -> list[str]:
    return [v.id for v in variants]


HOOK_VARIANTS: list[Variant] = shipped(lambda c: c["preprocess_hook"]) + [
    ov("qwen3_tts", "qwen3_tts", ("preprocess.decode_batch", "none"), changes={"decode_batch": "none"}),
    ov("moss_tts_local", "talker", ("preprocess.decode_batch", "none"), changes={"decode_batch": "none"}),
    ov("qwen3_omni", "talker", ("preprocess.decode_batch", "mtp"), changes={"decode_batch": "mtp"}),
    ov("minicpmo_4_5", "tts", ("preprocess.decode_batch", "plain"), changes={"decode_batch": "plain"}),
    ov("qwen2_5_omni", "talker", ("preprocess.decode_batch", "plain"), changes={"decode_batch": "plain"}),
    ov(
        "mimo_audio",
        "fused_thinker_talker",
        ("preprocess.decode_batch", "plain"),
        changes={"decode_batch": "plain"},
    ),
    ov("minicpmo_4_5", "tts", ("preprocess.batch_hook", "true"), extra={"batch_hook": True}),
]

PLAIN_BATCH_VARIANTS = [v for v in HOOK_VARIANTS if v.caps["decode_batch"] == "plain"]
BATCH_VARIANTS = [v for v in HOOK_VARIANTS if v.caps["decode_batch"] != "none"]

MTP_VARIANTS: list[Variant] = shipped(lambda c: c["talker_mtp"]) + [
    ov(
        "qwen3_tts",
        "qwen3_tts",
        ("mtp.graph", "auto"),
        changes={"mtp_graph": "unsafe", "mtp_per_row_generators": "always"},
    ),
    ov(
        "qwen3_tts",
        "qwen3_tts",
        ("mtp.graph", "unsafe"),
        ("mtp.per_row_generators", "always"),
        changes={"mtp_graph": "unsafe", "mtp_per_row_generators": "always"},
    ),
    ov(
        "qwen3_tts",
        "qwen3_tts",
        ("mtp.per_row_generators", "never"),
        changes={"mtp_per_row_generators": "never"},
    ),
    ov("qwen3_omni", "talker", ("mtp.graph", "unsafe"), changes={"mtp_graph": "unsafe"}),
    ov("qwen3_omni", "talker", ("mtp.owns_talker_module", "false"), changes={"mtp_graph": "unsafe"}),
    ov(
        "qwen3_omni",
        "talker",
        ("mtp.owns_talker_module", "false"),
        raw=("graph=full",),
        changes={"mtp_graph": "safe"},
    ),
    ov("fish_speech", "slow_ar", raw=("graph=eager",), changes={"mtp_graph": "unsafe"}),
    ov(
        "qwen3_tts",
        "qwen3_tts",
        ("buffers.gpu_resident", "[codes.audio]"),
        changes={"gpu_resident_keys": ["codes.audio"]},
    ),
    ov("qwen3_omni", "talker", ("buffers.gpu_resident", "[]"), changes={"gpu_resident_keys": []}),
    ov(
        "qwen3_tts",
        "qwen3_tts",
        ("mtp.hidden_size_from", "hf_text_config.hidden_size"),
        changes={"mtp_hidden_size_from": "hf_text_config.hidden_size"},
    ),
    ov(
        "qwen3_tts",
        "qwen3_tts",
        ("mtp.output_key", "[tok,next]"),
        changes={"mtp_output_key": ["tok", "next"]},
    ),
    ov(
        "qwen3_omni",
        "talker",
        ("mtp.sampling.top_k", "7"),
        ("mtp.sampling.do_sample", "false"),
        changes={"mtp_sampling_defaults": True},
        extra={"sampling": {"do_sample": False, "temperature": None, "top_k": 7, "top_p": None}},
    ),
    ov(
        "qwen3_tts",
        "qwen3_tts",
        ("mtp.sampling.temperature", "0.25"),
        ("mtp.sampling.top_p", "0.5"),
        ("mtp.sampling.top_k", "3"),
        ("mtp.sampling.do_sample", "false"),
        extra={"sampling": {"do_sample": False, "temperature": 0.25, "top_k": 3, "top_p": 0.5}},
    ),
]


def mtp_codes_gpu_resident(v: Variant) -> bool:
    return ".".join(v.caps["mtp_output_key"]) in v.caps["gpu_resident_keys"]


# -- rows and steps ---------------------------------------------------------------------------

# (prompt_len, computed, span) of each row kind.
ROW_KINDS: dict[str, tuple[int, int, int]] = {
    "decode": (5, 5, 1),  # first decode step right after the prompt
    "decode_late": (3, 9, 1),
    "tail": (5, 4, 1),  # a 5-token prompt scheduled 4 then 1: still prefill at computed=4
    "single_prompt": (1, 0, 1),
    "cached_prefill": (6, 4, 2),  # prefix-cache hit, the rest of the prompt
    "decode_span2": (3, 6, 2),  # a 2-token decode span
    "prefill": (4, 0, 4),
}
ELIGIBLE_KINDS = {"decode", "decode_late"}

ORDERS: dict[str, list[str]] = {
    "interleaved": [
        "decode",
        "tail",
        "decode_late",
        "single_prompt",
        "decode",
        "cached_prefill",
        "decode_late",
        "decode_span2",
        "decode",
    ],
    "adjacent": [
        "decode",
        "decode_late",
        "decode",
        "tail",
        "single_prompt",
        "cached_prefill",
        "decode_span2",
        "prefill",
    ],
    "reversed": [
        "prefill",
        "decode_span2",
        "cached_prefill",
        "single_prompt",
        "tail",
        "decode",
        "decode_late",
        "decode",
    ],
    "split": ["decode", "decode_late", "tail", "decode", "decode_span2", "decode_late", "decode"],
    "decode_only": ["decode", "decode_late", "decode", "decode_late"],
    "no_decode": ["tail", "single_prompt", "cached_prefill", "decode_span2", "prefill"],
}


@dataclass
class RowSpec:
    req_id: str
    prompt_len: int
    computed: int
    span: int
    tag: int
    seed: int | None = None
    plain_seed: int | None = None

    @property
    def eligible(self) -> bool:
        return self.span == 1 and self.computed >= self.prompt_len

    @property
    def is_prefill(self) -> bool:
        return self.computed < self.prompt_len


def rows_of(kinds: Sequence[str], *, first_tag: int = 1) -> list[RowSpec]:
    return [
        RowSpec(f"r{i + first_tag}-{kind}", *ROW_KINDS[kind], tag=i + first_tag)
        for i, kind in enumerate(kinds)
    ]


def token_id(tag: int, j: int) -> int:
    return 100 * tag + j


def request_state(row: RowSpec) -> CachedRequestState:
    extra = {"tts_local_seed": row.seed} if row.seed is not None else None
    params = SamplingParams(seed=row.plain_seed, extra_args=extra)
    state = CachedRequestState(
        req_id=row.req_id,
        prompt_token_ids=[token_id(row.tag, j) for j in range(row.prompt_len)],
        mm_features=[SimpleNamespace(feature_of=row.req_id)],
        sampling_params=params,
        generator=None,
        block_ids=([],),
        num_computed_tokens=row.computed,
        output_token_ids=[7] * max(0, row.computed - row.prompt_len),
    )
    return state


def scheduler_output(
    num_scheduled_tokens: dict[str, int] | None = None,
    *,
    new: Sequence[Any] = (),
    cached: CachedRequestData | None = None,
    finished: Sequence[str] = (),
) -> SchedulerOutput:
    tokens = dict(num_scheduled_tokens or {})
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached if cached is not None else CachedRequestData.make_empty(),
        num_scheduled_tokens=tokens,
        total_num_scheduled_tokens=sum(tokens.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        num_common_prefix_blocks=[],
        finished_req_ids=set(finished),
        free_encoder_mm_hashes=[],
    )


def new_request(req_id: str, *, buffer: Any = None, info: Any = None, **absent: bool) -> NewRequestData:
    data = NewRequestData(
        req_id=req_id,
        prompt_token_ids=[1, 2, 3],
        mm_features=[],
        sampling_params=None,
        pooling_params=None,
        block_ids=([],),
        num_computed_tokens=0,
        lora_request=None,
    )
    if buffer is not None:
        data.model_intermediate_buffer = buffer
    if info is not None:
        data.additional_information = info
    return data


def cached_requests(req_ids: Sequence[str], infos: dict[str, Any] | None) -> CachedRequestData:
    data = CachedRequestData(
        req_ids=list(req_ids),
        resumed_req_ids=set(),
        new_token_ids=[[] for _ in req_ids],
        all_token_ids={},
        new_block_ids=[None for _ in req_ids],
        num_computed_tokens=[0 for _ in req_ids],
        num_output_tokens=[0 for _ in req_ids],
    )
    if infos is not None:
        data.additional_information = infos
    return data


@dataclass
class Step:
    """One scheduler step over ``rows``: the input batch, persistent buffers and scheduler output."""

    rows: list[RowSpec]
    offsets: list[int] | None = None
    """Override of each row's offset (``query_start_loc``); default: cumulative spans."""
    pad: int = 3
    hidden: int = HIDDEN
    input_batch: Any = field(init=False)
    query_start_loc: CpuGpuBuffer = field(init=False)
    input_ids: CpuGpuBuffer = field(init=False)
    inputs_embeds: CpuGpuBuffer = field(init=False)
    sched: SchedulerOutput = field(init=False)
    total: int = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.rows)
        spans = [r.span for r in self.rows]
        self.total = int(sum(spans))
        starts = list(np.cumsum([0] + spans)[:-1]) if self.offsets is None else list(self.offsets)
        self.offsets = [int(s) for s in starts]
        self.input_batch = SimpleNamespace(
            req_ids=[r.req_id for r in self.rows],
            num_computed_tokens_cpu=np.array(
                [r.computed for r in self.rows] + [0] * (MAX_REQS - n), dtype=np.int32
            ),
            num_prompt_tokens=np.array(
                [r.prompt_len for r in self.rows] + [0] * (MAX_REQS - n), dtype=np.int32
            ),
            req_id_to_index={r.req_id: i for i, r in enumerate(self.rows)},
        )
        qsl = CpuGpuBuffer(MAX_REQS + 1, dtype=torch.int32, device=CPU)
        qsl.np[:n] = self.offsets
        qsl.np[n] = self.total
        qsl.copy_to_gpu()
        self.query_start_loc = qsl
        size = self.total + self.pad
        self.input_ids = CpuGpuBuffer(size, dtype=torch.int32, device=CPU)
        self.inputs_embeds = CpuGpuBuffer(
            size, self.hidden, dtype=torch.float32, device=CPU, with_numpy=False
        )
        self.input_ids.gpu.fill_(-7)
        self.inputs_embeds.gpu.fill_(-99.0)
        if self.offsets == [int(s) for s in np.cumsum([0] + spans)[:-1]]:
            for row, start in zip(self.rows, self.offsets, strict=True):
                for j in range(row.span):
                    self.input_ids.gpu[start + j] = token_id(row.tag, j)
                    self.inputs_embeds.gpu[start + j] = -float(row.tag)
        else:
            # Hand-made offsets (3.5): give every slot a distinct value.
            self.input_ids.gpu[: self.total] = torch.arange(self.total, dtype=torch.int32) + 5000
            self.inputs_embeds.gpu[: self.total] = torch.arange(self.total, dtype=torch.float32)[:, None]
        self.input_ids.cpu.copy_(self.input_ids.gpu)
        self.inputs_embeds.cpu.copy_(self.inputs_embeds.gpu)
        self.sched = scheduler_output({r.req_id: r.span for r in self.rows})

    def ids(self) -> torch.Tensor:
        return self.input_ids.gpu[: self.total]

    def embeds(self) -> torch.Tensor:
        return self.inputs_embeds.gpu[: self.total]

    def row(self, req_id: str) -> RowSpec:
        return next(r for r in self.rows if r.req_id == req_id)


# -- fakes ------------------------------------------------------------------------------------


class Recorder:
    """What happened, in order: ``(kind, detail)`` entries shared by every fake of a test."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def add(self, kind: str, detail: Any = None) -> None:
        self.events.append((kind, detail))

    def of(self, kind: str) -> list[Any]:
        return [d for k, d in self.events if k == kind]

    def kinds(self) -> list[str]:
        return [k for k, _ in self.events]


class FakeForwardContext:
    """Stands in for ``vllm_api.set_forward_context``; records each entry and what ran inside."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.active: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def __call__(self, attn_metadata: Any, vllm_config: Any, **kwargs: Any) -> Iterator[None]:
        entry = {"attn_metadata": attn_metadata, "vllm_config": vllm_config, **kwargs}
        self.recorder.add("forward_context", entry)
        self.active.append(entry)
        try:
            yield
        finally:
            self.active.pop()


class FakeGraphWrapper:
    """The platform's full-graph wrapper, as the generated code builds it."""

    CAPTURED = (1, 2, 4, 8, 16, 32)
    """The sizes it holds a captured graph for (``concrete_cudagraph_entries``, what V2's
    predictor dispatch reads), as ``FakeDeterminer`` pads to on V1."""

    def __init__(self, runnable: Any, vllm_config: Any, runtime_mode: Any = None, **kwargs: Any) -> None:
        self.runnable = runnable
        self.vllm_config = vllm_config
        self.runtime_mode = runtime_mode
        self.concrete_cudagraph_entries = {
            BatchDescriptor(num_tokens=size, num_reqs=size, uniform=True): SimpleNamespace(cudagraph=object())
            for size in self.CAPTURED
        }

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.runnable(*args, **kwargs)


class FakeDeterminer:
    """``_determine_batch_execution_and_padding``: FULL mode, padded to the next capture size."""

    def __init__(self, recorder: Recorder, sizes: Sequence[int] = (1, 2, 4, 8, 16, 32)) -> None:
        self.recorder = recorder
        self.sizes = sizes
        self.returned: list[BatchDescriptor] = []

    def __call__(self, **kwargs: Any) -> tuple[Any, ...]:
        self.recorder.add("determine", kwargs)
        padded = min(s for s in self.sizes if s >= kwargs["num_tokens"])
        descriptor = BatchDescriptor(num_tokens=padded, num_reqs=padded, uniform=True)
        self.returned.append(descriptor)
        return CUDAGraphMode.FULL, descriptor, False, None, None


DEVICE_GET = torch.Tensor.device.__get__
IS_CPU_GET = torch.Tensor.is_cpu.__get__


class DeviceTensor(torch.Tensor):
    """A CPU tensor that says it lives on ``cuda:0``; moving it to CPU gives a plain tensor.

    Lets a CPU-only test tell "moved to host" (a plain ``torch.Tensor``) from "kept on the
    device" (still a ``DeviceTensor``).
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func == DEVICE_GET:
            return torch.device("cuda", 0)
        if func == IS_CPU_GET:
            return False
        if func in (torch.Tensor.to, torch.Tensor.cpu):
            target = args[1] if len(args) > 1 else (kwargs or {}).get("device", "cpu")
            if func is torch.Tensor.cpu or str(target).startswith("cpu"):
                with torch._C.DisableTorchFunctionSubclass():
                    return args[0].clone()
        return super().__torch_function__(func, types, args, kwargs or {})


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t.clone().as_subclass(DeviceTensor)


class FakePredictor:
    """The talker's code predictor: ``(ids, embeds, last_hidden, text_step, **sampling) -> (embeds, codes)``.

    Returned embedding row = ``last_hidden + 0.5``; codes row = ``(last_hidden[0]) * 10 + j``.
    Each generator handed in gives one draw, so tests can follow random streams.
    """

    num_codes = 3

    def __init__(
        self, recorder: Recorder, ctx: FakeForwardContext | None = None, *, codes_on_device: bool = False
    ) -> None:
        self.recorder = recorder
        self.ctx = ctx
        self.codes_on_device = codes_on_device
        self.last_codes: torch.Tensor | None = None

    def __call__(self, input_ids, inputs_embeds, last_talker_hidden, text_step, **kwargs):
        draws: list[float | None] = []
        gens = kwargs.get("generators")
        if gens is None:
            gens = [kwargs.get("generator")]
        for g in gens:
            draws.append(None if g is None else float(torch.rand(1, generator=g)))
        self.recorder.add(
            "talker_mtp",
            {
                "input_ids": input_ids.clone(),
                "inputs_embeds": inputs_embeds.clone(),
                "last_talker_hidden": last_talker_hidden.clone(),
                "text_step": text_step.clone(),
                "kwargs": dict(kwargs),
                "draws": draws,
                "context": dict(self.ctx.active[-1]) if self.ctx and self.ctx.active else None,
            },
        )
        embeds = last_talker_hidden + 0.5
        codes = last_talker_hidden[:, :1].round().long() * 10 + torch.arange(self.num_codes)
        if self.codes_on_device:
            codes = on_device(codes)
        self.last_codes = codes
        return embeds, codes


class StrictPredictor(FakePredictor):
    """A predictor that takes no generator arguments at all."""

    def __call__(
        self,
        input_ids,
        inputs_embeds,
        last_talker_hidden,
        text_step,
        *,  # type: ignore[override]
        do_sample,
        temperature,
        top_k,
        top_p,
    ):
        return super().__call__(
            input_ids,
            inputs_embeds,
            last_talker_hidden,
            text_step,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )


def expected_codes(tag: int) -> list[int]:
    return [(10 * tag + 4) * 10 + j for j in range(FakePredictor.num_codes)]


class FakeModel:
    """A stage model with every hook a runner may call; each call is recorded.

    Values identify who wrote what: the per-row hook writes embeddings ``10*tag+1``, the batch
    hook ``10*tag+2``; MTP inputs are ``last_hidden=10*tag+4``, ``text_step=10*tag+5``, so the
    predictor's embedding ``10*tag+4.5`` and codes identify the row they came from.
    """

    def __init__(
        self,
        recorder: Recorder,
        tags: dict[str, int],
        *,
        hidden: int = HIDDEN,
        mtp: bool = False,
        short: str | None = None,
        forward: Any = None,
    ) -> None:
        self.recorder = recorder
        self.tags = tags
        self.hidden = hidden
        self.mtp = mtp
        self.short = short
        self.forward = forward

    def _full(self, rows: int, value: float) -> torch.Tensor:
        return torch.full((rows, self.hidden), float(value))

    def preprocess(self, input_ids, input_embeds, **infos):
        req_id = infos["request_id"]
        tag = self.tags[req_id]
        n = int(input_ids.shape[0])
        self.recorder.add(
            "preprocess",
            {
                "req_id": req_id,
                "input_ids": input_ids.clone(),
                "input_embeds": input_embeds.clone(),
                "infos": dict(infos),
                "ids_storage": input_ids.untyped_storage().data_ptr(),
            },
        )
        update: dict[str, Any] = {"meta": {"hook": "preprocess", "ids": input_ids.tolist()}}
        if self.mtp and n == 1:
            # Offered on every 1-token row: routing a row to the MTP is the runner's decision (3.2).
            update["mtp_inputs"] = (self._full(1, 10 * tag + 4), self._full(1, 10 * tag + 5))
        return input_ids + 1000, self._full(n, 10 * tag + 1), update

    def preprocess_decode_batch(self, input_ids, req_infos):
        req_ids = [infos["request_id"] for infos in req_infos]
        tags = [self.tags[r] for r in req_ids]
        self.recorder.add(
            "preprocess_decode_batch",
            {
                "req_ids": req_ids,
                "input_ids": input_ids.clone(),
                "infos": [dict(i) for i in req_infos],
                "ids_storage": input_ids.untyped_storage().data_ptr(),
            },
        )
        n = len(req_ids)
        ids = input_ids.reshape(-1) + 2000
        embeds = torch.stack([torch.full((self.hidden,), 10.0 * t + 2) for t in tags])
        updates = [{"meta": {"hook": "batch", "ids": [int(i)]}} for i in input_ids.reshape(-1).tolist()]
        if self.short == "ids":
            ids = ids[: n - 1]
        elif self.short == "embeds":
            embeds = embeds[: n - 1]
        elif self.short == "updates":
            updates = updates[: n - 1]
        if not self.mtp:
            return ids, embeds, updates
        hidden = torch.stack([torch.full((self.hidden,), 10.0 * t + 4) for t in tags])
        text = torch.stack([torch.full((self.hidden,), 10.0 * t + 5) for t in tags])
        return ids, embeds, hidden, text, updates

    def embed_input_ids(self, input_ids):
        """The embeddings ``Step`` writes for these ids (``-tag`` for ``token_id(tag, j)``, ``k``
        for the hand-made offsets' ``5000 + k``): what V2 embeds before the rows' hooks run
        (the V1 runner hands the hooks the persistent buffer as the step left it)."""
        ids = input_ids.reshape(-1).to(torch.float32)
        values = torch.where(ids >= 5000, ids - 5000, -torch.div(ids, 100, rounding_mode="floor"))
        return values[:, None].expand(-1, self.hidden).clone()

    def preprocess_batch(self, req_ids, model_intermediate_buffer, device):
        self.recorder.add("preprocess_batch", {"req_ids": list(req_ids), "buffer": model_intermediate_buffer})

    def update_decode_step_metadata(self, *, input_ids, positions, inputs_embeds, req_ids, **query_start_loc):
        self.recorder.add(
            "update_decode_step_metadata",
            {
                "input_ids": input_ids,
                "positions": positions,
                "inputs_embeds": inputs_embeds,
                "req_ids": req_ids,
                **query_start_loc,
            },
        )

    # CONTRACT 7 hooks: recorded; make_omni_output hands the forward result back as it is, so
    # the 1.1 tests see the forward's own output whether or not the stage assembles one.
    def make_omni_output(self, output, **kwargs):
        self.recorder.add("make_omni_output", {"output": output, **kwargs})
        return output

    def set_batch_req_ids(self, req_ids):
        self.recorder.add("set_batch_req_ids", list(req_ids))

    def finish_decode_step_forward(self):
        self.recorder.add("finish_decode_step_forward")

    def __call__(self, **kwargs):
        self.recorder.add("forward", kwargs)
        if self.forward is None:
            return kwargs.get("inputs_embeds")
        return self.forward(**kwargs)


# -- runners ----------------------------------------------------------------------------------


def bare_runner(cls: type, **attrs: Any) -> Any:
    """``object.__new__(cls)`` with the omni state ``OmniRunnerBase.__init__`` creates, plus ``attrs``."""
    runner = object.__new__(cls)
    runner.model_intermediate_buffer = {}
    runner._pending_full_payload_send = {}
    runner._local_stage_payload_cache = {}
    runner._full_payload_pending_broadcast_req_ids = set()
    runner._talker_mtp_generators = {}
    runner._talker_mtp_views = {}
    runner.omni_prefix_cache = None
    runner.requests = {}
    for name, value in attrs.items():
        setattr(runner, name, value)
    return runner


def query_start_loc_buffer(bounds: Sequence[int]) -> CpuGpuBuffer:
    """vLLM's ``query_start_loc`` holding ``bounds`` (row ``i`` is ``bounds[i]:bounds[i+1]``)."""
    buffer = CpuGpuBuffer(max(len(bounds), MAX_REQS + 1), dtype=torch.int32, device=CPU)
    buffer.np[: len(bounds)] = bounds
    buffer.copy_to_gpu(len(bounds))
    return buffer


def mtp_buffers(
    rows: int = MAX_REQS, hidden: int = HIDDEN, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    return {
        "talker_mtp_input_ids": CpuGpuBuffer(rows, dtype=torch.int32, device=CPU),
        "talker_mtp_inputs_embeds": CpuGpuBuffer(rows, hidden, dtype=dtype, device=CPU, with_numpy=False),
        "last_talker_hidden": CpuGpuBuffer(rows, hidden, dtype=dtype, device=CPU, with_numpy=False),
        "text_step": CpuGpuBuffer(rows, hidden, dtype=dtype, device=CPU, with_numpy=False),
    }


MTP_BUFFER_NAMES = ("talker_mtp_input_ids", "talker_mtp_inputs_embeds", "last_talker_hidden", "text_step")


@dataclass
class Rig:
    """A target over one step, with its fakes. ``runner`` holds the omni state and runs the hooks:
    the V1 runner, or the V2 target's model state."""

    runner: Any
    step: Step
    model: FakeModel
    recorder: Recorder
    predictor: FakePredictor | None
    target: str = "v1"
    v2: V2Step | None = None

    def run_rows(self) -> None:
        """The step's rows through the hooks, through the target's own seam: V1's
        ``_preprocess_rows``; V2's ``preprocess_state`` then ``prepare_inputs_embeds`` on a V2
        ``InputBatch`` over the same persistent ids and embeddings."""
        if self.target == "v1":
            self.runner._preprocess_rows(self.step.sched, self.step.ids(), self.step.embeds())
            return
        assert self.v2 is not None
        self.runner.preprocess_state(self.v2.input_batch, (), None, None)
        self.runner.prepare_inputs_embeds({}, self.v2.input_batch, self.v2.req_states)

    def use_step(self, step: Step) -> None:
        """The same target (its omni state as it is) over the next step."""
        self.step = step
        if self.target == "v1":
            for name in ("input_batch", "query_start_loc", "input_ids", "inputs_embeds"):
                setattr(self.runner, name, getattr(step, name))
            return
        self.v2 = v2_step_of(step)
        self.runner.inputs_embeds = step.inputs_embeds.gpu
        self.runner.input_ids = step.input_ids
        self.runner.preprocess_state(self.v2.input_batch, (), None, None)

    def mtp_forward(
        self, req_ids: list[str], inputs_embeds: torch.Tensor, offsets: list[int] | None = None
    ) -> None:
        """The code predictor on the staged MTP rows (2.3); on V2 within a real step's rows."""
        self.runner._talker_mtp_forward(req_ids, inputs_embeds, offsets)


def rig(
    variant: Variant,
    step: Step,
    recorder: Recorder,
    ctx: FakeForwardContext,
    *,
    short: str | None = None,
    buffers: dict[str, dict[str, Any]] | None = None,
    predictor: FakePredictor | None = None,
    model_config: Any = None,
    requests: dict[str, Any] | None = None,
    target: str = "v1",
) -> Rig:
    caps = variant.caps
    tags = {r.req_id: r.tag for r in step.rows}
    model = FakeModel(recorder, tags, hidden=step.hidden, mtp=caps["talker_mtp"], short=short)
    known = requests if requests is not None else {r.req_id: request_state(r) for r in step.rows}
    v2_step = None
    if target == "v1":
        runner = bare_runner(
            variant.cls(),
            model=model,
            input_batch=step.input_batch,
            query_start_loc=step.query_start_loc,
            input_ids=step.input_ids,
            inputs_embeds=step.inputs_embeds,
            requests=known,
        )
    else:
        v2_step = v2_step_of(step)
        runner = bare_state(
            variant.state_cls(), model=model, inputs_embeds=step.inputs_embeds.gpu, requests=known
        )
        # What runner_state snapshots (the V1 names of the same persistent buffers).
        runner.input_ids = step.input_ids
        # V2 has handed the state the step's InputBatch (what the state reads its rows from).
        runner.preprocess_state(v2_step.input_batch, (), None, None)
    for req_id, buf in (buffers or {}).items():
        runner.model_intermediate_buffer[req_id] = buf
        if req_id in runner.requests:
            runner.requests[req_id].additional_information_cpu = buf
    if caps["talker_mtp"]:
        predictor = predictor or FakePredictor(recorder, ctx, codes_on_device=True)
        for name, buf in mtp_buffers(hidden=step.hidden).items():
            setattr(runner, name, buf)
        runner.talker_mtp = predictor
        runner.model.talker_mtp = predictor
        runner.vllm_config = SimpleNamespace(model_config=model_config or SimpleNamespace())
        if target == "v1":
            runner._determine_batch_execution_and_padding = FakeDeterminer(recorder)
    return Rig(runner, step, model, recorder, predictor, target, v2_step)


# -- the Model Runner V2 target ----------------------------------------------------------------


def bare_state(cls: type, **attrs: Any) -> Any:
    """``object.__new__(cls)`` of a generated V2 model state, with what ``OmniStateBase``,
    ``OmniModelStateV2`` and vLLM's ``DefaultModelState`` set in ``__init__`` (a text model: no
    encoder, rope or prompt-embeds state), plus ``attrs``."""
    state = bare_runner(cls)
    state.__dict__.update(
        _omni_step=None,
        omni_step_payloads={},
        _omni_last_model_output=None,
        _omni_batch=None,
        _omni_forward_kwargs=None,
        _omni_forward_pending=False,
        _omni_decode_step_open=False,
        _omni_inputs_embeds=None,
        _omni_req_states=None,
        _omni_preempted=set(),
        input_batch=None,
        query_start_loc=None,
        supports_mm_inputs=False,
        prompt_embeds_state=None,
        rope_state=None,
        mm_pruner=None,
        encoder_cache=None,
        device=CPU,
        dtype=torch.float32,
        max_num_reqs=MAX_REQS,
        max_num_tokens=64,
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32]),
    )
    for name, value in attrs.items():
        setattr(state, name, value)
    state.requests = {req_id: v2_record(request) for req_id, request in state.requests.items()}
    return state


def v2_record(request: Any) -> Any:
    """The V2 target's registry record of a request (what its ``add_request`` keeps)."""
    from omnigen.runtime.v2 import RequestRecord

    if isinstance(request, RequestRecord) or request is None:
        return request
    record = RequestRecord(request)
    if hasattr(request, "additional_information_cpu"):
        record.additional_information_cpu = request.additional_information_cpu
    return record


@dataclass
class V2Step:
    """A ``Step`` as vLLM's Model Runner V2 holds it: its real ``InputBatch`` (rows in the
    step's order, over the step's persistent ids) and ``RequestState`` (the prompt lengths)."""

    input_batch: Any
    req_states: Any


@contextlib.contextmanager
def host_uva_buffers() -> Iterator[None]:
    """Within: V2's ``RequestState`` keeps its host-visible buffers in plain host memory, as
    vLLM's own CPU runner makes it (``vllm/v1/worker/cpu/shm.py``; no pinned memory here)."""
    import vllm.v1.worker.cpu.buffer_utils as cpu_buffers
    import vllm.v1.worker.gpu.buffer_utils as gpu_buffers

    original = gpu_buffers.UvaBuffer
    gpu_buffers.UvaBuffer = cpu_buffers.UvaBuffer
    try:
        yield
    finally:
        gpu_buffers.UvaBuffer = original


def request_states(rows: Sequence[RowSpec], max_model_len: int = 64) -> Any:
    """vLLM's V2 ``RequestState`` with ``rows`` admitted (their prompts and computed tokens)."""
    from vllm.v1.worker.gpu.states import RequestState

    with host_uva_buffers():
        states = RequestState(MAX_REQS, max_model_len, 64, 0, 512, CPU)
    for row in rows:
        tokens = [token_id(row.tag, j) for j in range(max(row.prompt_len, row.computed + row.span))]
        states.add_request(row.req_id, row.prompt_len, tokens, row.computed, 8)
    return states


def v2_step_of(step: Step) -> V2Step:
    """The V2 view of ``step``: ``InputBatch.make_dummy`` over V2's ``InputBuffers``, with the
    step's rows, offsets, spans and computed tokens, and its ids as the persistent ids."""
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    rows = step.rows
    n = len(rows)
    req_states = request_states(rows)
    buffers = InputBuffers(MAX_REQS, step.total + step.pad, CPU)
    dummy = InputBatch.make_dummy(max(n, 1), max(step.total, 1), buffers)
    idx = np.array([req_states.req_id_to_index[r.req_id] for r in rows], dtype=np.int64)
    bounds = np.array([*step.offsets, step.total], dtype=np.int32)
    import dataclasses as _dataclasses

    input_batch = _dataclasses.replace(
        dummy,
        req_ids=[r.req_id for r in rows],
        num_reqs=n,
        num_reqs_after_padding=n,
        idx_mapping=torch.from_numpy(idx),
        idx_mapping_np=idx,
        num_scheduled_tokens=np.array([r.span for r in rows], dtype=np.int32),
        num_tokens=step.total,
        num_tokens_after_padding=step.total + step.pad,
        query_start_loc=torch.from_numpy(bounds.copy()),
        query_start_loc_np=bounds,
        num_computed_tokens_np=np.array([r.computed for r in rows], dtype=np.int32),
        input_ids=step.input_ids.gpu[: step.total + step.pad],
    )
    return V2Step(input_batch, req_states)


# -- snapshots --------------------------------------------------------------------------------


def freeze(value: Any) -> Any:
    """A comparable deep copy: tensors become ``(type, dtype, device, shape, values)``."""
    if isinstance(value, torch.Tensor):
        plain = value.detach().as_subclass(torch.Tensor)
        return (
            "tensor",
            type(value).__name__,
            str(plain.dtype),
            str(value.device),
            tuple(plain.shape),
            plain.float().tolist() if plain.dtype == torch.bfloat16 else plain.tolist(),
        )
    if isinstance(value, dict):
        return ("dict", tuple(sorted(((repr(k), freeze(v)) for k, v in value.items()), key=lambda kv: kv[0])))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(freeze(v) for v in value))
    if isinstance(value, np.ndarray):
        return ("ndarray", str(value.dtype), value.tolist())
    if isinstance(value, CpuGpuBuffer):
        return ("CpuGpuBuffer", freeze(value.cpu), freeze(value.gpu))
    return ("value", type(value).__name__, value)


def runner_state(runner: Any) -> Any:
    """Everything a preprocess step may write, frozen."""
    state: dict[str, Any] = {
        "model_intermediate_buffer": freeze(runner.model_intermediate_buffer),
        "buffer_ids": {k: id(v) for k, v in runner.model_intermediate_buffer.items()},
        "mirrors": {
            k: id(getattr(r, "additional_information_cpu", None)) for k, r in runner.requests.items()
        },
        "input_ids": freeze(runner.input_ids),
        "inputs_embeds": freeze(runner.inputs_embeds),
        "query_start_loc": freeze(
            runner.query_start_loc
            if isinstance(runner.query_start_loc, CpuGpuBuffer)
            else getattr(runner.query_start_loc, "np", runner.query_start_loc)
        ),
        "generators": sorted(runner._talker_mtp_generators),
    }
    for name in MTP_BUFFER_NAMES:
        if name in vars(runner):
            state[name] = freeze(getattr(runner, name))
    return state
