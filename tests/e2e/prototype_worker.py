"""HAND-WRITTEN PROTOTYPE (temporary; generated runners/workers replace it).

Proves, on vLLM 0.30, how an omni stage runner runs inside vLLM's real engine:

* A runner subclasses ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` and
  overrides ``_preprocess`` (talker hooks + code predictor, CONTRACT.md 2-3) and
  ``_model_forward`` (unwrap ``OmniOutput`` for vLLM's logits/sampler).
* vLLM has no runner-class knob. A worker class, loaded by
  ``LLM(worker_cls="tests.e2e.prototype_worker.PrototypeTalkerWorker")``, builds
  the runner. On a CPU-only machine the runner must also be vLLM's CPU runner, so
  the worker composes ``type("CPU<Runner>", (Runner, CPUModelRunner), {})`` and
  its base is ``vllm.v1.worker.cpu_worker.CPUWorker``; on GPU the runner is used
  as is and the base is ``vllm.v1.worker.gpu_worker.Worker``.
* Both base workers construct their runner at the end of ``init_device``
  (vLLM 0.30: ``cpu_worker.py`` line 191 ``self.model_runner =
  CPUModelRunner(self.vllm_config, torch.device("cpu"))``, a name bound at module
  level by ``from vllm.v1.worker.cpu_model_runner import CPUModelRunner`` on line
  27; ``gpu_worker.py`` lines 475-479 ``from vllm.v1.worker.gpu_model_runner
  import GPUModelRunner as GPUModelRunnerV1`` inside ``init_device``). The worker
  overrides ``init_device`` and, for the duration of ``super().init_device()``
  only, rebinds that one name to the composed runner class, then checks that the
  runner it got is exactly that class. Nothing else of ``init_device`` (device
  binding, distributed init, seeds, memory snapshot) is duplicated.

Stage policy is fixed per runner class by class constants, the way generated code
fixes it; nothing is probed on the model with ``getattr``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.platforms import current_platform
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from omnigen.runtime.outputs import OmniOutput, restore_flattened_omni_output

NON_MTP_OFFSETS_MSG = "Non-MTP batched decode preprocessing requires contiguous in-bounds token offsets"


class _Row:
    __slots__ = ("index", "req_id", "offset", "span", "infos")

    def __init__(self, index: int, req_id: str, offset: int, span: int, infos: dict[str, Any]) -> None:
        self.index, self.req_id, self.offset, self.span, self.infos = index, req_id, offset, span, infos

    @property
    def is_prefill(self) -> bool:
        return bool(self.infos["_omni_is_prefill"])


class _OmniBufferMixin:
    """Per-request buffers and their release (CONTRACT.md 4.1, 6), prototype-sized."""

    model_intermediate_buffer: dict[str, dict[str, Any]]

    def _init_omni_state(self) -> None:
        self.model_intermediate_buffer = {}
        # What the test reads back through collective_rpc. Prototype-only.
        self.prototype_trace: dict[str, Any] = {
            "runner_class": type(self).__name__,
            "runner_mro": [c.__name__ for c in type(self).__mro__[:6]],
            "rows": [],  # (step, req_id, offset, span, computed, prompt_len, route)
            "mtp_codes": {},  # req_id -> [codes per MTP step]
            "audio_samples": {},  # req_id -> number of audio samples produced
            "released": [],
            "steps": 0,
        }

    def _update_intermediate_buffer(self, req_id: str, update: Any) -> None:
        if not isinstance(update, dict) or not update or req_id not in self.requests:  # type: ignore[attr-defined]
            return
        buf = self.model_intermediate_buffer.setdefault(req_id, {})
        for key, value in update.items():
            if isinstance(value, dict):
                slot = buf.setdefault(key, {})
                for qual, item in value.items():
                    slot[qual] = item.detach().to("cpu") if isinstance(item, torch.Tensor) else item
            else:
                buf[key] = value.detach().to("cpu") if isinstance(value, torch.Tensor) else value

    def _on_request_state_removed(self, req_id: str, req_state: Any) -> None:
        # vLLM calls this from _update_states for every finished request id. Note
        # that finished ids reach the runner with the *next* scheduler output.
        super()._on_request_state_removed(req_id, req_state)  # type: ignore[misc]
        self.model_intermediate_buffer.pop(req_id, None)
        gens = getattr(self, "_talker_mtp_generators", None)
        if gens is not None:
            gens.pop(req_id, None)
        self.prototype_trace["released"].append(req_id)

    def _model_forward(
        self,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **model_kwargs: Any,
    ) -> Any:
        out = super()._model_forward(  # type: ignore[misc]
            input_ids=input_ids,
            positions=positions,
            intermediate_tensors=intermediate_tensors,
            inputs_embeds=inputs_embeds,
            **model_kwargs,
        )
        out = restore_flattened_omni_output(out)
        self.prototype_trace["steps"] += 1
        if isinstance(out, OmniOutput):
            # vLLM's own execute_model indexes the output as the hidden-state
            # tensor; a generated runner overrides execute_model instead.
            self._on_multimodal_outputs(out.multimodal_outputs or {})
            return out.text_hidden_states
        return out

    def _on_multimodal_outputs(self, payload: dict[str, Any]) -> None:
        pass


class PrototypeTalkerRunner(_OmniBufferMixin, GPUModelRunner):
    """A talker runner: per-row ``preprocess``, batched decode, talker MTP."""

    # Stage policy, fixed at "generation" time.
    OMNI_HAS_MTP = True
    OMNI_DECODE_BATCH = "mtp"  # "none" | "mtp" (5-tuple hook) | "no_mtp" (3-tuple hook)
    OMNI_MTP_PER_ROW_GENERATORS = True
    OMNI_MTP_OUTPUT_KEY = ("codes", "audio")
    OMNI_SUBTALKER_DEFAULTS: dict[str, Any] = {"do_sample": True, "temperature": 1.0, "top_k": None, "top_p": None}

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self._init_omni_state()
        self.has_talker_mtp = False
        self._talker_mtp_generators: dict[str, torch.Generator] = {}

    # -- loading ------------------------------------------------------------------

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        if self.OMNI_HAS_MTP:
            self._init_talker_mtp()

    def _init_talker_mtp(self) -> None:
        self.talker_mtp = self.model.talker_mtp
        self.has_talker_mtp = True
        hidden = self.model_config.hf_text_config.hidden_size
        rows = max(self.max_num_reqs, self.compilation_config.max_cudagraph_capture_size or 0)
        self.talker_mtp_input_ids = self._make_buffer(rows, dtype=torch.int32)
        self.talker_mtp_inputs_embeds = self._make_buffer(rows, hidden, dtype=self.dtype, numpy=False)
        self.last_talker_hidden = self._make_buffer(rows, hidden, dtype=self.dtype, numpy=False)
        self.text_step = self._make_buffer(rows, hidden, dtype=self.dtype, numpy=False)

    # -- preprocess (CONTRACT.md 3) -------------------------------------------------

    def _preprocess(self, scheduler_output: Any, num_input_tokens: int, intermediate_tensors: Any = None):
        (input_ids, inputs_embeds, positions, intermediate_tensors, model_kwargs, ec_output) = super()._preprocess(
            scheduler_output, num_input_tokens, intermediate_tensors
        )
        num_tokens = scheduler_output.total_num_scheduled_tokens
        ids_buf = self.input_ids.gpu
        emb_buf = self.inputs_embeds.gpu
        if inputs_embeds is None:
            # Text-only models get ids from vLLM; the talker hooks work on embeddings.
            emb_buf[:num_tokens].copy_(self.model.embed_input_ids(ids_buf[:num_tokens]))

        rows = list(self._omni_rows(scheduler_output))
        mtp_rows: list[_Row] = []
        i = 0
        while i < len(rows):
            if self.OMNI_DECODE_BATCH != "none" and self._decode_batch_eligible(rows[i]):
                j = i
                while j < len(rows) and self._decode_batch_eligible(rows[j]):
                    j += 1
                self._run_decode_batch(rows[i:j], ids_buf, emb_buf, num_tokens, mtp_rows)
                i = j
            else:
                self._run_row_hook(rows[i], ids_buf, emb_buf, mtp_rows)
                i += 1
        if mtp_rows:
            self._talker_mtp_forward(
                [r.req_id for r in mtp_rows], emb_buf, start_offsets=[r.offset for r in mtp_rows]
            )
        return (
            ids_buf[:num_input_tokens],
            emb_buf[:num_input_tokens],
            positions,
            intermediate_tensors,
            model_kwargs,
            ec_output,
        )

    def _omni_rows(self, scheduler_output: Any) -> Iterator[_Row]:
        qsl = self.query_start_loc.cpu
        step = self.prototype_trace["steps"]
        for index, req_id in enumerate(self.input_batch.req_ids):
            span = int(scheduler_output.num_scheduled_tokens[req_id])
            req_state = self.requests[req_id]
            prompt_len = int(req_state.num_prompt_tokens)
            computed = int(req_state.num_computed_tokens)
            buf = self.model_intermediate_buffer.setdefault(req_id, {})
            buf["request_id"] = req_id
            buf["_omni_prompt_len"] = prompt_len
            buf["_omni_num_computed_tokens"] = computed
            buf["_omni_is_prefill"] = computed < prompt_len
            row = _Row(index, req_id, int(qsl[index]), span, dict(buf))
            route = "mtp" if self._mtp_eligible(row) else ("prefill" if row.is_prefill else "decode")
            self.prototype_trace["rows"].append((step, req_id, row.offset, span, computed, prompt_len, route))
            yield row

    def _mtp_eligible(self, row: _Row) -> bool:
        return self.OMNI_HAS_MTP and row.span == 1 and not row.is_prefill

    def _decode_batch_eligible(self, row: _Row) -> bool:
        if self.OMNI_DECODE_BATCH == "mtp":
            return self._mtp_eligible(row)
        return row.span == 1 and row.infos["_omni_num_computed_tokens"] >= row.infos["_omni_prompt_len"]

    def _run_row_hook(self, row: _Row, ids_buf: torch.Tensor, emb_buf: torch.Tensor, mtp_rows: list[_Row]) -> None:
        s, e = row.offset, row.offset + row.span
        ids, embeds, update = self.model.preprocess(input_ids=ids_buf[s:e], input_embeds=emb_buf[s:e], **row.infos)
        update = dict(update or {})
        mtp_inputs = update.pop("mtp_inputs", None)
        if ids is not None and ids.data_ptr() != ids_buf[s:e].data_ptr():
            ids_buf[s:e].copy_(ids)
        if embeds.data_ptr() != emb_buf[s:e].data_ptr():
            emb_buf[s:e].copy_(embeds)
        if self._mtp_eligible(row):
            if mtp_inputs is None:
                raise ValueError(f"preprocess gave no mtp_inputs for MTP row {row.req_id}")
            last_hidden, text_step = mtp_inputs
            self._stage_mtp_row(len(mtp_rows), ids_buf[e - 1], emb_buf[e - 1], last_hidden[-1], text_step[-1])
            mtp_rows.append(row)
        self._update_intermediate_buffer(row.req_id, update)

    def _run_decode_batch(
        self, rows: list[_Row], ids_buf: torch.Tensor, emb_buf: torch.Tensor, num_tokens: int, mtp_rows: list[_Row]
    ) -> None:
        offsets = [r.offset for r in rows]
        with_mtp = self.OMNI_DECODE_BATCH == "mtp"
        if not with_mtp:
            start = offsets[0]
            if start < 0 or offsets != list(range(start, start + len(rows))) or start + len(rows) > num_tokens:
                raise RuntimeError(f"{NON_MTP_OFFSETS_MSG}; got {offsets} for {num_tokens} tokens")
        idx = torch.tensor(offsets, dtype=torch.long, device=ids_buf.device)
        result = self.model.preprocess_decode_batch(input_ids=ids_buf[idx], req_infos=[r.infos for r in rows])
        if with_mtp:
            ids, embeds, last_hidden, text_step, updates = result
        else:
            ids, embeds, updates = result
        n = len(rows)
        if len(ids) < n or len(embeds) < n or len(updates) < n or (with_mtp and (len(last_hidden) < n or len(text_step) < n)):
            raise ValueError(f"decode preprocessing returned fewer results than its {n} rows")
        if with_mtp:
            for k, row in enumerate(rows):
                ids_buf[row.offset] = ids[k]
                emb_buf[row.offset].copy_(embeds[k])
                self._stage_mtp_row(len(mtp_rows), ids[k], embeds[k], last_hidden[k], text_step[k])
                mtp_rows.append(row)
        else:
            start = offsets[0]
            ids_buf[start : start + n].copy_(ids[:n])
            emb_buf[start : start + n].copy_(embeds[:n])
        for k, row in enumerate(rows):
            self._update_intermediate_buffer(row.req_id, updates[k])

    def _stage_mtp_row(self, slot: int, ids: Any, embeds: Any, last_hidden: Any, text_step: Any) -> None:
        self.talker_mtp_input_ids.gpu[slot] = ids
        self.talker_mtp_inputs_embeds.gpu[slot].copy_(embeds)
        self.last_talker_hidden.gpu[slot].copy_(last_hidden)
        self.text_step.gpu[slot].copy_(text_step)

    # -- talker MTP (CONTRACT.md 2.3) ----------------------------------------------

    def _talker_mtp_generator(self, req_id: str) -> torch.Generator | None:
        req_state = self.requests.get(req_id)
        params = getattr(req_state, "sampling_params", None)
        seed = ((params.extra_args or {}) if params is not None else {}).get("tts_local_seed")
        if seed is None:
            return None
        gen = self._talker_mtp_generators.get(req_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(seed))
            self._talker_mtp_generators[req_id] = gen
        return gen

    def _talker_mtp_forward(self, req_ids: list[str], inputs_embeds: torch.Tensor, start_offsets: list[int] | None = None) -> None:
        batch = len(req_ids)
        if batch == 0:
            return
        mode, desc, *_ = self._determine_batch_execution_and_padding(
            num_tokens=batch,
            num_reqs=batch,
            num_scheduled_tokens_np=np.ones(batch, dtype=np.int32),
            max_num_scheduled_tokens=1,
            use_cascade_attn=False,
        )
        sampling = dict(self.OMNI_SUBTALKER_DEFAULTS)
        sampling.update(getattr(self.vllm_config.model_config, "subtalker_sampling_params", None) or {})
        gens = [self._talker_mtp_generator(r) for r in req_ids]
        bufs = (self.talker_mtp_input_ids.gpu, self.talker_mtp_inputs_embeds.gpu, self.last_talker_hidden.gpu, self.text_step.gpu)

        def call(n: int, **gen_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            with set_forward_context(None, self.vllm_config, num_tokens=n, cudagraph_runtime_mode=mode, batch_descriptor=desc):
                return self.talker_mtp(*(b[:n] for b in bufs), **sampling, **gen_kwargs)

        if not any(g is not None for g in gens):
            embeds, codes = call(batch)
        elif batch == 1:
            embeds, codes = call(1, generator=gens[0])
        elif self.OMNI_MTP_PER_ROW_GENERATORS:
            embeds, codes = call(batch, generator=None, generators=gens)
        else:
            saved = [b[0].clone() for b in bufs]
            outs = []
            for i, g in enumerate(gens):
                for b in bufs:
                    b[0].copy_(b[i])
                outs.append(call(1, **({"generator": g} if g is not None else {})))
            for b, s in zip(bufs, saved):
                b[0].copy_(s)
            embeds = torch.cat([o[0] for o in outs])
            codes = torch.cat([o[1] for o in outs])

        offsets = start_offsets if start_offsets is not None else list(range(batch))
        kind, qual = self.OMNI_MTP_OUTPUT_KEY
        for i, req_id in enumerate(req_ids):
            inputs_embeds[offsets[i]].copy_(embeds[i])
            self._update_intermediate_buffer(req_id, {kind: {qual: codes[i : i + 1]}})
            self.prototype_trace["mtp_codes"].setdefault(req_id, []).append(codes[i].tolist())


class PrototypeTalkerPerRowRunner(PrototypeTalkerRunner):
    """qwen3_omni-talker-like: MTP, no batched decode hook, shared-generator predictor."""

    OMNI_DECODE_BATCH = "none"
    OMNI_MTP_PER_ROW_GENERATORS = False


class PrototypeTalkerNoMtpRunner(PrototypeTalkerRunner):
    """higgs-like: no MTP, batched decode with the 3-tuple hook."""

    OMNI_HAS_MTP = False
    OMNI_DECODE_BATCH = "no_mtp"
    OMNI_MTP_PER_ROW_GENERATORS = False


class PrototypeCode2WavRunner(_OmniBufferMixin, GPUModelRunner):
    """A generation stage on vLLM's AR loop: the prompt is the codes, max_tokens=1.

    Every forward's ``multimodal_outputs["audio"]`` (one row of samples per token)
    is split by request and accumulated; the one sampled token only lets vLLM's
    scheduler finish the request.
    """

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self._init_omni_state()
        self._audio_chunks: dict[str, list[torch.Tensor]] = {}
        # Stand-in for the stage's final output channel: plain vLLM has none for
        # audio, so a finished request's waveform is kept here for the test.
        self.published_audio: dict[str, torch.Tensor] = {}

    def _on_multimodal_outputs(self, payload: dict[str, Any]) -> None:
        audio = payload.get("audio")
        if audio is None:
            return
        qsl = self.query_start_loc.cpu
        for i, req_id in enumerate(self.input_batch.req_ids):
            s, e = int(qsl[i]), int(qsl[i + 1])
            chunk = audio[s:e].reshape(-1).detach().to("cpu")
            self._audio_chunks.setdefault(req_id, []).append(chunk)
            self.prototype_trace["audio_samples"][req_id] = sum(c.numel() for c in self._audio_chunks[req_id])

    def finished_audio(self, req_id: str) -> torch.Tensor:
        """A request's waveform: published once released, else what it has so far."""
        if req_id in self.published_audio:
            return self.published_audio[req_id]
        return torch.cat(self._audio_chunks.get(req_id, [torch.empty(0)]))

    def _on_request_state_removed(self, req_id: str, req_state: Any) -> None:
        super()._on_request_state_removed(req_id, req_state)
        chunks = self._audio_chunks.pop(req_id, None)
        if chunks:
            self.published_audio[req_id] = torch.cat(chunks)


# ------------------------------------------------------------------------- workers

if current_platform.is_cpu():
    import vllm.v1.worker.cpu_worker as _runner_site
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner as _PlatformRunner
    from vllm.v1.worker.cpu_worker import CPUWorker as _BaseWorker

    _RUNNER_NAME = "CPUModelRunner"  # module global used by CPUWorker.init_device
else:
    import vllm.v1.worker.gpu_model_runner as _runner_site  # type: ignore[no-redef]
    from vllm.v1.worker.gpu_worker import Worker as _BaseWorker  # type: ignore[assignment]

    _PlatformRunner = None  # type: ignore[assignment]
    _RUNNER_NAME = "GPUModelRunner"  # imported inside Worker.init_device


def compose_runner(runner_cls: type[GPUModelRunner]) -> type[GPUModelRunner]:
    """The runner class to build here: on CPU, ``(runner_cls, CPUModelRunner)``."""
    if _PlatformRunner is None:
        return runner_cls
    return type(
        f"CPU{runner_cls.__name__}",
        (runner_cls, _PlatformRunner),
        {"__module__": runner_cls.__module__, "__qualname__": f"CPU{runner_cls.__qualname__}"},
    )


@contextlib.contextmanager
def _runner_class_bound(cls: type) -> Iterator[None]:
    original = getattr(_runner_site, _RUNNER_NAME)
    setattr(_runner_site, _RUNNER_NAME, cls)
    try:
        yield
    finally:
        setattr(_runner_site, _RUNNER_NAME, original)


class _OmniWorkerBase(_BaseWorker):  # type: ignore[misc, valid-type]
    model_runner_cls: type[GPUModelRunner]

    def init_device(self) -> None:
        if self.use_v2_model_runner:
            # The scheduler is configured from the same flag; flipping it here
            # would desynchronise them. Set VLLM_USE_V2_MODEL_RUNNER=0 instead.
            raise RuntimeError(
                f"{type(self).__name__} builds a V1 (GPUModelRunner) runner, but this engine "
                "selected Model Runner V2; start it with VLLM_USE_V2_MODEL_RUNNER=0"
            )
        with _runner_class_bound(self.model_runner_cls):
            super().init_device()
        if type(self.model_runner) is not self.model_runner_cls:
            raise RuntimeError(
                f"{type(self).__name__}: expected a {self.model_runner_cls.__name__} runner, "
                f"vLLM built {type(self.model_runner).__name__} (did init_device change?)"
            )


class PrototypeTalkerWorker(_OmniWorkerBase):
    model_runner_cls = compose_runner(PrototypeTalkerRunner)


class PrototypeTalkerPerRowWorker(_OmniWorkerBase):
    model_runner_cls = compose_runner(PrototypeTalkerPerRowRunner)


class PrototypeTalkerNoMtpWorker(_OmniWorkerBase):
    model_runner_cls = compose_runner(PrototypeTalkerNoMtpRunner)


class PrototypeCode2WavWorker(_OmniWorkerBase):
    model_runner_cls = compose_runner(PrototypeCode2WavRunner)
