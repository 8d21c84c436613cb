"""``OmniModelStateV2``: the omni state of a stage as a vLLM Model Runner V2 ``ModelState``.

V2 calls a model state at fixed points of each step (docs/model-runner-v2.md, section 2):
``remove_request``/``add_request`` while it admits the step's requests, ``preprocess_state`` once
the step's ``InputBatch`` exists (real steps only), ``prepare_inputs_embeds`` (a stage with a
preprocess hook: ``uses_inputs_embeds``), ``prepare_inputs`` (its dict overrides the model's
keyword arguments), then the forward. This base keeps omnigen's per-request state
(``OmniStateBase``: buffers, payloads, generators) keyed by request id, a registry of admitted
requests (``requests``, omnigen's ``RequestRecord``), and a V1-shaped view of the step's rows
(``input_batch``, ``query_start_loc``), so the generated hook bodies are the V1 template's own.

The forward's output reaches V2 through a forward adapter installed on the model instance: V2
requires the forward to return a tensor (the hidden states it samples from), while an omni stage
returns an ``OmniOutput`` with its payload. The adapter keeps the step's rows, hidden states and
payload (``step_outputs.StepSnapshot``) for the runner's ``sample_tokens`` and hands V2 the text
hidden states.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
import torch

from omnigen.runtime import mrope, step_outputs, vllm_api, vllm_api_v2
from omnigen.runtime.base import OmniStateBase, dummy_run_hidden_states
from omnigen.runtime.outputs import as_omni_output


class RequestRecord:
    """omnigen's record of one admitted request on V2 (V2 keeps no per-request object the model
    state can reach): what the contract reads from vLLM's ``CachedRequestState`` on V1, and the
    buffer mirror (4.1)."""

    __slots__ = (
        "additional_information_cpu",
        "mm_features",
        "num_prompt_tokens",
        "req_id",
        "sampling_params",
    )

    def __init__(self, new_req_data: Any) -> None:
        self.req_id = new_req_data.req_id
        self.update(new_req_data)

    def update(self, new_req_data: Any) -> None:
        self.sampling_params = new_req_data.sampling_params
        self.mm_features = new_req_data.mm_features
        self.num_prompt_tokens = len(new_req_data.prompt_token_ids or ())

    def __repr__(self) -> str:
        return f"RequestRecord({self.req_id!r})"


class StepRows:
    """The step's rows in V1's shape, read from V2's ``InputBatch`` (rows in V2's order: decodes
    first): what the generated bodies read from V1's ``input_batch`` and the scheduler output's
    ``num_scheduled_tokens`` (3.1)."""

    __slots__ = (
        "num_computed_tokens_cpu",
        "num_prompt_tokens",
        "num_reqs",
        "num_scheduled_tokens",
        "req_id_to_index",
        "req_ids",
    )

    def __init__(self, input_batch: Any) -> None:
        n = input_batch.num_reqs
        self.req_ids = list(input_batch.req_ids[:n])
        self.num_reqs = n
        self.req_id_to_index = dict(zip(self.req_ids, range(n), strict=True))
        self.num_computed_tokens_cpu = input_batch.num_computed_tokens_np[:n]
        self.num_scheduled_tokens = dict(
            zip(self.req_ids, input_batch.num_scheduled_tokens[:n].tolist(), strict=True)
        )
        self.num_prompt_tokens: Any = None


class QueryStartLoc:
    """The step's ``query_start_loc`` as V1's ``CpuGpuBuffer`` exposes it (``np``, ``cpu``)."""

    __slots__ = ("cpu", "np")

    def __init__(self, values: np.ndarray) -> None:
        self.np = values
        self.cpu = torch.from_numpy(values)


class OmniModelStateV2(OmniStateBase):
    """The V2 model state of an omni stage (mixin placed before ``DefaultModelState``)."""

    USES_INPUTS_EMBEDS: ClassVar[bool] = False
    """The stage has a preprocess hook: V2 must call ``prepare_inputs_embeds`` every step (the
    runner sets ``uses_inputs_embeds``) and the model gets the embeddings the hook writes."""

    ROPE_STATE: ClassVar[type | None] = None
    """The rope state to build instead of vLLM's for an M-RoPE checkpoint (7.6, 3.7), or None."""

    def __init__(self, vllm_config: Any, model: Any, encoder_cache: Any, device: torch.device) -> None:
        rope = self.ROPE_STATE
        with vllm_api_v2.rope_state_factory(rope) if rope is not None else contextlib.nullcontext():
            super().__init__(vllm_config, model, encoder_cache, device)
        self.requests: dict[str, RequestRecord] = {}
        """Every admitted request (a preempted one stays until it finishes, as on V1)."""
        self._omni_preempted: set[str] = set()
        """Requests preempted and not yet resumed."""
        self.compilation_config = vllm_config.compilation_config
        self.input_batch: StepRows | None = None
        self.query_start_loc: QueryStartLoc | None = None
        self._omni_batch: Any = None
        """V2's ``InputBatch`` of the real step in flight (dummy runs have another)."""
        self._omni_forward_kwargs: dict[str, Any] | None = None
        self._omni_forward_pending = False
        self._omni_decode_step_open = False
        self._omni_inputs_embeds: torch.Tensor | None = None
        self._omni_req_states: Any = None
        """V2's ``RequestState`` (the runner's), as the last ``prepare_inputs`` got it."""
        if (
            self.USES_INPUTS_EMBEDS
            and not self.supports_mm_inputs
            and getattr(self, "inputs_embeds", None) is None
        ):
            # One persistent buffer: eager steps, graph capture and replay see one address.
            self.inputs_embeds = torch.zeros(
                (self.max_num_tokens, self.inputs_embeds_size), dtype=self.dtype, device=self.device
            )
        install_forward_adapter(model, self)

    # -- buffers the V1 runner allocated (2.1) -----------------------------------------------

    def _make_buffer(self, *size: int, dtype: torch.dtype, numpy: bool = True) -> Any:
        """A persistent host/device buffer, as V1's ``GPUModelRunner._make_buffer`` made them."""
        return vllm_api_v2.cpu_gpu_buffer(*size, dtype=dtype, device=self.device, numpy=numpy)

    # -- 4.2, 8.2 admission ----------------------------------------------------------------------

    def _admit(self, new_req_data: Any) -> bool:
        """Register a request V2 admits; whether its payloads merge. V2 admits a request as new
        again when it resumes after preemption (with its generated tokens in its prefill), where
        V1 schedules it as a cached request: its buffer, generator and payload stay, and the
        payloads it arrived with, whose transport handle was released when first read (8.2), are
        not read twice. A request admitted again without having been preempted (a streaming
        input's next chunk) merges what it brings, as on V1."""
        req_id = new_req_data.req_id
        record = self.requests.get(req_id)
        if record is None:
            self.requests[req_id] = RequestRecord(new_req_data)
        else:
            record.update(new_req_data)
        if req_id in self._omni_preempted:
            self._omni_preempted.discard(req_id)
            return False
        return True

    def _note_preempted(self, preempted_req_ids: Any, finished_req_ids: Any) -> None:
        """Requests V2 preempted this step (they come back as new requests when resumed)."""
        self._omni_preempted.update(req_id for req_id in preempted_req_ids if req_id not in finished_req_ids)

    def _merge_cached_payloads(self, scheduler_output: Any) -> None:
        """The scheduler's payloads for cached requests (4.2): a stage that refreshes every step
        merges them (generated); one that takes payloads only at admission does not."""

    # -- 6 finished requests ---------------------------------------------------------------------

    def _release_finished_requests(self, finished_req_ids: Any) -> None:
        super()._release_finished_requests(finished_req_ids)
        for req_id in finished_req_ids:
            self.requests.pop(req_id, None)
            self._omni_preempted.discard(req_id)

    # -- the step: rows, forward kwargs, forward output ------------------------------------------

    def preprocess_state(self, input_batch: Any, *args: Any, **kwargs: Any) -> None:
        """A real step's ``InputBatch`` (V2 calls this hook on real steps only): the step's rows
        are read from it, and ``prepare_inputs`` knows the step from a dummy run."""
        super().preprocess_state(input_batch, *args, **kwargs)  # type: ignore[misc]
        self._omni_batch = input_batch
        self._omni_step = None
        self._omni_forward_kwargs = None
        self._omni_forward_pending = False
        self._omni_inputs_embeds = None
        self.omni_step_payloads = {}
        self.input_batch = StepRows(input_batch)
        self.query_start_loc = QueryStartLoc(input_batch.query_start_loc_np[: input_batch.num_reqs + 1])

    def _read_rows(self, req_states: Any) -> StepRows:
        """The step's rows with their prompt lengths (3.1: the prompt's, not V2's ``prefill_len``,
        which after a resume includes the generated tokens)."""
        rows = self.input_batch
        assert rows is not None
        if rows.num_prompt_tokens is None:
            rows.num_prompt_tokens = req_states.prompt_len.np[
                self._omni_batch.idx_mapping_np[: rows.num_reqs]
            ]
        return rows

    def prepare_inputs_embeds(self, scheduled_encoder_inputs: Any, input_batch: Any, req_states: Any) -> Any:
        """V2's embeddings (the encoder's merged in for a multimodal stage, else the ids' own),
        written into the persistent buffer; on a real step, the rows' hooks then write theirs
        into it and into the step's ids (3.1-3.6)."""
        inputs_embeds = super().prepare_inputs_embeds(scheduled_encoder_inputs, input_batch, req_states)  # type: ignore[misc]
        if input_batch is not self._omni_batch or input_batch.num_tokens == 0:
            return inputs_embeds
        self._omni_inputs_embeds = inputs_embeds
        num_tokens = input_batch.num_tokens
        self._preprocess_step(
            self._read_rows(req_states), input_batch.input_ids[:num_tokens], inputs_embeds[:num_tokens]
        )
        return inputs_embeds

    def _preprocess_step(self, rows: StepRows, input_ids: torch.Tensor, inputs_embeds: torch.Tensor) -> None:
        """This stage's preprocessing of a real step (generated)."""

    def prepare_inputs(self, input_batch: Any, req_states: Any) -> dict[str, Any]:
        """vLLM's inputs, and on a real step this stage's forward kwargs (1.1, 1.2, 7.3, 7.7)."""
        inputs = super().prepare_inputs(input_batch, req_states)  # type: ignore[misc]
        self._omni_req_states = req_states
        if self.USES_INPUTS_EMBEDS:
            # 3.6: the model gets the step's ids (which a hook may have rewritten) beside the
            # embeddings; V2 passes none once it passes embeddings.
            inputs["input_ids"] = input_batch.input_ids
        if input_batch is not self._omni_batch:
            return inputs
        forward_kwargs = self._forward_kwargs(input_batch, inputs)
        self._omni_forward_kwargs = forward_kwargs
        self._omni_forward_pending = True
        inputs.update(forward_kwargs)
        return inputs

    def _forward_kwargs(self, input_batch: Any, inputs: dict[str, Any]) -> dict[str, Any]:
        """This stage's forward kwargs of a real step (generated)."""
        return {}

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, Any]:
        """A graph capture's inputs: a stage with a preprocess hook is captured on its persistent
        embeddings, as its steps run (3.3)."""
        inputs = super().prepare_dummy_inputs(num_reqs, num_tokens)  # type: ignore[misc]
        if self.USES_INPUTS_EMBEDS and "inputs_embeds" not in inputs:
            inputs["inputs_embeds"] = self.dummy_inputs_embeds(num_tokens)
        return inputs

    def _omni_hand_back(self, output: Any, kwargs: dict[str, Any]) -> Any:
        """The forward adapter's result for V2: keep a real step's rows, hidden states and payload
        for ``sample_tokens``; give V2 the text hidden states (an empty-width tensor of one row
        per token for a generation stage, which has none)."""
        if not self._omni_forward_pending:
            return dummy_run_hidden_states(output, kwargs)
        self._omni_forward_pending = False
        return self._keep_step(self._assemble_output(output, self._omni_forward_kwargs or {}))

    def _assemble_output(self, output: Any, forward_kwargs: dict[str, Any]) -> Any:
        """The step's ``OmniOutput`` from the forward's result (generated where the stage
        assembles or flattens it: 1.1-omni-output, 7.2-make-omni-output, 7.7-batch-req-ids)."""
        return as_omni_output(output)

    def _omni_take_step(self, executed: Any) -> step_outputs.StepSnapshot | None:
        """The real step's snapshot for ``sample_tokens``, once. Under a full CUDA graph replay
        no Python ran in the forward: the snapshot is then made from the replayed hidden states
        (a stage whose forward itself returns its payload never replays a full graph: its worker
        narrows the graph mode, docs/model-runner-v2.md section 4 item 1)."""
        if self._omni_forward_pending and executed is not None and executed.hidden_states is not None:
            self._omni_forward_pending = False
            n = int(self.query_start_loc.np[-1]) if self.query_start_loc is not None else 0
            self._keep_step(
                self._assemble_output(executed.hidden_states[:n], self._omni_forward_kwargs or {})
            )
        step, self._omni_step = self._omni_step, None
        self._omni_batch = None
        return step

    def _omni_close_decode_step(self) -> None:
        """After the forward, whatever happened in it: the model's decode step ends (1.2)."""
        if self._omni_decode_step_open:
            self._omni_decode_step_open = False
            self.model.finish_decode_step_forward()

    def _finish_generation_step(self, step: step_outputs.StepSnapshot) -> None:
        """After a generation step: each request's payload (generated, 7.3)."""

    # -- 2.3 the code predictor's dispatch on V2 -------------------------------------------------

    def _mtp_dispatch(self, batch: int) -> tuple[Any, Any]:
        """The predictor's graph mode and batch descriptor for ``batch`` rows: the smallest size
        its full-graph wrapper has captured that holds them (FULL), else eager (NONE). V2 has no
        ``_determine_batch_execution_and_padding``; the wrapper's own captured entries say what
        replays, so serving never captures (vLLM 0.34 has no capture guard, and a wrapper called
        at FULL with a new size would capture)."""
        descriptor_cls = vllm_api_v2.BatchDescriptor
        if not vllm_api.is_full_graph_wrapped(self.talker_mtp):
            return vllm_api.CUDAGraphMode.NONE, descriptor_cls(num_tokens=batch)
        sizes = captured_sizes(self.talker_mtp)
        padded = min((size for size in sizes if size >= batch), default=None)
        if padded is None:
            return vllm_api.CUDAGraphMode.NONE, descriptor_cls(num_tokens=batch)
        return vllm_api.CUDAGraphMode.FULL, descriptor_cls(num_tokens=padded)

    def _mtp_capture_sizes(self) -> list[int]:
        """The predictor batch sizes captured with the model's graphs (2.2): vLLM's capture sizes,
        at most one MTP row per request."""
        sizes = self.compilation_config.cudagraph_capture_sizes or ()
        return sorted({min(int(size), self.max_num_reqs) for size in sizes})


def captured_sizes(wrapper: Any) -> list[int]:
    """The batch sizes a full-graph wrapper holds a captured graph for."""
    entries = getattr(wrapper, "concrete_cudagraph_entries", None) or {}
    return sorted(
        int(descriptor.num_tokens)
        for descriptor, entry in entries.items()
        if getattr(entry, "cudagraph", None) is not None
    )


def install_forward_adapter(model: Any, state: OmniModelStateV2) -> None:
    """Shadow ``model.forward`` on the instance (as ``compute_logits`` is shadowed for 7.7) with
    a function that calls the class's forward and hands its output to ``state``."""
    forward = type(model).forward

    def omni_forward(*args: Any, **kwargs: Any) -> Any:
        try:
            output = forward(model, *args, **kwargs)
        finally:
            state._omni_close_decode_step()
        return state._omni_hand_back(output, kwargs)

    model.forward = omni_forward


class TextOnlyRopeState(vllm_api_v2.RopeState):
    """M-RoPE positions of a model without ``get_mrope_input_positions`` (CONTRACT 7.6): a
    request of text tokens has its three sections advance together, with no decode delta; one
    with multimodal features is refused, naming the request (``mrope.text_only_positions``)."""

    def init_prefill_positions(
        self, req_idx: int, model: Any, prefill_token_ids: list[int], mm_features: list
    ) -> None:
        request = _PrefillRequest(prefill_token_ids, mm_features)
        positions, delta = mrope.text_only_positions(request)
        self.prefill_delta.np[req_idx] = delta
        for i in range(self.num_dims):
            self.prefill_positions.stage_write(self.num_dims * req_idx + i, 0, positions[min(i, 2)].tolist())


class FilteredKwargsRopeState(vllm_api_v2.RopeState):
    """vLLM's M-RoPE positions, with ``get_mrope_input_positions`` given only the keyword
    arguments it accepts (CONTRACT 3.7). V2 calls it as ``(prefill_token_ids, mm_features)``;
    a model whose signature names the features otherwise, or not at all, gets them by keyword
    only where it accepts them, and one that requires more (a V1-era signature's ``hf_config``,
    ``image_grid_thw``) fails with the parameter named."""

    def init_prefill_positions(
        self, req_idx: int, model: Any, prefill_token_ids: list[int], mm_features: list
    ) -> None:
        get_positions = model.get_mrope_input_positions
        kwargs = mrope.filter_mrope_kwargs(get_positions, {"mm_features": mm_features})
        try:
            positions, delta = get_positions(prefill_token_ids, **kwargs)
        except TypeError as exc:
            exc.add_note(
                f"{type(model).__name__}.get_mrope_input_positions was called by omnigen's V2 target with "
                f"the prefill tokens and {sorted(kwargs) or 'no keyword arguments'} (what Model Runner V2 "
                "knows of a request); docs/model-runner-v2.md section 4 item 7"
            )
            raise
        self.prefill_delta.np[req_idx] = delta
        for i in range(self.num_dims):
            self.prefill_positions.stage_write(self.num_dims * req_idx + i, 0, positions[i].tolist())


class _PrefillRequest:
    """What ``mrope.text_only_positions`` reads from a request."""

    def __init__(self, prefill_token_ids: list[int], mm_features: Iterable[Any]) -> None:
        self.req_id = "?"
        self.mm_features = list(mm_features or ())
        self.num_prompt_tokens = len(prefill_token_ids)
