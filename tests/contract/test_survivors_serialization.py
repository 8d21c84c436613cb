"""``omnigen/runtime/serialization.py``: behaviour the suite let a mutant change (issue 37, docs/mutation.md).

Written against the module's surviving mutants (``scripts/mutation``); each test fails with
the mutants it names in ``docs/mutation.md`` applied. Covered here: a payload holding a
device tensor serializes from its host copy (4.2); vllm-omni's wire form (7.8) decodes an
entry without a dtype as float32 and an empty tensor with its shape and dtype, rejects an
unreadable tensor entry with a ``ValueError`` that names the entry, and is told apart from a
plain dict that only resembles it; dotted keys split at their first dot, and only
``hidden_states.layer_N`` gathers into ``layers``; ``flatten_payload`` is the inverse of that
split; ``payload_from_text`` rejects a text that is not strict base64.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from omnigen.runtime import serialization
from omnigen_testing.contract_support import DeviceTensor, freeze

from .test_real_model_clauses import WireEntry, WirePayload, _wire


class CudaLikeTensor(DeviceTensor):
    """A ``DeviceTensor`` that, like a real CUDA tensor, cannot be read by numpy in place."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.numpy:
            raise TypeError("can't convert cuda:0 device type tensor to numpy: copy it to the host first")
        return super().__torch_function__(func, types, args, kwargs)


def decode(entries: dict[str, WireEntry]) -> dict:
    """vllm-omni's wire form as it arrives through vLLM's msgpack (a plain map), decoded."""
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(WirePayload(entries=entries)))
    return serialization.deserialize_additional_information(wire)


# -- omnigen's own envelope (4.2) ---------------------------------------------------------------


def test_a_device_tensor_in_a_payload_is_serialized_from_its_host_copy():
    codes = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    payload = {"codes": {"audio": codes.clone().as_subclass(CudaLikeTensor)}}
    back = serialization.deserialize_additional_information(
        serialization.serialize_additional_information(payload)
    )
    assert type(back["codes"]["audio"]) is torch.Tensor and torch.equal(back["codes"]["audio"], codes)


def test_payload_text_with_a_character_outside_base64_is_rejected_not_read_around():
    text = serialization.payload_to_text({"task_type": ["VoiceDesign"]})
    assert serialization.payload_from_text(text) == {"task_type": ["VoiceDesign"]}
    damaged = text[:4] + "!" + text[4:]
    with pytest.raises(ValueError):  # binascii.Error
        serialization.payload_from_text(damaged)


# -- vllm-omni's wire form (7.8) ----------------------------------------------------------------


def test_a_wire_tensor_without_a_dtype_is_float32():
    values = torch.tensor([[1.5, -2.0], [0.25, 8.0]])
    entry = _wire(values)
    entry.tensor_dtype = None
    decoded = decode({"embed.prefix": entry})["embed"]["prefix"]
    assert decoded.dtype == torch.float32 and torch.equal(decoded, values)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bfloat16, torch.float32])
def test_an_empty_wire_tensor_keeps_its_shape_and_dtype(dtype):
    entry = _wire(torch.zeros(0, 3, dtype=dtype))
    assert entry.tensor_data == b""
    decoded = decode({"codes.audio": entry})["codes"]["audio"]
    assert decoded.dtype == dtype and decoded.shape == (0, 3)


@pytest.mark.parametrize(
    ("dtype", "shape", "named"),
    [("float99", [2], "float99"), ("Tensor", [2], "Tensor"), ("float32", None, "None")],
    ids=["unknown-dtype", "torch-name-that-is-no-dtype", "no-shape"],
)
def test_an_unreadable_wire_tensor_is_a_value_error_naming_the_entry(dtype, shape, named):
    entry = WireEntry(tensor_data=bytes(8), tensor_shape=shape, tensor_dtype=dtype)
    with pytest.raises(ValueError) as caught:
        decode({"codes.audio": entry, "task_type": WireEntry(list_data=["x"])})
    assert "'codes.audio'" in str(caught.value) and named in str(caught.value)


@pytest.mark.parametrize(
    "plain",
    [
        {"entries": {"a": {"note": 1}}},
        {"entries": {"a": {}}},
        {"entries": {"a": {"scalar_data": 1}}, "other": 2},
    ],
    ids=["entry-with-foreign-field", "empty-entry", "entries-beside-another-key"],
)
def test_a_dict_unlike_the_wire_form_in_one_respect_stays_a_dict(plain):
    assert serialization.deserialize_additional_information(plain) is plain


@pytest.mark.parametrize("payload", [["codes"], "codes", 3], ids=["list", "str", "int"])
def test_a_payload_of_no_known_form_is_a_type_error(payload):
    with pytest.raises(TypeError, match=type(payload).__name__):
        serialization.deserialize_additional_information(payload)


def test_a_dotted_wire_key_splits_at_its_first_dot_only():
    decoded = decode(
        {
            "codes.audio.left": WireEntry(list_data=[1, 2]),
            "meta.stage.name": WireEntry(scalar_data="talker"),
        }
    )
    assert decoded == {"codes": {"audio.left": [1, 2]}, "meta": {"stage.name": "talker"}}


def test_only_hidden_states_layer_n_gathers_under_layers():
    decoded = decode(
        {
            "hidden_states.layer_2": _wire(torch.ones(2)),
            "hidden_states.last": _wire(torch.zeros(2)),
            "hidden_states.layer_x": WireEntry(scalar_data=1),
            "codes.layer_3": WireEntry(scalar_data=3),
        }
    )
    assert freeze(decoded) == freeze(
        {
            "hidden_states": {"layers": {2: torch.ones(2)}, "last": torch.zeros(2), "layer_x": 1},
            "codes": {"layer_3": 3},
        }
    )


# -- flatten_payload: the dotted keys a step payload is published under -------------------------


def test_flatten_payload_gives_dotted_keys_and_one_key_per_hidden_layer():
    a, b, c, d = (torch.full((2,), float(i)) for i in range(4))
    payload = {
        "hidden_states": {"layers": {0: a, 2: b}, "last": c},
        "codes": {"audio": d, "extra": {"k": 1}},
        "other": {"layers": {1: a}},
        "task_type": ["VoiceDesign"],
    }
    flat = serialization.flatten_payload(payload)
    assert freeze(flat) == freeze(
        {
            "hidden_states.layer_0": a,
            "hidden_states.layer_2": b,
            "hidden_states.last": c,
            "codes.audio": d,
            "codes.extra": {"k": 1},
            "other.layers": {1: a},
            "task_type": ["VoiceDesign"],
        }
    )


def test_flatten_payload_and_the_wire_forms_key_split_are_inverse():
    payload = {
        "hidden_states": {"layers": {0: torch.ones(2), 3: torch.zeros(2)}, "last": torch.full((2,), 2.0)},
        "codes": {"audio": torch.arange(3), "audio.left": torch.arange(2)},
        "task_type": ["VoiceDesign"],
    }
    entries = {
        key: _wire(value) if isinstance(value, torch.Tensor) else WireEntry(list_data=value)
        for key, value in serialization.flatten_payload(payload).items()
    }
    assert freeze(decode(entries)) == freeze(payload)
