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

A request whose ``SamplingParams.extra_args`` carry ``omnigen_stream`` (a streaming edge:
``{"publish_at": [n, ...], "every": k}``) also gets the payload accumulated so far on its
unfinished outputs, once it has sampled ``n`` tokens for each listed ``n`` and then every ``k``
more: always the whole payload so far, so an output vLLM merges into a later unread one
(``RequestOutput.add`` keeps the last ``kv_transfer_params``) loses nothing.

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
STREAM_KEY = "omnigen_stream"
"""The ``SamplingParams.extra_args`` key of a streaming producer request's publishing points."""


class OmniOutputMixin:
    """Accumulate each request's published rows; hand the payload over when it finishes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The worker runs the stage's V1 runner or its V2 target, as vllm_api.runner_target says
        # for this config: schedule for that one (V1: SchedulerOutput's V1 shape).
        if vllm_api.runner_target(getattr(self, "vllm_config", None)).target == "v1":
            vllm_api.keep_v1_model_runner(self)
        self.omni_pending: dict[str, payloads.PendingPayload] = {}
        """Each unfinished request's published rows so far."""
        self.omni_next_publish: dict[str, int] = {}
        """A streaming request's sampled-token count at which its payload so far goes out next."""

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        pending = self.omni_pending
        for req_id, rows in vllm_api.step_payloads_of(model_runner_output).items():
            if req_id in self.requests:  # type: ignore[attr-defined]
                pending[req_id] = payloads.accumulate(pending.get(req_id), dict(rows), None)
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        for batch in outputs.values():
            for output in batch.outputs:
                if output.finish_reason is None:
                    self._publish_so_far(output)
                    continue
                self.omni_next_publish.pop(output.request_id, None)
                entry = pending.pop(output.request_id, None)
                if entry is None:
                    continue
                payload, _ = payloads.materialize(entry)
                output.kv_transfer_params = {
                    **(output.kv_transfer_params or {}),
                    PAYLOAD_KEY: payload_to_text(payload),
                }
        return outputs

    def _publish_so_far(self, output: Any) -> None:
        """A streaming request's payload so far, when it reached its next publishing point."""
        request = self.requests.get(output.request_id)  # type: ignore[attr-defined]
        entry = self.omni_pending.get(output.request_id)
        if request is None or entry is None:
            return
        stream = stream_points(getattr(request, "sampling_params", None))
        if stream is None:
            return
        sampled = request.num_output_tokens
        due = self.omni_next_publish.get(output.request_id, stream[0][0] if stream[0] else stream[1])
        if sampled < due:
            return
        self.omni_next_publish[output.request_id] = next_point(stream, sampled)
        payload = payloads.compact(entry)
        output.kv_transfer_params = {
            **(output.kv_transfer_params or {}),
            PAYLOAD_KEY: payload_to_text(payload),
        }

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: Any) -> Any:
        """Aborts and errors: the request gets no payload, and its rows are dropped."""
        finished = super().finish_requests(request_ids, finished_status)  # type: ignore[misc]
        for request in finished:
            self.omni_pending.pop(request.request_id, None)
            self.omni_next_publish.pop(request.request_id, None)
        return finished


def stream_points(sampling_params: Any) -> tuple[list[int], int] | None:
    """A streaming request's publishing points (``publish_at``, ``every``), or None."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    stream = extra.get(STREAM_KEY)
    if not stream:
        return None
    return [int(n) for n in stream.get("publish_at", ())], max(int(stream.get("every", 1)), 1)


def next_point(stream: tuple[list[int], int], sampled: int) -> int:
    """The first publishing point after ``sampled`` tokens."""
    listed, every = stream
    for point in listed:
        if point > sampled:
            return point
    last = listed[-1] if listed else 0
    return sampled + every - (sampled - last) % every if sampled >= last else last


class OmniScheduler(OmniOutputMixin, Scheduler):
    """vLLM's scheduler with omnigen's output channel."""


class OmniAsyncScheduler(OmniOutputMixin, AsyncScheduler):
    """vLLM's asynchronous scheduler with omnigen's output channel."""


def scheduler_cls_name(async_scheduling: bool = False) -> str:
    """The ``scheduler_cls`` string for vLLM."""
    cls = OmniAsyncScheduler if async_scheduling else OmniScheduler
    return f"{cls.__module__}.{cls.__qualname__}"
