"""What a glue function reads (a finished producer request) and what it returns (the next
stage's request).

A glue function is ``(source: StageResult) -> NextStageInput``: pure, no engine objects, no
vllm-omni. The pipeline driver builds the ``StageResult`` from the producer's finished
``RequestOutput`` and the payload its runner accumulated for the request (CONTRACT 5.1), and
submits the ``NextStageInput`` to the consumer stage (the payload travelling in
``SamplingParams.extra_args``, merged into the consumer's buffer by CONTRACT 4.2).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnigen.runtime.serialization import flatten_payload


class GlueError(ValueError):
    """A producer's output cannot become the next stage's input; names the function and request.

    vllm-omni's producers return ``None`` in these cases and leave the consumer waiting for a
    payload that never comes; omnigen fails the request instead, saying why.
    """

    def __init__(self, glue: str, request_id: str, reason: str) -> None:
        super().__init__(f"{glue}: request {request_id!r}: {reason}")
        self.glue = glue
        self.request_id = request_id
        self.reason = reason


PromptBound = Callable[..., "int | None"]
"""``(producer_tokens, first_payload, producer_hf_config) -> the consumer's longest prompt``;
declared with ``reads_producer_prompt``, also ``producer_prompt`` (the producer's prompt ids, or
None where they are not known), and then it may answer None (no bound for that request)."""


def bounds_next_prompt(
    bound: PromptBound, *, min_producer_tokens: int = 1, reads_producer_prompt: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare how long the prompt a glue function makes can be, for a producer that samples at
    most ``producer_tokens`` tokens, and how many tokens the producer must sample for the prompt
    not to be empty: the server checks a request against every later stage before the first
    stage runs (``omnigen.serving.limits``). ``reads_producer_prompt``: the bound also takes the
    producer's prompt ids (a fourth argument), for a glue whose next prompt is cut from them."""

    def attach(glue: Callable[..., Any]) -> Callable[..., Any]:
        glue.next_prompt_bound = bound  # type: ignore[attr-defined]
        glue.min_producer_tokens = min_producer_tokens  # type: ignore[attr-defined]
        glue.next_prompt_reads_producer_prompt = reads_producer_prompt  # type: ignore[attr-defined]
        return glue

    return attach


def next_prompt_bound(glue: Callable[..., Any]) -> PromptBound | None:
    """The bound a glue function declares, or None."""
    return getattr(glue, "next_prompt_bound", None)


def reads_producer_prompt(glue: Callable[..., Any]) -> bool:
    """Whether the glue's bound takes the producer's prompt ids as a fourth argument."""
    return bool(getattr(glue, "next_prompt_reads_producer_prompt", False))


def min_producer_tokens(glue: Callable[..., Any]) -> int:
    """The fewest tokens the producer must sample for the glue to make a prompt (1 if undeclared)."""
    return int(getattr(glue, "min_producer_tokens", 1))


@dataclass(frozen=True)
class StageResult:
    """One finished request of a producing stage, as the driver sees it."""

    request_id: str
    """The request's id (the caller's id, the same in every stage)."""
    prompt_token_ids: Sequence[int]
    """The producer request's prompt token ids."""
    output_token_ids: Sequence[int]
    """Every token the producer sampled for the request, in order (vLLM's cumulative ids)."""
    payload: Mapping[str, Any] = field(default_factory=dict)
    """What the producer's runner accumulated for the request (CONTRACT 5.1): dotted keys
    (``"codes.audio"``, ``"hidden_states.layer_0"``, ``"hidden"``) as ``omni_step_payloads``
    publishes them, or the nested form (``{"codes": {"audio": ...}}``); both are read."""
    text: str = ""
    """The producer's detokenized output text (empty when it does not detokenize)."""
    finish_reason: str | None = None
    """vLLM's ``CompletionOutput.finish_reason``: ``"stop"``, ``"length"``, ``"abort"``."""
    stop_reason: int | str | None = None
    """vLLM's ``CompletionOutput.stop_reason``: the stop token id, the stop string, or None
    (EOS or not stopped)."""
    input_payload: Mapping[str, Any] = field(default_factory=dict)
    """The payload the producer request itself was given (its buffer at admission, nested):
    for a first stage the caller's ``additional_information`` (speaker, language, ...), for a
    middle stage what the previous glue function sent it."""
    user_prompt: Mapping[str, Any] | None = None
    """The caller's original prompt (``prompt``/``prompt_token_ids``,
    ``additional_information``, ``multi_modal_data``, ...), as given to the first stage."""
    seed: int | None = None
    """The producer request's ``SamplingParams.seed``."""
    hf_config: Any = None
    """The producer stage's HF config (the whole model's, e.g. Qwen3-Omni's with
    ``talker_config``), for the functions that read a model fact from it."""

    def get(self, key: str, default: Any = None) -> Any:
        """A payload value by dotted key, whichever form the payload has (dotted wins)."""
        return flat_payload(self.payload).get(key, default)

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]


@dataclass
class NextStageInput:
    """The consumer stage's request for one producer request."""

    prompt_token_ids: list[int]
    """The consumer's prompt. For stages that read their inputs from the payload this is a
    placeholder of the length the consumer must schedule (its values are never read)."""
    payload: dict[str, Any] = field(default_factory=dict)
    """What the consumer's runner merges into the request's buffer (CONTRACT 4.2): nested
    ``{kind: {qualifier: value}}`` dicts and top-level values, on the CPU."""
    multi_modal_data: dict[str, Any] | None = None
    """The caller's multimodal data, for a consumer that processes it again."""


@dataclass(frozen=True)
class Window:
    """One window of a streaming edge: the producer's frames ``[start, end)`` (counted from its
    first frame), decoded with the ``left_context`` frames before ``start``."""

    index: int
    start: int
    end: int
    left_context: int
    last: bool
    """The producer has finished and this window holds its last frames."""


@dataclass
class WindowInput:
    """What a window function returns: the consumer's request for the window, and how many
    leading samples of the consumer's audio belong to the left context (0 where the consumer
    drops them itself, as Qwen3-TTS's code2wav does from ``meta.left_context_size``)."""

    request: NextStageInput
    drop_samples: int = 0
    keep_samples: int | None = None
    """How many samples after the dropped ones are this window's (the rest are cut); None: all.
    A decoder whose output length follows its batch (Qwen3-Omni's code2wav decodes a shorter row
    on into the batch's zero padding) needs it."""


WindowGlue = Callable[[StageResult, Window], WindowInput]
"""A streaming edge's window function; ``frames_of(source)`` (``counts_frames``) says how many
frames the producer's payload so far holds."""


def counts_frames(
    frames_of: Callable[[StageResult], int],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare how a window function counts the frames in a producer's payload so far."""

    def attach(window: Callable[..., Any]) -> Callable[..., Any]:
        window.frames_of = frames_of  # type: ignore[attr-defined]
        return window

    return attach


def frames_counter(window: Callable[..., Any]) -> Callable[[StageResult], int]:
    """The frame counter a window function declares (``counts_frames``)."""
    counter = getattr(window, "frames_of", None)
    if counter is None:
        name = getattr(window, "__qualname__", repr(window))
        raise TypeError(f"window function {name} declares no frame counter: decorate it with @counts_frames")
    return counter


Glue = Callable[[StageResult], NextStageInput]
"""A glue function (options, where a function has any, are keyword-only with defaults)."""


def flat_payload(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The payload under dotted keys: ``{"codes": {"audio": x}}`` -> ``{"codes.audio": x}``.

    One level deep, as the runner's buffers nest; ``hidden_states.layers`` becomes
    ``hidden_states.layer_<n>`` (the runner's published spelling). A dotted key already present
    wins over the nested spelling of the same value, as vllm-omni's functions look the dotted
    key up first.
    """
    flat = {key: value for key, value in payload.items() if not isinstance(value, Mapping)}
    nested = flatten_payload(
        {key: dict(value) for key, value in payload.items() if isinstance(value, Mapping)}
    )
    for key, value in nested.items():
        if flat.get(key) is None:
            flat[key] = value
    return flat


def owned_cpu(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A CPU copy that shares no storage with the producer's payload, which the driver may
    still hold (or hand to the client) while the consumer writes its own buffer."""
    return tensor.detach().to("cpu", dtype=dtype, copy=True)


def first_tensor(value: Any) -> torch.Tensor | None:
    """A tensor, or the first element of a list of tensors (a latest-wins list payload), as an
    owned CPU copy."""
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        value = value[0]
    return owned_cpu(value) if isinstance(value, torch.Tensor) else None


def prompt_list_entry(user_prompt: Mapping[str, Any] | None, section: str, key: str) -> list[Any] | None:
    """``user_prompt[section][key]`` when it is a non-empty list (how speaker and language
    travel in a prompt's ``additional_information``), else None."""
    if not isinstance(user_prompt, Mapping):
        return None
    info = user_prompt.get(section)
    if not isinstance(info, Mapping):
        return None
    value = info.get(key)
    return value if isinstance(value, list) and value else None


def voice_from_payload(input_payload: Mapping[str, Any], key: str) -> Any:
    """A request's speaker (lower-cased, stripped string) or language (the list) from the
    payload it was given; None when absent. Speakers are compared case-insensitively by the
    talkers, so the producer side normalizes them."""
    value = input_payload.get(key)
    if value is None:
        return None
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values:
        return None
    if key == "speaker":
        return str(values[0]).lower().strip()
    return values


def finished_flag() -> torch.Tensor:
    """``meta.finished`` of a terminal payload: the consumer has the producer's whole output."""
    return torch.tensor(True, dtype=torch.bool)
