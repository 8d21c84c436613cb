"""Differential-test harness for omni model runners.

One seeded ``Scenario`` (a few hundred scheduler steps over a persistent set of
requests) is replayed through any runner class that keeps the omni runner
contract's method names: the installed oracle
``vllm_omni.worker.gpu_model_runner.OmniGPUModelRunner`` or one of omnigen's
generated classes. Each step yields an ``Observation``; ``compare`` /
``compare_runs`` check two runs step by step.

The runner is built the way vLLM's runner unit tests build one:
``object.__new__(cls)`` plus only the attributes the driven methods read
(``build_runner`` lists them all in ``RUNNER_ATTRIBUTES``). The harness itself
does what vLLM's ``_update_states`` / ``_prepare_inputs`` would do before
``_preprocess`` (see ``_apply_step``), so neither runner's version of those heavy
methods runs.

Plugging in another runner class::

    from .harness import ORACLE_VS_CONTRACT, Scenario, ScenarioConfig, compare_runs, oracle_runner_class, run_scenario
    from .policy_map import policy_from_plan

    cls = omnigen.api.runner_class("qwen3_tts", "qwen3_tts")
    policy = policy_from_plan(omnigen.api.stage_plan("qwen3_tts", "qwen3_tts"), cudagraph="full")
    scenario = Scenario.generate(ScenarioConfig(seed=3))
    oracle = run_scenario(oracle_runner_class(), policy, scenario)
    ours = run_scenario(cls, policy, scenario,
                        extra_patch_modules=(sys.modules[cls.__module__], omnigen.runtime.vllm_api))
    compare_runs(oracle, ours, ORACLE_VS_CONTRACT)

``run_scenario(cls, policy, scenario, *, model=None, model_seed=0, omni_output_cls=None,
extra_patch_modules=(), steps=None, info=None) -> list[Observation]`` works for any class
keeping the contract's method names. ``policy`` says what the oracle must be told at run
time (dummy-model flags plus runner config); a generated class has the same policy baked
in and simply ignores the model flags. ``extra_patch_modules`` are the modules of the
runner under test that bound ``get_pp_group`` / ``set_forward_context`` /
``CUDAGraphWrapper`` at import time.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import BatchDescriptor
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker.gpu_input_batch import CachedRequestState

from omnigen.runtime.phases import SPLIT_ROWS

from .dummy_model import HIDDEN, DummyTalkerModel, ModelFlags, make_model

ORACLE_MODULE = "vllm_omni.worker.gpu_model_runner"
MAX_NUM_REQS = 16
MAX_NUM_TOKENS = 256
CAPTURE_SIZES = (1, 2, 4, 8, 16)


def oracle_runner_class() -> type:
    """The comparison oracle (imported lazily: the harness also runs without it)."""
    import importlib

    return importlib.import_module(ORACLE_MODULE).OmniGPUModelRunner


# =============================================================================
# Policy: what a runner must be told at run time
# =============================================================================


@dataclass(frozen=True)
class Policy:
    """One stage's behaviour switches, as the oracle needs them at run time.

    ``flags`` become attributes on the dummy model (``ModelFlags`` documents
    which); the rest is runner configuration:

    cudagraph                  -> compilation_config.cudagraph_mode: "none" -> NONE,
                                  "full" -> FULL_AND_PIECEWISE (``has_full_cudagraphs()``);
                                  with "full" the batch-padding stub pads the MTP batch to
                                  the next capture size and reports mode FULL.
    subtalker_sampling_params  -> vllm_config.model_config.subtalker_sampling_params
    async_chunk                -> vllm_config.model_config.async_chunk (the oracle skips the
                                  local stage-payload sync in _preprocess when true)
    forward                    -> run_step also drives _model_forward + extract_multimodal_outputs
    """

    flags: ModelFlags = ModelFlags()
    cudagraph: str = "none"
    subtalker_sampling_params: dict | None = None
    async_chunk: bool = False
    forward: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        if self.cudagraph not in ("none", "full"):
            raise ValueError(f"cudagraph must be none|full, got {self.cudagraph!r}")

    def with_flags(self, **changes: Any) -> Policy:
        return dataclasses.replace(self, flags=dataclasses.replace(self.flags, **changes))

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        f = self.flags
        return (
            f"mtp={f.mtp},rowgen={f.per_row_generators},batch={f.decode_batching},"
            f"replace={f.replace_snapshots},graph={self.cudagraph}"
        )


# =============================================================================
# Scenario
# =============================================================================


@dataclass(frozen=True)
class ScenarioConfig:
    seed: int = 0
    num_steps: int = 300
    max_active: int = 6
    max_prompt: int = 12
    max_output: int = 10
    vocab: int = 4000
    p_arrive: float = 0.45
    p_schedule: float = 0.85
    p_abort: float = 0.02
    p_preempt: float = 0.02
    p_pad: float = 0.3
    payloads: bool = True
    # "mixed": payload markers are absent / True / tensor(True) / False / tensor(False);
    # "always": every payload carries a true marker; "never": no marker at all.
    replace_marker: str = "mixed"
    local_payloads: bool = True
    forward_kinds: tuple[str, ...] = ("omni", "flat_tuple", "tensor", "aux_tuple")


@dataclass(frozen=True)
class RequestSpec:
    req_id: str
    prompt: tuple[int, ...]
    outputs: tuple[int, ...]  # tokens the request generates (only max_tokens - 1 get processed)
    max_tokens: int
    seed_kind: str  # "tts_local_seed" | "seed" | "both" | "none"
    tts_seed: int | None
    plain_seed: int | None
    mm_features: tuple[str, ...] = ()  # stand-ins, used only with Policy.flags.multimodal_inputs

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def end(self) -> int:
        """Tokens processed over the request's life (the last sampled one never is)."""
        return self.prompt_len + self.max_tokens - 1

    def token(self, pos: int) -> int:
        return self.prompt[pos] if pos < self.prompt_len else self.outputs[pos - self.prompt_len]

    def sampling_params(self) -> SamplingParams:
        extra = {"tts_local_seed": self.tts_seed} if self.tts_seed is not None else None
        return SamplingParams(seed=self.plain_seed, max_tokens=self.max_tokens, extra_args=extra)


@dataclass(frozen=True)
class Row:
    req_id: str
    computed: int  # num_computed_tokens before the step
    span: int
    prompt_len: int
    num_output: int  # tokens generated so far (CachedRequestState.output_token_ids)
    kind: str  # prefill | prefill_tail1 | cached_prefill | resumed_prefill | decode1 | decode2
    new: bool

    @property
    def is_prefill(self) -> bool:
        return self.computed < self.prompt_len

    @property
    def mtp_eligible(self) -> bool:
        return self.span == 1 and not self.is_prefill

    def short(self) -> str:
        return f"{self.req_id}:{self.kind}@{self.computed}+{self.span}/{self.prompt_len}"


@dataclass
class Step:
    index: int
    rows: list[Row]
    new_req_ids: list[str]
    resumed_req_ids: set[str]
    finished_req_ids: set[str]
    num_input_tokens: int
    order_mode: str
    # rid -> {"model_intermediate_buffer" | "additional_information": payload}
    new_payloads: dict[str, dict[str, dict]]
    cached_payloads: dict[str, dict | None] | None  # None: the attribute is not attached at all
    local_payloads: dict[str, dict]
    pending_broadcast: set[str]
    forward_kind: str

    @property
    def total_tokens(self) -> int:
        return sum(r.span for r in self.rows)

    def describe(self) -> str:
        parts = [
            f"step {self.index} order={self.order_mode} T={self.total_tokens} padded={self.num_input_tokens}"
        ]
        parts.append("rows=[" + ", ".join(r.short() for r in self.rows) + "]")
        if self.new_req_ids:
            parts.append(f"new={self.new_req_ids}")
        if self.finished_req_ids:
            parts.append(f"finished={sorted(self.finished_req_ids)}")
        if self.resumed_req_ids:
            parts.append(f"resumed={sorted(self.resumed_req_ids)}")
        if self.new_payloads:
            parts.append("new_payloads=" + str({k: sorted(v) for k, v in self.new_payloads.items()}))
        if self.cached_payloads is not None:
            parts.append(f"cached_payloads={sorted(self.cached_payloads)}")
        if self.local_payloads:
            parts.append(
                f"local_payloads={sorted(self.local_payloads)} pending={sorted(self.pending_broadcast)}"
            )
        return " ".join(parts)


class Scenario:
    """A seeded sequence of scheduler steps (see ``generate``)."""

    def __init__(self, config: ScenarioConfig, requests: dict[str, RequestSpec], steps: list[Step]) -> None:
        self.config = config
        self.requests = requests
        self.steps = steps

    # ------------------------------------------------------------ generation
    @classmethod
    def generate(cls, config: ScenarioConfig | None = None) -> Scenario:
        config = config or ScenarioConfig()
        rng = random.Random(config.seed)
        requests: dict[str, RequestSpec] = {}
        # live per-request progress
        computed: dict[str, int] = {}
        target: dict[str, int] = {}  # prefill must catch up to here (> prompt_len after a preemption)
        generated: dict[str, int] = {}
        order: list[str] = []  # persistent batch order
        done: set[str] = set()
        counter = 0
        steps: list[Step] = []

        def new_request() -> str:
            nonlocal counter
            counter += 1
            rid = f"r{counter}"
            prompt_len = 1 if rng.random() < 0.15 else rng.randint(2, config.max_prompt)
            max_tokens = rng.randint(1, config.max_output)
            kind = rng.choices(["tts_local_seed", "seed", "both", "none"], [0.35, 0.2, 0.15, 0.3])[0]
            tts_seed = rng.randrange(1, 10_000) if kind in ("tts_local_seed", "both") else None
            plain_seed = rng.randrange(1, 10_000) if kind in ("seed", "both") else None
            requests[rid] = RequestSpec(
                req_id=rid,
                prompt=tuple(rng.randrange(config.vocab) for _ in range(prompt_len)),
                outputs=tuple(rng.randrange(config.vocab) for _ in range(max_tokens)),
                max_tokens=max_tokens,
                seed_kind=kind,
                tts_seed=tts_seed,
                plain_seed=plain_seed,
                mm_features=tuple(f"mm:{rid}:{i}" for i in range(rng.choice([0, 0, 1, 2]))),
            )
            return rid

        for index in range(config.num_steps):
            active = [rid for rid in order]
            # 1. finish: completed last step, or aborted now
            finished = set(done)
            for rid in active:
                if rid not in finished and rng.random() < config.p_abort:
                    finished.add(rid)
            done = set()
            order = [rid for rid in order if rid not in finished]
            for rid in finished:
                computed.pop(rid, None)

            # 2. preempt a decoding request (it recomputes prompt + outputs)
            resumed: set[str] = set()
            for rid in order:
                if computed[rid] > requests[rid].prompt_len and rng.random() < config.p_preempt:
                    target[rid] = computed[rid]
                    computed[rid] = 0
                    resumed.add(rid)

            # 3. arrivals (a cached prefix sometimes)
            new_ids: list[str] = []
            while len(order) + len(new_ids) < config.max_active and rng.random() < config.p_arrive:
                rid = new_request()
                spec = requests[rid]
                cached = 0
                if spec.prompt_len > 1 and rng.random() < 0.2:
                    cached = rng.randint(1, spec.prompt_len - 1)
                computed[rid] = cached
                target[rid] = spec.prompt_len
                generated[rid] = 0
                new_ids.append(rid)
                if rng.random() < 0.5:
                    break
            if not order and not new_ids:
                rid = new_request()
                computed[rid] = 0
                target[rid] = requests[rid].prompt_len
                generated[rid] = 0
                new_ids.append(rid)

            # 4. who runs this step
            scheduled = [rid for rid in order if rid in resumed or rng.random() < config.p_schedule]
            if not scheduled and not new_ids:
                scheduled = [order[0]]
            batch = [rid for rid in order if rid in scheduled] + new_ids

            # 5. batch order
            order_mode = rng.choices(
                ["keep", "reverse", "shuffle", "decode_first", "prefill_first", "interleave"],
                [0.45, 0.15, 0.15, 0.1, 0.05, 0.1],
            )[0]
            is_dec = {rid: computed[rid] >= requests[rid].prompt_len for rid in batch}
            if order_mode == "reverse":
                batch.reverse()
            elif order_mode == "shuffle":
                rng.shuffle(batch)
            elif order_mode == "decode_first":
                batch.sort(key=lambda r: not is_dec[r])
            elif order_mode == "prefill_first":
                batch.sort(key=lambda r: is_dec[r])
            elif order_mode == "interleave":
                dec = [r for r in batch if is_dec[r]]
                pre = [r for r in batch if not is_dec[r]]
                batch = []
                while dec or pre:
                    if dec:
                        batch.append(dec.pop(0))
                    if pre:
                        batch.append(pre.pop(0))

            # 6. spans
            rows: list[Row] = []
            for rid in batch:
                spec = requests[rid]
                c = computed[rid]
                pl = spec.prompt_len
                if c < pl:
                    remaining = max(target[rid], pl) - c
                    r = rng.random()
                    if remaining == 1:
                        span = 1
                    elif r < 0.45:
                        span = remaining
                    elif r < 0.65:
                        span = remaining - 1  # leaves a 1-token tail for a later step
                    else:
                        span = rng.randint(1, remaining)
                    if rid in resumed or target[rid] > pl:
                        kind = "resumed_prefill"
                    elif rid in new_ids and c > 0:
                        kind = "cached_prefill"
                    elif span == 1 and c > 0 and c + 1 == pl:
                        kind = "prefill_tail1"
                    else:
                        kind = "prefill"
                else:
                    left = spec.end - c
                    span = 2 if left >= 2 and rng.random() < 0.2 else 1
                    kind = f"decode{span}"
                rows.append(Row(rid, c, span, pl, generated[rid], kind, rid in new_ids))

            total = sum(r.span for r in rows)
            padded = total
            if rng.random() < config.p_pad:
                padded = min(MAX_NUM_TOKENS, -(-total // 8) * 8 + rng.choice([0, 8]))

            # 7. payloads
            new_payloads: dict[str, dict[str, dict]] = {}
            cached_payloads: dict[str, dict | None] | None = None
            local_payloads: dict[str, dict] = {}
            pending: set[str] = set()
            if config.payloads:
                for rid in new_ids:
                    entry = {}
                    if rng.random() < 0.4:
                        entry["model_intermediate_buffer"] = _make_payload(rng, index, config.replace_marker)
                    if rng.random() < 0.3:
                        entry["additional_information"] = _make_payload(rng, index, config.replace_marker)
                    if entry:
                        new_payloads[rid] = entry
                live = [r for r in order if r not in new_ids]
                if live and rng.random() < 0.35:
                    cached_payloads = {}
                    for rid in rng.sample(live, min(len(live), rng.randint(1, 2))):
                        cached_payloads[rid] = (
                            None if rng.random() < 0.15 else _make_payload(rng, index, config.replace_marker)
                        )
                    if finished and rng.random() < 0.3:
                        cached_payloads[sorted(finished)[0]] = _make_payload(
                            rng, index, config.replace_marker
                        )
                elif rng.random() < 0.05:
                    cached_payloads = {}
            if config.local_payloads and rng.random() < 0.12:
                candidates = list(order) + new_ids + [f"r{counter + 1}"]
                rid = rng.choice(candidates)
                local_payloads[rid] = _make_payload(rng, index, "never")
                if rng.random() < 0.3:
                    pending.add(rid)

            steps.append(
                Step(
                    index=index,
                    rows=rows,
                    new_req_ids=new_ids,
                    resumed_req_ids=resumed,
                    finished_req_ids=finished,
                    num_input_tokens=padded,
                    order_mode=order_mode,
                    new_payloads=new_payloads,
                    cached_payloads=cached_payloads,
                    local_payloads=local_payloads,
                    pending_broadcast=pending,
                    forward_kind=rng.choice(config.forward_kinds),
                )
            )

            # 8. advance
            order = [rid for rid in order if rid not in new_ids] + new_ids
            for row in rows:
                spec = requests[row.req_id]
                c = row.computed + row.span
                computed[row.req_id] = c
                if c >= spec.prompt_len:
                    generated[row.req_id] = max(
                        generated[row.req_id], min(spec.max_tokens, c - spec.prompt_len + 1)
                    )
                if c >= spec.end:
                    done.add(row.req_id)
        return cls(config, requests, steps)

    # --------------------------------------------------------- vLLM objects
    def scheduler_output(
        self, step: Step, sampling_params: dict[str, SamplingParams], with_mm_features: bool = False
    ) -> SchedulerOutput:
        """Fresh real vLLM scheduler objects for ``step`` (payloads deep-copied each call)."""
        new_reqs = []
        cached_ids, cached_computed, cached_out = [], [], []
        for row in step.rows:
            spec = self.requests[row.req_id]
            if row.new:
                data = NewRequestData(
                    req_id=row.req_id,
                    prompt_token_ids=list(spec.prompt),
                    mm_features=list(spec.mm_features) if with_mm_features else [],
                    sampling_params=sampling_params[row.req_id],
                    pooling_params=None,
                    block_ids=([],),
                    num_computed_tokens=row.computed,
                    lora_request=None,
                )
                for attr, payload in step.new_payloads.get(row.req_id, {}).items():
                    setattr(data, attr, copy.deepcopy(payload))
                new_reqs.append(data)
            else:
                cached_ids.append(row.req_id)
                cached_computed.append(row.computed)
                cached_out.append(row.num_output)
        cached = CachedRequestData(
            req_ids=cached_ids,
            resumed_req_ids=set(step.resumed_req_ids),
            new_token_ids=[],
            all_token_ids={},
            new_block_ids=[None] * len(cached_ids),
            num_computed_tokens=cached_computed,
            num_output_tokens=cached_out,
        )
        if step.cached_payloads is not None:
            cached.additional_information = copy.deepcopy(step.cached_payloads)
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens={r.req_id: r.span for r in step.rows},
            total_num_scheduled_tokens=step.total_tokens,
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            num_common_prefix_blocks=[0],
            finished_req_ids=set(step.finished_req_ids),
            free_encoder_mm_hashes=[],
        )


def _make_payload(rng: random.Random, step: int, marker_mode: str) -> dict:
    payload: dict[str, Any] = {"meta": {"bias": rng.randrange(50), "tag": f"s{step}"}}
    if rng.random() < 0.7:
        payload["codes"] = {"audio": torch.tensor([[rng.randrange(64) for _ in range(4)]], dtype=torch.int64)}
    if rng.random() < 0.5:
        vals = [rng.randrange(256) / 64.0 for _ in range(HIDDEN)]
        payload["hidden_states"] = {"trailing_text": torch.tensor([vals], dtype=torch.float32)}
    if rng.random() < 0.2:
        payload["extra"] = {"ids": [rng.randrange(9) for _ in range(3)]}
    if rng.random() < 0.2:
        payload["note"] = rng.randrange(10)
    if rng.random() < 0.15:
        payload["meta"]["steps_seen"] = rng.randrange(5)  # collides with a key the model writes
    if marker_mode == "always":
        payload["meta"]["replace_runtime_additional_information"] = rng.choice([True, torch.tensor(True)])
    elif marker_mode == "mixed":
        choice = rng.randrange(5)
        if choice == 1:
            payload["meta"]["replace_runtime_additional_information"] = True
        elif choice == 2:
            payload["meta"]["replace_runtime_additional_information"] = torch.tensor(True)
        elif choice == 3:
            payload["meta"]["replace_runtime_additional_information"] = False
        elif choice == 4:
            payload["meta"]["replace_runtime_additional_information"] = torch.tensor(False)
    return payload


# =============================================================================
# Patches
# =============================================================================


class _FakePPGroup:
    is_first_rank = True
    is_last_rank = True
    ranks = [0]
    world_size = 1


def fake_get_pp_group() -> _FakePPGroup:
    return _FakePPGroup()


class FakeGraphWrapper:
    """Stands in for the platform's full-graph wrapper class: records, then calls through."""

    def __init__(self, runnable: Any, vllm_config: Any = None, runtime_mode: Any = None, **kw: Any) -> None:
        self.runnable = runnable
        self.runtime_mode = runtime_mode

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.runnable(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["runnable"], name)


@dataclass
class Recorder:
    """What the patched platform pieces saw (reset per step by run_step)."""

    forward_contexts: list[tuple[str, int | None]] = field(default_factory=list)
    batch_padding_calls: list[dict] = field(default_factory=list)
    wrapper_lookups: int = 0


_RECORDER = Recorder()
# The forward context the runner is inside right now (the dummy model reads it
# through model.forward_context_stack, which build_runner points here).
_FORWARD_STACK: list[tuple[str, int | None]] = []


@contextlib.contextmanager
def _fake_set_forward_context(
    attn_metadata: Any, vllm_config: Any, *args: Any, **kwargs: Any
) -> Iterator[None]:
    mode = kwargs.get("cudagraph_runtime_mode")
    desc = kwargs.get("batch_descriptor")
    entry = (getattr(mode, "name", str(mode)), getattr(desc, "num_tokens", None))
    _RECORDER.forward_contexts.append(entry)
    _FORWARD_STACK.append(entry)
    try:
        yield
    finally:
        _FORWARD_STACK.pop()


def _fake_get_graph_wrapper_cls() -> type:
    _RECORDER.wrapper_lookups += 1
    return FakeGraphWrapper


def _fake_get_static_graph_wrapper_cls() -> str:
    """vLLM's platform hook answers with a qualified name; ours resolves to FakeGraphWrapper."""
    _RECORDER.wrapper_lookups += 1
    return f"{FakeGraphWrapper.__module__}.{FakeGraphWrapper.__qualname__}"


# The complete list of what the harness patches, for the report and for review:
#   <module>.get_pp_group            -> fake_get_pp_group (first and last PP rank), in
#                                       vllm.v1.worker.gpu_model_runner, the oracle module (when
#                                       importable) and every module in extra_patch_modules
#                                       that has the name
#   vllm.forward_context.set_forward_context and any `set_forward_context` name in
#                                       extra_patch_modules -> _fake_set_forward_context
#   current_omni_platform.set_forward_context -> _fake_set_forward_context (instance attribute)
#   current_omni_platform.get_graph_wrapper_cls -> returns FakeGraphWrapper (instance attribute)
#   vllm.platforms.current_platform.get_static_graph_wrapper_cls -> the qualified name of
#                                       FakeGraphWrapper (instance attribute; on CPU vLLM answers
#                                       AbstractStaticGraphWrapper, a Protocol isinstance() rejects)
#   any `CUDAGraphWrapper` name in extra_patch_modules -> FakeGraphWrapper
@contextlib.contextmanager
def harness_patches(extra_patch_modules: Sequence[types.ModuleType] = ()) -> Iterator[None]:
    """Apply the harness patches (nestable: each level restores what it replaced)."""
    saved: list[tuple[Any, str, Any, bool]] = []

    def patch(obj: Any, name: str, value: Any) -> None:
        had = name in vars(obj) if not isinstance(obj, types.ModuleType) else hasattr(obj, name)
        saved.append((obj, name, getattr(obj, name, None), had))
        setattr(obj, name, value)

    import vllm.forward_context as fc
    import vllm.v1.worker.gpu_model_runner as vllm_runner

    modules = [vllm_runner]
    try:
        import importlib

        oracle_mod = importlib.import_module(ORACLE_MODULE)
        modules.append(oracle_mod)
        from vllm_omni.platforms import current_omni_platform
    except ImportError:  # pragma: no cover - harness without the oracle installed
        current_omni_platform = None
    modules.extend(extra_patch_modules)
    try:
        for mod in modules:
            if hasattr(mod, "get_pp_group"):
                patch(mod, "get_pp_group", fake_get_pp_group)
        patch(fc, "set_forward_context", _fake_set_forward_context)
        for mod in extra_patch_modules:
            if hasattr(mod, "set_forward_context"):
                patch(mod, "set_forward_context", _fake_set_forward_context)
            if hasattr(mod, "CUDAGraphWrapper"):
                patch(mod, "CUDAGraphWrapper", FakeGraphWrapper)
        from vllm.platforms import current_platform

        patch(current_platform, "get_static_graph_wrapper_cls", _fake_get_static_graph_wrapper_cls)
        if current_omni_platform is not None:
            patch(current_omni_platform, "set_forward_context", _fake_set_forward_context)
            patch(current_omni_platform, "get_graph_wrapper_cls", _fake_get_graph_wrapper_cls)
        yield
    finally:
        for obj, name, old, had in reversed(saved):
            if had:
                setattr(obj, name, old)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)


# =============================================================================
# Building a runner
# =============================================================================


class FakeInputBatch:
    """The slice of vLLM's InputBatch the omni methods read (persistent arrays, stale tails)."""

    def __init__(self, max_num_reqs: int) -> None:
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        # Stale garbage past num_reqs on purpose: a reader that forgets to slice shows.
        self.num_computed_tokens_cpu = np.full(max_num_reqs, 9999, dtype=np.int32)
        self.num_prompt_tokens = np.full(max_num_reqs, 9999, dtype=np.int32)
        self.req_prompt_embeds: dict = {}

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


# Every attribute build_runner sets (the union of what the oracle's and the
# contract runner's driven methods read). Kept as data so the report and a test
# can check it.
RUNNER_ATTRIBUTES = (
    # configs
    "vllm_config", "model_config", "compilation_config", "speculative_config",
    # model and device
    "model", "device", "dtype", "max_num_reqs", "max_num_tokens",
    # vLLM base _preprocess switches
    "supports_mm_inputs", "enable_prompt_embeds", "uses_mrope", "is_pooling_model",
    "lookback_token_ids", "encoder_cache",
    # persistent batch state and buffers
    "input_batch", "requests", "query_start_loc", "input_ids", "inputs_embeds", "positions",
    # omni state
    "model_intermediate_buffer", "_talker_mtp_generators", "_talker_mtp_views", "has_talker_mtp",
    "_omni_num_scheduled_tokens_np", "_omni_query_start_loc_model_kwarg", "_omni_last_model_output",
    "_local_stage_payload_cache", "_full_payload_pending_broadcast_req_ids", "omni_prefix_cache",
    # stub
    "_determine_batch_execution_and_padding",
)  # fmt: skip
# Only with Policy.flags.multimodal_inputs (vLLM's multimodal path):
MM_ATTRIBUTES = (
    "maybe_get_ec_connector_output",
    "_execute_mm_encoder",
    "_gather_mm_embeddings",
    "_extract_mm_kwargs",
)
# Set by _init_talker_mtp (called by build_runner when the model has a predictor):
MTP_ATTRIBUTES = (
    "talker_mtp",
    "talker_mtp_input_ids",
    "talker_mtp_inputs_embeds",
    "last_talker_hidden",
    "text_step",
)


def _padding_stub(policy: Policy):
    full = policy.cudagraph == "full"

    def _determine_batch_execution_and_padding(num_tokens: int, num_reqs: int, **kwargs: Any):
        _RECORDER.batch_padding_calls.append(
            {
                "num_tokens": int(num_tokens),
                "num_reqs": int(num_reqs),
                **{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()},
            }
        )
        if full:
            padded = next((s for s in CAPTURE_SIZES if s >= num_tokens), num_tokens)
            return (
                CUDAGraphMode.FULL,
                BatchDescriptor(num_tokens=padded, num_reqs=padded, uniform=True),
                False,
                None,
                None,
            )
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens=num_tokens), False, None, None

    return _determine_batch_execution_and_padding


def default_omni_output_cls(cls: type) -> type:
    """The OmniOutput a runner class recognizes: the oracle's, else omnigen's."""
    if any(c.__module__.startswith("vllm_omni") for c in cls.__mro__):
        from vllm_omni.model_executor.models.output_templates import OmniOutput

        return OmniOutput
    from omnigen.runtime.outputs import OmniOutput

    return OmniOutput


def build_runner(
    cls: type,
    model: DummyTalkerModel,
    policy: Policy,
    *,
    omni_output_cls: type | None = None,
    extra_patch_modules: Sequence[types.ModuleType] = (),
    info: dict[str, Any] | None = None,
) -> Any:
    """``object.__new__(cls)`` plus exactly ``RUNNER_ATTRIBUTES`` (and the MTP/MM extras).

    With a model that has a code predictor, ``runner._init_talker_mtp()`` (contract 2.1)
    runs under the harness patches; ``info`` (if given) receives how many times the
    graph-wrapper class was looked up then and whether the predictor got wrapped.
    """
    runner = object.__new__(cls)
    hf_text_config = SimpleNamespace(hidden_size=HIDDEN)
    # Every hidden-size path a stage may name for its MTP buffers resolves to HIDDEN.
    hf_config = SimpleNamespace(
        hidden_size=HIDDEN,
        text_config=SimpleNamespace(hidden_size=HIDDEN),
        talker_config=SimpleNamespace(hidden_size=HIDDEN),
    )
    model_config = SimpleNamespace(
        is_encoder_decoder=False,
        async_chunk=policy.async_chunk,
        subtalker_sampling_params=copy.deepcopy(policy.subtalker_sampling_params),
        hf_text_config=hf_text_config,
        hf_config=hf_config,
        has_sampling_extra_args=False,
        uses_mrope=False,
    )
    compilation_config = SimpleNamespace(
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE if policy.cudagraph == "full" else CUDAGraphMode.NONE,
        max_cudagraph_capture_size=max(CAPTURE_SIZES),
        cudagraph_capture_sizes=list(CAPTURE_SIZES),
    )
    vllm_config = SimpleNamespace(model_config=model_config, compilation_config=compilation_config)

    runner.vllm_config = vllm_config
    runner.model_config = model_config
    runner.compilation_config = compilation_config
    runner.speculative_config = None
    runner.model = model
    runner.device = torch.device("cpu")
    runner.dtype = torch.float32
    runner.max_num_reqs = MAX_NUM_REQS
    runner.max_num_tokens = MAX_NUM_TOKENS
    runner.supports_mm_inputs = bool(model.flags.multimodal_inputs)
    runner.enable_prompt_embeds = False
    runner.uses_mrope = False
    runner.is_pooling_model = False
    runner.lookback_token_ids = None
    runner.encoder_cache = {}
    runner.input_batch = FakeInputBatch(MAX_NUM_REQS)
    runner.requests = {}
    runner.query_start_loc = CpuGpuBuffer(
        MAX_NUM_REQS + 1, dtype=torch.int32, device=runner.device, pin_memory=False
    )
    runner.input_ids = CpuGpuBuffer(MAX_NUM_TOKENS, dtype=torch.int32, device=runner.device, pin_memory=False)
    runner.inputs_embeds = CpuGpuBuffer(
        MAX_NUM_TOKENS, HIDDEN, dtype=torch.float32, device=runner.device, pin_memory=False, with_numpy=False
    )
    runner.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64)
    runner.model_intermediate_buffer = {}
    runner._talker_mtp_generators = {}
    runner._talker_mtp_views = {}
    runner.has_talker_mtp = False
    runner._omni_num_scheduled_tokens_np = None
    # What the oracle's load_model reads from the model (supports_omni_query_start_loc).
    runner._omni_query_start_loc_model_kwarg = bool(model.flags.query_start_loc)
    runner._omni_last_model_output = None
    runner._local_stage_payload_cache = {}
    runner._full_payload_pending_broadcast_req_ids = set()
    runner.omni_prefix_cache = None
    runner._determine_batch_execution_and_padding = _padding_stub(policy)
    if model.flags.multimodal_inputs:
        runner.maybe_get_ec_connector_output = lambda scheduler_output, encoder_cache=None, **kw: (
            contextlib.nullcontext()
        )
        runner._execute_mm_encoder = lambda scheduler_output, *a, **kw: None
        runner._gather_mm_embeddings = lambda scheduler_output, *a, **kw: ([], None)
        runner._extract_mm_kwargs = lambda scheduler_output, *a, **kw: {}
    # Deterministic initial contents of the persistent buffers (stale data is realistic).
    runner.inputs_embeds.gpu.copy_(
        (torch.arange(MAX_NUM_TOKENS * HIDDEN, dtype=torch.float32).reshape(MAX_NUM_TOKENS, HIDDEN) % 13)
        / 16.0
    )
    model.omni_output_cls = omni_output_cls or default_omni_output_cls(cls)
    model.forward_context_stack = _FORWARD_STACK
    if getattr(model, "talker_mtp", None) is not None:
        with harness_patches(extra_patch_modules):
            _RECORDER.wrapper_lookups = 0
            runner._init_talker_mtp()
            if info is not None:
                info["init_wrapper_lookups"] = _RECORDER.wrapper_lookups
                info["mtp_wrapped"] = isinstance(runner.talker_mtp, FakeGraphWrapper)
                info["mtp_runtime_mode"] = getattr(
                    getattr(runner.talker_mtp, "runtime_mode", None), "name", None
                )
    return runner


# =============================================================================
# Running a step
# =============================================================================


@dataclass
class Observation:
    step: int
    description: str
    ids: torch.Tensor | None
    embeds: torch.Tensor | None
    positions: torch.Tensor | None
    model_kwargs: list[str]
    ids_persistent: bool | None  # returned ids are a view of input_ids.gpu
    embeds_persistent: bool | None  # returned embeds are a view of inputs_embeds.gpu
    buffers: dict[str, Any]
    mirror: dict[str, str]  # rid -> "same" | "absent" | "other" (additional_information_cpu)
    codes: dict[str, torch.Tensor]  # MTP output-key values written this step
    mtp_buffers: dict[str, torch.Tensor] | None
    generators: list[str]
    local_cache: list[str]
    calls: list[dict]
    batch_padding_calls: list[dict]
    forward_contexts: list[tuple[str, int | None]]
    forward: dict[str, Any] | None
    error: str | None


def snapshot(value: Any) -> Any:
    """A deep, detached copy: tensors cloned, containers rebuilt, scalars kept (types too)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    if isinstance(value, tuple):
        return tuple(snapshot(v) for v in value)
    if isinstance(value, (str, int, float, bool, type(None), np.generic)):
        return value  # immutable; the type is kept so compare can tell int from np.int32
    return f"<{type(value).__name__}>"


class RunState:
    """Per-run bookkeeping the harness keeps next to a runner."""

    def __init__(self, scenario: Scenario, policy: Policy) -> None:
        self.scenario = scenario
        self.policy = policy
        self.sampling_params: dict[str, SamplingParams] = {}


def _apply_step(runner: Any, state: RunState, step: Step) -> SchedulerOutput:
    """What vLLM's _update_states/_prepare_inputs do before _preprocess, done here."""
    scenario = state.scenario
    for rid in step.finished_req_ids:
        runner.requests.pop(rid, None)
        runner.model_intermediate_buffer.pop(rid, None)
        # Generators are deliberately left to the runner (contract 2.3 drops them in MTP).
    for rid in step.new_req_ids:
        spec = scenario.requests[rid]
        sp = spec.sampling_params()
        state.sampling_params[rid] = sp
        row = next(r for r in step.rows if r.req_id == rid)
        runner.requests[rid] = CachedRequestState(
            req_id=rid,
            prompt_token_ids=list(spec.prompt),
            mm_features=list(spec.mm_features) if state.policy.flags.multimodal_inputs else [],
            sampling_params=sp,
            generator=None,
            block_ids=([],),
            num_computed_tokens=row.computed,
            output_token_ids=[],
        )
    batch = runner.input_batch
    batch.req_ids = [r.req_id for r in step.rows]
    batch.req_id_to_index = {rid: i for i, rid in enumerate(batch.req_ids)}
    n = len(step.rows)
    tokens: list[int] = []
    positions: list[int] = []
    for i, row in enumerate(step.rows):
        spec = scenario.requests[row.req_id]
        req = runner.requests[row.req_id]
        req.num_computed_tokens = row.computed
        req.output_token_ids = list(spec.outputs[: row.num_output])
        batch.num_computed_tokens_cpu[i] = row.computed
        batch.num_prompt_tokens[i] = spec.prompt_len
        for pos in range(row.computed, row.computed + row.span):
            tokens.append(spec.token(pos))
            positions.append(pos)
    total = len(tokens)
    qsl = runner.query_start_loc
    qsl.np[0] = 0
    qsl.np[1 : n + 1] = np.cumsum([r.span for r in step.rows], dtype=np.int32)
    qsl.np[n + 1 :] = total
    qsl.copy_to_gpu()
    runner.input_ids.np[:total] = np.asarray(tokens, dtype=np.int32)
    runner.input_ids.copy_to_gpu(total)
    runner.positions[:total] = torch.tensor(positions, dtype=torch.int64)
    # local stage payloads (contract 4.5)
    cache = runner._local_stage_payload_cache
    for rid, payload in step.local_payloads.items():
        cache[rid] = copy.deepcopy(payload)
    runner._full_payload_pending_broadcast_req_ids = set(step.pending_broadcast)
    return scenario.scheduler_output(step, state.sampling_params, state.policy.flags.multimodal_inputs)


def _out_key(policy: Policy) -> tuple[str, str]:
    return tuple(policy.flags.mtp_output_key)  # type: ignore[return-value]


def _codes_before(runner: Any, key: tuple[str, str]) -> dict[str, Any]:
    out = {}
    for rid, buf in runner.model_intermediate_buffer.items():
        sub = buf.get(key[0]) if isinstance(buf, dict) else None
        if isinstance(sub, dict) and key[1] in sub:
            val = sub[key[1]]
            out[rid] = (val, snapshot(val))  # a strong reference: no id() reuse
    return out


def _changed(before: tuple[Any, Any] | None, value: Any) -> bool:
    if before is None:
        return True
    if value is not before[0]:
        return True
    old = before[1]
    if isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor):
        return not (old.shape == value.shape and torch.equal(old, value))
    return old != value


def run_step(
    runner: Any,
    state: RunState,
    step: Step,
    after_apply: Callable[[Any, Step], None] | None = None,
) -> Observation:
    """Apply one scheduler step, call ``_preprocess`` (and the forward), observe.

    ``after_apply(runner, step)``, when given, runs after the harness has laid the step out
    (batch, ``query_start_loc``, ids) and before ``_preprocess``: a test uses it to corrupt
    one step's layout on purpose.
    """
    model: DummyTalkerModel = runner.model
    policy = state.policy
    _RECORDER.forward_contexts.clear()
    _RECORDER.batch_padding_calls.clear()
    log_start = len(model.calls)
    sched = _apply_step(runner, state, step)
    if after_apply is not None:
        after_apply(runner, step)
    key = _out_key(policy)
    before = _codes_before(runner, key)
    error = None
    ids = embeds = positions = None
    model_kwargs: list[str] = []
    ids_persistent = embeds_persistent = None
    forward = None
    try:
        # Inside inference mode, as vLLM's execute_model runs a step (a hook's row slices, for one,
        # are views of inference tensors there).
        with torch.inference_mode():
            result = runner._preprocess(sched, step.num_input_tokens)
        ids, embeds, positions, _inter, kwargs, _ec = result
        model_kwargs = sorted(kwargs)
        ids_persistent = None if ids is None else ids.data_ptr() == runner.input_ids.gpu.data_ptr()
        embeds_persistent = (
            None if embeds is None else embeds.data_ptr() == runner.inputs_embeds.gpu.data_ptr()
        )
        if policy.forward:
            forward = _run_forward(runner, model, step, ids, positions, embeds, kwargs)
        ids, embeds, positions = snapshot(ids), snapshot(embeds), snapshot(positions)
    except Exception as exc:  # recorded, compared like any other field
        error = f"{type(exc).__name__}: {exc}"
    codes = {}
    for rid, buf in runner.model_intermediate_buffer.items():
        sub = buf.get(key[0]) if isinstance(buf, dict) else None
        if isinstance(sub, dict) and key[1] in sub and _changed(before.get(rid), sub[key[1]]):
            codes[rid] = snapshot(sub[key[1]])
    mirror = {}
    for rid, req in runner.requests.items():
        buf = runner.model_intermediate_buffer.get(rid)
        mirrored = getattr(req, "additional_information_cpu", None)
        mirror[rid] = (
            "absent" if buf is None and mirrored is None else ("same" if mirrored is buf else "other")
        )
    mtp_buffers = None
    if getattr(runner, "has_talker_mtp", False):
        mtp_buffers = {name: snapshot(getattr(runner, name).gpu) for name in MTP_ATTRIBUTES[1:]}
    return Observation(
        step=step.index,
        description=step.describe(),
        ids=ids,
        embeds=embeds,
        positions=positions,
        model_kwargs=model_kwargs,
        ids_persistent=ids_persistent,
        embeds_persistent=embeds_persistent,
        buffers=snapshot(runner.model_intermediate_buffer),
        mirror=mirror,
        codes=codes,
        mtp_buffers=mtp_buffers,
        generators=sorted(getattr(runner, "_talker_mtp_generators", {}) or {}),
        local_cache=sorted(getattr(runner, "_local_stage_payload_cache", {}) or {}),
        calls=copy.deepcopy(model.calls[log_start:]),
        batch_padding_calls=copy.deepcopy(_RECORDER.batch_padding_calls),
        forward_contexts=list(_RECORDER.forward_contexts),
        forward=forward,
        error=error,
    )


def _run_forward(runner, model, step, ids, positions, embeds, kwargs) -> dict[str, Any]:
    model.forward_output_kind = step.forward_kind
    out = runner._model_forward(
        input_ids=ids, positions=positions, intermediate_tensors=None, inputs_embeds=embeds, **kwargs
    )
    raw = model.last_forward_output
    raw_payload = raw[1] if isinstance(raw, tuple) and len(raw) > 1 else None
    text, payload = runner.extract_multimodal_outputs(out)
    return {
        "type": type(out).__name__,
        "fields": list(getattr(out, "_fields", ())),
        "same_object": out is raw,
        "payload_is_raw_payload": raw_payload is not None and payload is raw_payload,
        "text": snapshot(text),
        "payload": snapshot(payload),
    }


def run_scenario(
    cls: type,
    policy: Policy,
    scenario: Scenario,
    *,
    model: DummyTalkerModel | None = None,
    model_seed: int = 0,
    omni_output_cls: type | None = None,
    extra_patch_modules: Sequence[types.ModuleType] = (),
    steps: int | None = None,
    info: dict[str, Any] | None = None,
    after_apply: Callable[[Any, Step], None] | None = None,
) -> list[Observation]:
    """Build a runner of ``cls`` for ``policy`` and replay ``scenario`` through it.

    ``model`` defaults to ``make_model(policy.flags, seed=model_seed)``; pass a
    ``model.clone()`` (or a ``reset()`` one) to give two runners identical models.
    ``extra_patch_modules``: modules of the runner under test whose imported
    ``get_pp_group`` / ``set_forward_context`` / ``CUDAGraphWrapper`` names must be
    patched too. ``info`` receives build facts (see ``build_runner``). ``after_apply`` is
    handed to every ``run_step``.
    """
    model = model if model is not None else make_model(policy.flags, seed=model_seed)
    with harness_patches(extra_patch_modules):
        runner = build_runner(
            cls,
            model,
            policy,
            omni_output_cls=omni_output_cls,
            extra_patch_modules=extra_patch_modules,
            info=info,
        )
        state = RunState(scenario, policy)
        todo = scenario.steps if steps is None else scenario.steps[:steps]
        return [run_step(runner, state, step, after_apply) for step in todo]


# =============================================================================
# Comparing
# =============================================================================


@dataclass(frozen=True)
class KeyMapping:
    """What ``compare`` drops before comparing, and why (keep this explicit).

    buffer_drop:          top-level keys removed from every request's buffer on both sides.
    info_drop:            request-info key names removed from the hook call log's ``keys`` lists.
    forward_kwargs_drop:  kwarg names removed from the ``forward`` call log's ``kwargs`` list.
    fields_skip:          Observation fields not compared at all.
    adjust:               callables ``fn(left, right)`` run in order on the two normalized
                          observations (dicts of Observation fields, after the drops above;
                          containers copied, so a callable may edit dicts and lists of either
                          side in place, never a tensor). For differences that a key drop
                          cannot state precisely: one side only, or only under a condition.
                          Give each a name and a docstring.
    """

    buffer_drop: frozenset[str] = frozenset()
    info_drop: frozenset[str] = frozenset()
    forward_kwargs_drop: frozenset[str] = frozenset()
    fields_skip: frozenset[str] = frozenset()
    doc: str = ""
    adjust: tuple[Callable[[dict[str, Any], dict[str, Any]], None], ...] = ()


IDENTITY = KeyMapping(doc="compare everything (oracle vs oracle)")

# The oracle (vllm_omni/worker/gpu_model_runner.py, _preprocess) writes per-row keys
# into the request's infos -- which is the request's buffer dict whenever one exists --
# that the omni runner contract does not list (CONTRACT 3.1 lists only request_id,
# _omni_prompt_len, _omni_num_computed_tokens, _omni_is_prefill):
#   duplex_token_offset  (line 1860)  num_computed_tokens again, for duplex models
#   duplex_prompt_len    (line 1861)  len(prompt_token_ids), or None without a request state
#   _omni_max_tokens     (line 1875)  sampling_params.max_tokens
#   _omni_seed           (line 1878)  sampling_params.seed (a plain seed; never seeds the MTP)
# With Policy.forward, _model_forward -> _gather_runtime_additional_information
# (line 1363) also writes generated_len = len(output_token_ids) into every non-empty buffer.
ORACLE_EXTRA_KEYS = frozenset(
    {"duplex_token_offset", "duplex_prompt_len", "_omni_max_tokens", "_omni_seed", "generated_len"}
)
# With Policy.forward, the oracle's _build_model_kwargs_extra also hands the model
# request_token_spans (line 1426: per-row (start, end) token spans) -- a kwarg the
# contract's 1.1 does not name. Dropping it hides a real difference (a model whose
# make_omni_output maps rows by spans gets none from a contract runner); it is listed
# separately so a test can choose to keep it.
ORACLE_EXTRA_FORWARD_KWARGS = frozenset({"request_token_spans"})
ORACLE_VS_CONTRACT = KeyMapping(
    buffer_drop=ORACLE_EXTRA_KEYS,
    info_drop=ORACLE_EXTRA_KEYS,
    forward_kwargs_drop=ORACLE_EXTRA_FORWARD_KWARGS,
    doc="drop the oracle-only per-row keys (ORACLE_EXTRA_KEYS) from buffers and hook infos, "
    "and the oracle-only forward kwarg request_token_spans",
)


class ObservationMismatch(AssertionError):
    pass


def _normalize(obs: Observation, mapping: KeyMapping) -> dict[str, Any]:
    data = {f.name: getattr(obs, f.name) for f in dataclasses.fields(obs)}
    data.pop("description")
    for name in mapping.fields_skip:
        data.pop(name, None)
    if "buffers" in data:
        data["buffers"] = {
            rid: {k: v for k, v in buf.items() if k not in mapping.buffer_drop}
            if isinstance(buf, dict)
            else buf
            for rid, buf in data["buffers"].items()
        }
    if "calls" in data and (mapping.info_drop or mapping.forward_kwargs_drop):
        calls = []
        for call in data["calls"]:
            call = dict(call)
            if call["hook"] == "forward":
                call["kwargs"] = [k for k in call["kwargs"] if k not in mapping.forward_kwargs_drop]
            if call.get("keys") is not None:
                call["keys"] = [[k for k in ks if k not in mapping.info_drop] for ks in call["keys"]]
            if call.get("req_info_keys") is not None:
                call["req_info_keys"] = [
                    [k for k in ks if k not in mapping.info_drop] for ks in call["req_info_keys"]
                ]
            calls.append(call)
        data["calls"] = calls
    return data


def _fmt(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        flat = value.reshape(-1)
        body = flat[:8].tolist()
        more = "..." if flat.numel() > 8 else ""
        return f"tensor{tuple(value.shape)}:{value.dtype}{body}{more}"
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


def _diff(a: Any, b: Any, path: str, out: list[str], limit: int = 40) -> None:
    if len(out) >= limit:
        return
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            out.append(f"{path}: {_fmt(a)} != {_fmt(b)}")
        elif a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{path}: {_fmt(a)} != {_fmt(b)} (dtype/shape)")
        elif not torch.equal(a, b):
            idx = (a != b).nonzero()[0].tolist() if a.numel() else []
            out.append(f"{path}: first differing index {idx}: {_fmt(a)} != {_fmt(b)}")
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a:
                out.append(f"{path}[{k!r}]: missing on the left, right has {_fmt(b[k])}")
            elif k not in b:
                out.append(f"{path}[{k!r}]: left has {_fmt(a[k])}, missing on the right")
            else:
                _diff(a[k], b[k], f"{path}[{k!r}]", out, limit)
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            out.append(f"{path}: length {len(a)} != {len(b)}: {_fmt(a)} != {_fmt(b)}")
            return
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _diff(x, y, f"{path}[{i}]", out, limit)
        return
    if type(a) is not type(b) or a != b:
        suffix = f" ({type(a).__name__} vs {type(b).__name__})" if type(a) is not type(b) else ""
        out.append(f"{path}: {_fmt(a)} != {_fmt(b)}{suffix}")


def _copy_containers(value: Any) -> Any:
    """Dicts, lists and tuples rebuilt, leaves (tensors, scalars) shared: adjusters edit containers."""
    if isinstance(value, dict):
        return {k: _copy_containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_containers(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy_containers(v) for v in value)
    return value


def differences(obs_a: Observation, obs_b: Observation, mapping: KeyMapping = IDENTITY) -> list[str]:
    out: list[str] = []
    left, right = _normalize(obs_a, mapping), _normalize(obs_b, mapping)
    if mapping.adjust:
        left, right = _copy_containers(left), _copy_containers(right)
        for fn in mapping.adjust:
            fn(left, right)
    _diff(left, right, "obs", out)
    return out


def compare(obs_a: Observation, obs_b: Observation, mapping: KeyMapping = IDENTITY) -> None:
    """Assert two observations of the same step agree (after ``mapping``'s drops).

    ids / embeds / positions / buffers / codes / MTP buffers compare tensors with
    ``torch.equal`` (dtype and shape first); scalars compare by type *and* value, so
    an ``np.int32`` where an ``int`` is due shows. Hook-call sequences compare entry
    by entry. Raises ``ObservationMismatch`` listing every difference by path.
    """
    diffs = differences(obs_a, obs_b, mapping)
    if diffs:
        lines = [f"step {obs_a.step}: {len(diffs)} difference(s)", f"  scenario: {obs_a.description}"]
        lines += [f"  {d}" for d in diffs]
        raise ObservationMismatch("\n".join(lines))


def compare_runs(run_a: list[Observation], run_b: list[Observation], mapping: KeyMapping = IDENTITY) -> None:
    """``compare`` step by step; fails at the first differing step."""
    if len(run_a) != len(run_b):
        raise ObservationMismatch(f"runs have {len(run_a)} and {len(run_b)} steps")
    for a, b in zip(run_a, run_b, strict=True):
        compare(a, b, mapping)


__all__ = [
    "CAPTURE_SIZES",
    "IDENTITY",
    "MAX_NUM_REQS",
    "MAX_NUM_TOKENS",
    "MM_ATTRIBUTES",
    "MTP_ATTRIBUTES",
    "ORACLE_EXTRA_FORWARD_KWARGS",
    "ORACLE_EXTRA_KEYS",
    "ORACLE_VS_CONTRACT",
    "RUNNER_ATTRIBUTES",
    "FakeGraphWrapper",
    "FakeInputBatch",
    "KeyMapping",
    "Observation",
    "ObservationMismatch",
    "Policy",
    "Recorder",
    "Row",
    "RunState",
    "Scenario",
    "ScenarioConfig",
    "Step",
    "build_runner",
    "compare",
    "compare_runs",
    "coverage",
    "differences",
    "harness_patches",
    "oracle_runner_class",
    "run_scenario",
    "run_step",
    "snapshot",
]


# =============================================================================
# Coverage: what a run actually exercised
# =============================================================================


def coverage(scenario: Scenario, observations: Sequence[Observation]) -> dict[str, int]:
    """Counts of the situations a scenario and its observations cover (for asserting coverage)."""
    from collections import Counter

    c: Counter[str] = Counter()
    by_index = {s.index: s for s in scenario.steps}
    prev_generators: set[str] = set()
    for obs in observations:
        step = by_index[obs.step]
        c["steps"] += 1
        c[f"order:{step.order_mode}"] += 1
        c["finished"] += len(step.finished_req_ids)
        c["new"] += len(step.new_req_ids)
        c["resumed"] += len(step.resumed_req_ids)
        c["padded_steps"] += step.num_input_tokens > step.total_tokens
        for row in step.rows:
            c[f"row:{row.kind}"] += 1
            c["row:single_token_prompt"] += row.prompt_len == 1 and row.is_prefill
            spec = scenario.requests[row.req_id]
            if row.mtp_eligible:
                c[f"mtp_row:{spec.seed_kind}"] += 1
        flags = [r.mtp_eligible for r in step.rows]
        c["steps_with_adjacent_decode1"] += any(a and b for a, b in zip(flags, flags[1:], strict=False))
        first = flags.index(True) if True in flags else -1
        last = len(flags) - 1 - flags[::-1].index(True) if True in flags else -1
        c["steps_with_split_decode1"] += first >= 0 and not all(flags[first : last + 1])
        # Enough rows that a runner makes their slices by one split (omnigen's phases.SPLIT_ROWS).
        c["steps_with_split_rows"] += len(step.rows) >= SPLIT_ROWS
        for kind, payload in ((k, p) for entry in step.new_payloads.values() for k, p in entry.items()):
            c[f"payload:new:{kind}"] += 1
            c["payload:marker"] += "replace_runtime_additional_information" in payload.get("meta", {})
        if step.cached_payloads is not None:
            c["payload:cached_attr"] += 1
            c["payload:cached"] += sum(p is not None for p in step.cached_payloads.values())
        c["payload:local"] += len(step.local_payloads)
        c["payload:pending_broadcast"] += len(step.pending_broadcast)
        mtp_calls = [call for call in obs.calls if call["hook"] == "talker_mtp"]
        c["steps_with_multiple_mtp_calls"] += len(mtp_calls) > 1
        for call in obs.calls:
            c[f"hook:{call['hook']}"] += 1
            c[f"hook_rows:{call['hook']}"] += call.get("rows", 0)
        for call in mtp_calls:
            c["mtp:batched_calls"] += call["rows"] > 1
            c["mtp:seeded_rows_generator"] += bool(call["generator"])
            if call["generators"] is not None:
                c["mtp:seeded_rows_generators"] += sum(call["generators"])
                c["mtp:unseeded_rows_in_generators"] += sum(not g for g in call["generators"])
        c["errors"] += obs.error is not None
        now = set(obs.generators)
        c["generators_dropped"] += len(prev_generators - now)
        prev_generators = now
    return dict(c)
