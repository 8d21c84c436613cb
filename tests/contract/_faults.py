"""Bad hook outputs by name: what the fault tests, the runtime corpus and the property test inject.

A fault is ``(hook, name)``; ``apply`` turns a good result of that hook into the bad one (or
raises). ``FaultyModel`` is ``FakeModel`` with one fault armed on the n-th call of one hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from omnigen_testing.contract_support import FakeModel


class HookFailure(RuntimeError):
    """What a raising hook raises."""


def _raise(out: Any) -> Any:
    raise HookFailure("the model failed")


def _embeds(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[tuple], tuple]:
    return lambda out: (out[0], fn(out[1]), *out[2:])


def _ids(fn: Callable[[torch.Tensor], Any]) -> Callable[[tuple], tuple]:
    return lambda out: (fn(out[0]), *out[1:])


def _update(fn: Callable[[Any], Any]) -> Callable[[tuple], tuple]:
    return lambda out: (*out[:2], fn(out[2]))


def _mtp_pair(fn: Callable[[tuple], Any]) -> Callable[[tuple], tuple]:
    def apply(out: tuple) -> tuple:
        update = dict(out[2])
        update["mtp_inputs"] = fn(update["mtp_inputs"])
        return out[0], out[1], update

    return apply


def _drop_mtp(out: tuple) -> tuple:
    update = dict(out[2])
    update.pop("mtp_inputs", None)
    return out[0], out[1], update


def _second_update(value: Any) -> Callable[[tuple], tuple]:
    """The update of the batch's second row (its only one in a batch of one) replaced by ``value``."""

    def apply(out: tuple) -> tuple:
        updates = list(out[-1])
        updates[min(1, len(updates) - 1)] = value
        return (*out[:-1], updates)

    return apply


def _mtp(index: int, fn: Callable[[torch.Tensor], Any]) -> Callable[[tuple], tuple]:
    """``out[index]`` (2: last_hidden, 3: text_step) of a 5-tuple replaced by ``fn`` of it."""

    def apply(out: tuple) -> tuple:
        if len(out) != 5:
            raise AssertionError("an MTP fault on a plain decode batch")
        items = list(out)
        items[index] = fn(items[index])
        return tuple(items)

    return apply


def _wider(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t[..., :1]], dim=-1)


ROW_FAULTS: dict[str, Callable[[tuple], Any]] = {
    "raises": _raise,
    "arity_2": lambda out: out[:2],
    "arity_4": lambda out: (*out, None),
    "not_a_tuple": lambda out: out[1],
    "none": lambda out: None,
    "short_embeds": _embeds(lambda e: e[:-1]),
    "long_embeds": _embeds(lambda e: torch.cat([e, e[:1]])),
    "wide_embeds": _embeds(_wider),
    "narrow_embeds": _embeds(lambda e: e[:, :-1]),
    "int_embeds": _embeds(lambda e: e.to(torch.int64)),
    "flat_embeds": _embeds(lambda e: e.reshape(-1)),
    "embeds_list": _embeds(lambda e: e.tolist()),
    "ids_count": _ids(lambda i: torch.cat([i, i])),
    "float_ids": _ids(lambda i: i.to(torch.float32)),
    "ids_list": _ids(lambda i: i.tolist()),
    "update_type": _update(lambda u: ["not", "a", "dict"]),
    "update_str": _update(lambda u: "meta"),
}
# Faults of a talker-MTP decode row's result (a per-row hook on an MTP stage without decode batching).
ROW_MTP_FAULTS: dict[str, Callable[[tuple], Any]] = {
    "mtp_missing": _drop_mtp,
    "mtp_wide": _mtp_pair(lambda pair: (_wider(pair[0]), pair[1])),
    "mtp_int": _mtp_pair(lambda pair: (pair[0], pair[1].to(torch.int64))),
    "mtp_single": _mtp_pair(lambda pair: pair[0]),
    "mtp_ids_none": _ids(lambda i: None),
}
BATCH_FAULTS: dict[str, Callable[[tuple], Any]] = {
    "raises": _raise,
    "arity_2": lambda out: out[:2],
    "arity_plus_one": lambda out: (*out, None),
    "not_a_tuple": lambda out: out[-1],
    "none": lambda out: None,
    "short_ids": _ids(lambda i: i[:-1]),
    "short_embeds": _embeds(lambda e: e[:-1]),
    "short_updates": lambda out: (*out[:-1], out[-1][:-1]),
    "wide_embeds": _embeds(_wider),
    "narrow_embeds": _embeds(lambda e: e[:, :-1]),
    "int_embeds": _embeds(lambda e: e.to(torch.int32)),
    "flat_embeds": _embeds(lambda e: e.reshape(-1)),
    "float_ids": _ids(lambda i: i.to(torch.float32)),
    "ids_none": _ids(lambda i: None),
    "update_list": _second_update(["not", "a", "dict"]),
    "update_str": _second_update("meta"),
    "updates_dict": lambda out: (*out[:-1], {"meta": {}}),
}
BATCH_MTP_FAULTS: dict[str, Callable[[tuple], Any]] = {
    "hidden_wide": _mtp(2, _wider),
    "hidden_short": _mtp(2, lambda t: t[:-1]),
    "hidden_int": _mtp(2, lambda t: t.to(torch.int64)),
    "hidden_flat": _mtp(2, lambda t: t.reshape(-1)),
    "text_step_none": _mtp(3, lambda t: None),
    "text_step_narrow": _mtp(3, lambda t: t[:, :-1]),
}


def _raise_after_writing(model: FaultyModel, req_ids: list[str], buffers: dict[str, Any]) -> None:
    """A batch hook that writes into every row's buffer (creating missing ones), then fails."""
    for req_id in req_ids:
        buffer = buffers.setdefault(req_id, {})
        buffer.setdefault("meta", {})["batch_hook"] = "half done"
        buffer["scratch"] = torch.zeros(2)
    raise HookFailure("the batch hook failed")


STEP_FAULTS = {"raises_after_writing": _raise_after_writing, "raises": lambda m, r, b: _raise(None)}

FAULTS: dict[str, dict[str, Any]] = {
    "preprocess": {**ROW_FAULTS, **ROW_MTP_FAULTS},
    "preprocess_decode_batch": {**BATCH_FAULTS, **BATCH_MTP_FAULTS},
    "preprocess_batch": STEP_FAULTS,
}


class FaultyModel(FakeModel):
    """``FakeModel`` whose ``fault_hook`` goes wrong as ``fault`` says on its ``fault_call``-th call (0-based)."""

    fault_hook = "preprocess"
    fault = "raises"
    fault_call = 0

    def _armed(self, hook: str) -> bool:
        return hook == self.fault_hook and len(self.recorder.of(hook)) - 1 == self.fault_call

    def preprocess(self, input_ids, input_embeds, **infos):
        out = super().preprocess(input_ids, input_embeds, **infos)
        return FAULTS["preprocess"][self.fault](out) if self._armed("preprocess") else out

    def preprocess_decode_batch(self, input_ids, req_infos):
        out = super().preprocess_decode_batch(input_ids, req_infos)
        return (
            FAULTS["preprocess_decode_batch"][self.fault](out)
            if self._armed("preprocess_decode_batch")
            else out
        )

    def preprocess_batch(self, req_ids, model_intermediate_buffer, device):
        super().preprocess_batch(req_ids, model_intermediate_buffer, device)
        if self._armed("preprocess_batch"):
            FAULTS["preprocess_batch"][self.fault](self, list(req_ids), model_intermediate_buffer)


def arm(model: FakeModel, hook: str, fault: str, call: int = 0) -> FaultyModel:
    """Turn the rig's model into a ``FaultyModel`` with one fault armed."""
    if fault not in FAULTS[hook]:
        raise KeyError(f"no fault {fault!r} for {hook}")
    model.__class__ = FaultyModel
    model.fault_hook, model.fault, model.fault_call = hook, fault, call
    return model  # type: ignore[return-value]


def hook_message(exc: BaseException) -> str:
    """An error's message and its notes (a raising hook's exception carries the runner's note)."""
    return "\n".join([str(exc), *getattr(exc, "__notes__", ())])
