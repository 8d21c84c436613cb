"""The contract pieces every omni stage has, whatever its config says.

``OmniRunnerBase`` is a mixin placed before vLLM's runner class in each
generated runner: ``class Qwen3OmniTalkerRunner(OmniRunnerBase, GPUModelRunner)``.
Policy-specific paths (MTP, decode batching, snapshot replacement, decode-step
metadata, ...) are not here: the generated class has them only where its
config enables them. Class constants set by the generated class carry the
per-stage decisions this mixin needs (``GPU_RESIDENT_KEYS``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from omnigen.runtime import buffers, payloads, step_outputs, transport, vllm_api
from omnigen.runtime.outputs import OmniOutput, as_omni_output, restore_flattened_omni_output
from omnigen.runtime.serialization import deserialize_additional_information, inline_payload


class OmniStateBase:
    """The per-request omni state and bookkeeping every target keeps, whatever runs the step: the
    V1 runner (``OmniRunnerBase``) and the V2 target's model state
    (``omnigen.runtime.v2.OmniModelStateV2``) both hold it. ``requests`` is the target's map of
    request records (vLLM's ``CachedRequestState`` on V1, omnigen's own record on V2), each with
    ``sampling_params``, ``mm_features`` and the buffer mirror ``additional_information_cpu``."""

    OMNI_MODEL: ClassVar[str] = ""
    OMNI_STAGE: ClassVar[str] = ""
    GPU_RESIDENT_KEYS: ClassVar[frozenset[tuple[str, str]]] = frozenset()
    """``(type, qualifier)`` buffer keys whose tensors stay on the device (``buffers.gpu_resident``)."""
    PUBLISHED_KEYS: ClassVar[frozenset[str] | None] = frozenset()
    """The payload keys each step publishes to the scheduler (8.1): a key names itself and the
    dotted keys under it; ``None`` publishes every key (a producer feeding the next stage).
    Set by the generated class from ``publish``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.model_intermediate_buffer: dict[str, dict[str, Any]] = {}
        self._pending_full_payload_send: dict[str, payloads.PendingPayload] = {}
        self._local_stage_payload_cache: dict[str, dict[str, Any]] = {}
        self._full_payload_pending_broadcast_req_ids: set[str] = set()
        self._talker_mtp_generators: dict[str, torch.Generator] = {}
        self._talker_mtp_views: dict[int, Any] = {}
        """``mtp.leading_rows``' views of the four MTP buffers, by row count."""
        self.omni_prefix_cache = None
        self._omni_last_model_output: Any = None
        self._omni_step: step_outputs.StepSnapshot | None = None
        self.omni_step_payloads: dict[str, dict[str, Any]] = {}
        """Each request's published payload of the last step (dotted keys), for the stage's
        client and the next stage (7.2)."""

    # -- 4. Per-request buffers -------------------------------------------------------------

    def _update_intermediate_buffer(self, req_id: str, update: Any) -> None:
        """Merge ``update`` into the request's buffer one level deep and mirror it (4.1)."""
        if not isinstance(update, dict) or not update:
            return
        request = self.requests.get(req_id)
        if request is None:
            return
        buffers.merge_updates((self._request_buffer(req_id),), (request,), (update,), self.GPU_RESIDENT_KEYS)

    def _request_buffer(self, req_id: str) -> dict[str, Any]:
        """The request's buffer, created (and mirrored) on first use; ``{}`` for an unknown request."""
        buffer = self.model_intermediate_buffer.get(req_id)
        if buffer is not None:
            return buffer
        request = self.requests.get(req_id)
        if request is None:
            return {}
        buffer = self.model_intermediate_buffer[req_id] = {}
        request.additional_information_cpu = buffer
        return buffer

    def _replace_intermediate_buffer(self, req_id: str, snapshot: dict[str, Any]) -> None:
        """Make ``snapshot`` the request's buffer (and its mirror)."""
        request = self.requests.get(req_id)
        if request is None:
            return
        self.model_intermediate_buffer[req_id] = snapshot
        request.additional_information_cpu = snapshot

    def _update_additional_information(self, scheduler_output: Any) -> None:
        """Merge the scheduler's payloads: new requests' buffers and infos, cached requests' infos (4.2)."""
        for new_req in scheduler_output.scheduled_new_reqs:
            for payload in new_request_payloads(new_req):
                self._update_intermediate_buffer(new_req.req_id, payload)
        for req_id, payload in cached_request_payloads(scheduler_output):
            self._update_intermediate_buffer(req_id, payload)

    def _admit_new_request_payloads(self, scheduler_output: Any) -> None:
        """Merge the payloads new requests arrive with (stages that do not refresh every step)."""
        for new_req in scheduler_output.scheduled_new_reqs:
            for payload in new_request_payloads(new_req):
                self._update_intermediate_buffer(new_req.req_id, payload)

    def _merge_new_request_payloads(self, new_req: Any) -> None:
        """Merge the payloads one new request arrives with (4.2): its buffer dict, decoded infos,
        and the payload it carries in ``SamplingParams.extra_args`` (a handle is read once)."""
        for payload in new_request_payloads(new_req):
            self._update_intermediate_buffer(new_req.req_id, payload)

    def _merge_cached_request_payloads(self, scheduler_output: Any) -> None:
        """Merge the payloads the scheduler sends for cached requests this step (4.2)."""
        for req_id, payload in cached_request_payloads(scheduler_output):
            self._update_intermediate_buffer(req_id, payload)

    def _update_streaming_input_additional_info(self, new_req_data: Any, req_id: str) -> None:
        """A request re-admitted with more streaming input: merge, mark resumable, mirror (4.4)."""
        incoming = getattr(new_req_data, "model_intermediate_buffer", None)
        if not isinstance(incoming, dict) or not incoming:
            incoming = deserialize_additional_information(
                getattr(new_req_data, "additional_information", None)
            )
        merged = buffers.merged_for_streaming(self.model_intermediate_buffer.get(req_id), incoming)
        self.model_intermediate_buffer[req_id] = merged
        request = self.requests.get(req_id)
        if request is not None:
            request.additional_information_cpu = merged

    def _sync_local_stage_payloads(self) -> None:
        """Move received stage payloads into buffers of active, not-pending requests (4.5)."""
        cache = self._local_stage_payload_cache
        if not cache:
            return
        pending = self._full_payload_pending_broadcast_req_ids
        ready = [
            req_id
            for req_id, payload in cache.items()
            if req_id in self.requests and req_id not in pending and isinstance(payload, dict)
        ]
        for req_id in ready:
            self._update_intermediate_buffer(req_id, cache.pop(req_id))

    # -- 1.3 Outputs ---------------------------------------------------------------------------

    @staticmethod
    def _split_plain_output(hidden_states: Any) -> tuple[Any, dict[str, Any]]:
        """``(text_hidden, {})`` for a tensor, intermediate tensors, tuple or list; else ValueError."""
        if isinstance(hidden_states, (torch.Tensor, vllm_api.IntermediateTensors)):
            return hidden_states, {}
        if isinstance(hidden_states, (tuple, list)):
            return hidden_states[0], {}
        raise ValueError(
            f"extract_multimodal_outputs: invalid hidden states type {type(hidden_states).__name__}; "
            "expected OmniOutput, torch.Tensor, IntermediateTensors, tuple or list"
        )

    def published_step_payloads(self) -> dict[str, dict[str, Any]]:
        """The rows of this step's payloads that the stage publishes, per request (8.1)."""
        keys = self.PUBLISHED_KEYS
        if keys is None:
            return {req_id: payload for req_id, payload in self.omni_step_payloads.items() if payload}
        if not keys:
            return {}
        published = {}
        for req_id, payload in self.omni_step_payloads.items():
            rows = {key: value for key, value in payload.items() if _is_published(key, keys)}
            if rows:
                published[req_id] = rows
        return published

    def _finish_step(self, step: step_outputs.StepSnapshot) -> None:
        """After sampling: post-forward hooks and the step's per-request payloads (generated)."""

    def _accumulate_request_payloads(self, payloads: dict[str, dict[str, Any]]) -> None:
        """Fold each request's payload of this step into what it sends when it ends (5.1)."""
        for req_id, payload in payloads.items():
            request = self.requests.get(req_id)
            if request is not None and payload:
                self.accumulate_full_payload_output(req_id, payload, request)

    # -- 5. Stage-to-stage payloads ------------------------------------------------------------

    def accumulate_full_payload_output(
        self, req_id: str, pooler_output: dict[str, Any], request: Any
    ) -> None:
        """Fold one step's output into what this stage sends when the request ends (5.1)."""
        pending = self._pending_full_payload_send
        pending[req_id] = payloads.accumulate(pending.get(req_id), pooler_output, request)

    @staticmethod
    def _materialize_full_payload_entry(entry: payloads.PendingPayload) -> tuple[dict[str, Any], Any]:
        """``(dict_of_concatenated, request)`` for a pending payload (5.1)."""
        return payloads.materialize(entry)

    def _build_omni_step_outputs(
        self,
        pooler_inter: list[dict[str, Any] | None] | None,
        pooler_client: list[dict[str, Any] | None] | None,
        *,
        defer_full_payload_d2h: bool,
    ) -> tuple[list[dict[str, Any] | None] | None, list[dict[str, Any] | None] | None]:
        """Per-step multimodal outputs, host copies; ``(None, None)`` when the copy is deferred (5.3)."""
        if defer_full_payload_d2h:
            return None, None
        inter = _host_outputs(pooler_inter)
        client = inter if pooler_client is pooler_inter else _host_outputs(pooler_client)
        return inter, client

    def _keep_step(self, output: Any) -> Any:
        """The step's snapshot from its ``OmniOutput`` (or bare hidden states), kept for
        ``sample_tokens``; vLLM gets the text hidden states (an empty tensor of the step's rows
        where the stage has none)."""
        if isinstance(output, OmniOutput):
            hidden, payload = output.text_hidden_states, output.multimodal_outputs
        else:
            hidden, payload = output, None
        step = self._omni_step = step_outputs.snapshot(self, hidden, payload)
        if hidden is None:
            return torch.empty((step.bounds[-1], 0), device=self.device)
        return hidden

    # -- 6. Finished requests ------------------------------------------------------------------

    def _release_finished_requests(self, finished_req_ids: Any) -> None:
        """Drop a finished request's buffer, generator and pending payload."""
        for req_id in finished_req_ids:
            self.model_intermediate_buffer.pop(req_id, None)
            self._talker_mtp_generators.pop(req_id, None)
            self._pending_full_payload_send.pop(req_id, None)
            self._local_stage_payload_cache.pop(req_id, None)


class OmniRunnerBase(OmniStateBase):
    """The V1 target's contract pieces: a mixin placed before vLLM's V1 runner class in each
    generated runner (``class Qwen3OmniTalkerRunner(OmniRunnerBase, GPUModelRunner)``): the
    omni state of ``OmniStateBase`` plus the V1 seams (the forward output inside vLLM's step,
    sampling, finished requests, dummy runs)."""

    # -- 1.1, 7.1-7.3 The forward output inside vLLM's step -----------------------------------

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        # Inside vLLM's own step the forward output must be what vLLM samples from.
        self._omni_in_engine_step = True
        self._omni_step = None
        self.omni_step_payloads = {}
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)  # type: ignore[misc]
        finally:
            self._omni_in_engine_step = False

    def _omni_hand_back(self, output: Any) -> Any:
        """Keep the forward output; inside vLLM's step, give vLLM the text hidden states.

        Called directly (tests, other callers), ``_model_forward`` returns the ``OmniOutput``
        itself (1.1). Inside vLLM's ``execute_model``, which indexes hidden states by token, the
        step's rows, text hidden states and payload are kept for after sampling
        (``_finish_step``), and vLLM gets the text hidden states: for a generation stage
        without any, an empty-width tensor of one row per token (nothing is sampled from it).
        """
        self._omni_last_model_output = output
        if not self.__dict__.get("_omni_in_engine_step", False):
            return output
        # A stage without multimodal outputs may still get vllm-omni's envelope (Qwen2.5-Omni's
        # thinker returns one with no payload): vLLM must get its text hidden states all the same.
        return self._keep_step(as_omni_output(output))

    def sample_tokens(self, grammar_output: Any = None) -> Any:
        """vLLM's sampling, then what this stage does with the step's outputs (7.1, 7.2)."""
        output = super().sample_tokens(grammar_output)  # type: ignore[misc]
        step, self._omni_step = self.__dict__.get("_omni_step"), None
        if step is None:
            return output
        self._finish_step(step)
        return vllm_api.attach_step_payloads(output, self.published_step_payloads())

    def _on_request_state_removed(self, req_id: str, req_state: Any) -> None:
        # vLLM's _update_states calls this for each finished request it drops.
        super()._on_request_state_removed(req_id, req_state)  # type: ignore[misc]
        self._release_finished_requests((req_id,))

    def _dummy_run(self, *args: Any, **kwargs: Any) -> Any:
        # vLLM's profile/warm-up/graph-capture runs call self.model(...) directly and index
        # the result as hidden states; let them see the text hidden states of an OmniOutput.
        model = self.model
        self.model = _TextHiddenStates(model)
        try:
            return super()._dummy_run(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.model = model


class _TextHiddenStates:
    """Stands in for the model during vLLM's dummy runs: every attribute is the model's,
    and a call returns the text hidden states of an ``OmniOutput``."""

    def __init__(self, model: Any) -> None:
        object.__setattr__(self, "_model", model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return dummy_run_hidden_states(self._model(*args, **kwargs), kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def dummy_run_hidden_states(output: Any, kwargs: dict[str, Any]) -> Any:
    """What vLLM's profile, warm-up and graph-capture runs get from a forward: the text hidden
    states of an ``OmniOutput`` (an empty-width tensor of one row per token for a generation
    stage, which has none: vLLM still indexes one row per token), anything else as it is."""
    output = as_omni_output(restore_flattened_omni_output(output))
    if not isinstance(output, OmniOutput):
        return output
    if output.text_hidden_states is None:
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        return torch.empty((int(tokens.shape[0]), 0), device=tokens.device)
    return output.text_hidden_states


def _is_published(key: str, keys: frozenset[str]) -> bool:
    return key in keys or any(key.startswith(f"{name}.") for name in keys)


def new_request_payloads(new_req: Any) -> list[dict[str, Any]]:
    """A new request's payloads in merge order: its buffer dict, its decoded infos, then the
    payload it carries inline in ``SamplingParams.extra_args`` (plain vLLM's only field for it)."""
    found: list[dict[str, Any]] = []
    buffer = getattr(new_req, "model_intermediate_buffer", None)
    if isinstance(buffer, dict) and buffer:
        found.append(buffer)
    decoded = deserialize_additional_information(getattr(new_req, "additional_information", None))
    if decoded:
        found.append(decoded)
    carried = inline_payload(getattr(new_req, "sampling_params", None))
    inline = (
        _received(carried) if transport.is_handle(carried) else deserialize_additional_information(carried)
    )
    if inline:
        found.append(inline)
    return found


def _received(handle: dict[str, Any]) -> dict[str, Any]:
    """The payload a transport handle points at, released once read: this stage is its consumer (8.2)."""
    reader = transport.transport_for_handle(handle)
    payload = reader.get(handle)
    reader.release(handle)
    return payload


def cached_request_payloads(scheduler_output: Any) -> list[tuple[str, dict[str, Any]]]:
    """``(req_id, decoded payload)`` for cached requests whose scheduler data carries one."""
    infos = getattr(scheduler_output.scheduled_cached_reqs, "additional_information", None)
    if not isinstance(infos, dict):
        return []
    found = []
    for req_id, raw in infos.items():
        decoded = deserialize_additional_information(raw)
        if decoded:
            found.append((req_id, decoded))
    return found


def _host_outputs(entries: list[dict[str, Any] | None] | None) -> list[dict[str, Any] | None] | None:
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {k: v.detach().to("cpu") if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        for entry in entries
    ]


__all__ = ["OmniOutput", "OmniRunnerBase", "OmniStateBase", "cached_request_payloads", "new_request_payloads"]
