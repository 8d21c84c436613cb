"""Reading what an omnigen stage published from vLLM's own outputs (CONTRACT 8.1).

``OmniScheduler`` puts a finished request's payload, in omnigen's envelope, into
``RequestOutput.kv_transfer_params["omnigen"]``; ``stage_payload`` decodes it, from a
``RequestOutput`` of ``LLM`` or ``AsyncLLM`` (in process or with the engine core in a
subprocess), or from the ``kv_transfer_params`` of ``vllm serve``'s JSON completion response.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omnigen.runtime.scheduler import PAYLOAD_KEY
from omnigen.runtime.serialization import deserialize_additional_information, payload_from_text


class NoStagePayload(LookupError):
    """The output carries no omnigen payload: the stage published nothing, or did not finish."""


def stage_payload(output: Any, *, required: bool = False) -> dict[str, Any]:
    """The payload a finished request's stage published (dotted keys to CPU tensors).

    ``output`` is a ``RequestOutput`` or its ``kv_transfer_params`` mapping (also as JSON decoded). ``{}`` when the
    stage published nothing, or ``NoStagePayload`` with ``required``.
    """
    params = output if isinstance(output, Mapping) else getattr(output, "kv_transfer_params", None)
    envelope = (params or {}).get(PAYLOAD_KEY)
    if envelope is None:
        if required:
            request = getattr(output, "request_id", "?")
            raise NoStagePayload(
                f"request {request!r}: no kv_transfer_params[{PAYLOAD_KEY!r}]; serve the stage with "
                "--scheduler-cls omnigen.runtime.scheduler.OmniScheduler and let the request finish"
            )
        return {}
    if isinstance(envelope, str):
        return payload_from_text(envelope)
    return deserialize_additional_information(envelope)
