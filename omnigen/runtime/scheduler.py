"""The schedulers vLLM loads for an omnigen stage (``scheduler_cls``): the output channel (8.1).

A generated runner attaches the rows each step publishes to the ``ModelRunnerOutput`` it
returns (``vllm_api.attach_step_payloads``). These schedulers, vLLM's own with one mixin,
fold the rows per request as CONTRACT 5.1 folds a full payload, and when a request finishes
merge the payload, as text (``serialization.payload_to_text``: base64 of the msgpack envelope),
into its ``EngineCoreOutput.kv_transfer_params`` under ``"omnigen"``. vLLM's output processor
copies that field unchanged into ``RequestOutput.kv_transfer_params``, in process and across the
engine-core process boundary, for ``LLM`` and ``AsyncLLM``, and ``vllm serve`` returns it in its
JSON completion response (bytes there would fail the response: "not JSON serializable"). Other keys of
``kv_transfer_params`` (a P/D connector's) are kept. An aborted or failed request's rows are
dropped. ``omnigen.serving.client.stage_payload`` decodes the field.

Load with ``scheduler_cls="omnigen.runtime.scheduler.OmniScheduler"`` (``--scheduler-cls``),
or ``OmniAsyncScheduler`` where vLLM schedules asynchronously (GPU; the CPU platform turns
async scheduling off).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from omnigen.runtime import payloads, vllm_api
from omnigen.runtime.serialization import payload_to_text

PAYLOAD_KEY = "omnigen"
"""The ``kv_transfer_params`` key of a finished request's payload."""


class OmniOutputMixin:
    """Accumulate each request's published rows; hand the payload over when it finishes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The stage's runner is a V1 runner: schedule for it (SchedulerOutput's V1 shape).
        vllm_api.keep_v1_model_runner(self)
        self.omni_pending: dict[str, payloads.PendingPayload] = {}
        """Each unfinished request's published rows so far."""

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        pending = self.omni_pending
        for req_id, rows in vllm_api.step_payloads_of(model_runner_output).items():
            if req_id in self.requests:  # type: ignore[attr-defined]
                pending[req_id] = payloads.accumulate(pending.get(req_id), dict(rows), None)
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        for batch in outputs.values():
            for output in batch.outputs:
                if output.finish_reason is None:
                    continue
                entry = pending.pop(output.request_id, None)
                if entry is None:
                    continue
                payload, _ = payloads.materialize(entry)
                output.kv_transfer_params = {
                    **(output.kv_transfer_params or {}),
                    PAYLOAD_KEY: payload_to_text(payload),
                }
        return outputs

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: Any) -> Any:
        """Aborts and errors: the request gets no payload, and its rows are dropped."""
        finished = super().finish_requests(request_ids, finished_status)  # type: ignore[misc]
        for request in finished:
            self.omni_pending.pop(request.request_id, None)
        return finished


class OmniScheduler(OmniOutputMixin, Scheduler):
    """vLLM's scheduler with omnigen's output channel."""


class OmniAsyncScheduler(OmniOutputMixin, AsyncScheduler):
    """vLLM's asynchronous scheduler with omnigen's output channel."""


def scheduler_cls_name(async_scheduling: bool = False) -> str:
    """The ``scheduler_cls`` string for vLLM."""
    cls = OmniAsyncScheduler if async_scheduling else OmniScheduler
    return f"{cls.__module__}.{cls.__qualname__}"
