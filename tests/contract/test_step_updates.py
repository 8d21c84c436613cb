"""Every hooked row's update, the per-row hooks' as much as a decode batch's, lands in its buffer
(CONTRACT 4.1, 3.3), a GPU-resident key's tensors as owned device copies made together once the
step's last hook has run (one device operation per key), each equal to what its hook returned
and sharing memory with neither that tensor nor another row's copy."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnigen_testing.contract_support import (
    HOOK_VARIANTS,
    DeviceTensor,
    FakeModel,
    Step,
    ids,
    on_device,
    rig,
    rows_of,
)

KINDS = ["decode", "prefill", "decode", "decode", "tail", "decode", "cached_prefill"]
HOST = ("meta", "host_vector")


def resident_key(variant) -> tuple[str, str] | None:
    """A GPU-resident key of the stage that the code predictor does not write."""
    output = ".".join(variant.caps.get("mtp_output_key") or ())
    keys = [k for k in variant.caps["gpu_resident_keys"] if k != output]
    return tuple(keys[0].split(".")) if keys else None


class ResidentUpdates(FakeModel):
    """Each hook's update also carries, per row, a GPU-resident tensor and a host tensor that
    are views of one scratch tensor the model reuses: rows of one call share its memory."""

    scratch = on_device(torch.zeros(64, 3))
    resident: tuple[str, str] | None = None

    def _mark(self, update: dict[str, Any], req_id: str, row: int) -> None:
        tag = float(self.tags[req_id])
        if self.resident is not None:
            view = self.scratch[row : row + 1]
            view.copy_(torch.full((1, 3), tag))
            update.setdefault(self.resident[0], {})[self.resident[1]] = view
        update.setdefault(HOST[0], {})[HOST[1]] = torch.full((2,), tag)

    def preprocess(self, input_ids, input_embeds, **infos):
        ids_out, embeds, update = super().preprocess(input_ids, input_embeds, **infos)
        # Each row's tensor at its own scratch row: the step keeps them all until it is done.
        self._mark(update, infos["request_id"], self.tags[infos["request_id"]])
        return ids_out, embeds, update

    def preprocess_decode_batch(self, input_ids, req_infos):
        out = super().preprocess_decode_batch(input_ids, req_infos)
        for infos, update in zip(req_infos, out[-1], strict=True):
            self._mark(update, infos["request_id"], self.tags[infos["request_id"]])
        return out


@pytest.mark.parametrize("variant", HOOK_VARIANTS, ids=ids(HOOK_VARIANTS))
def test_every_row_update_is_merged_with_owned_device_copies(variant, recorder, ctx, graph):
    graph.for_policy(variant.caps["mtp_graph"] or "unsafe")
    step = Step(rows_of(KINDS))
    r = rig(variant, step, recorder, ctx)
    r.runner.model.__class__ = ResidentUpdates
    r.runner.model.resident = resident = resident_key(variant)
    r.runner._preprocess_rows(step.sched, step.ids(), step.embeds())
    scratch = ResidentUpdates.scratch.untyped_storage().data_ptr()
    copies = []
    for row in step.rows:
        buffer = r.runner.model_intermediate_buffer[row.req_id]
        assert r.runner.requests[row.req_id].additional_information_cpu is buffer, "mirrored (4.1)"
        host = buffer[HOST[0]][HOST[1]]
        assert host.device.type == "cpu" and host.tolist() == [float(row.tag)] * 2
        assert buffer["meta"]["hook"] in ("preprocess", "batch"), (
            "merged one level deep beside the hook's meta"
        )
        if resident is None:
            continue
        copy = buffer[resident[0]][resident[1]]
        assert type(copy) is DeviceTensor and copy.device.type == "cuda", (
            "a GPU-resident key stays on the device"
        )
        assert copy.tolist() == [[float(row.tag)] * 3], f"{row.req_id}: what its hook returned"
        assert copy.untyped_storage().data_ptr() != scratch, (
            f"{row.req_id}: an owned copy, not the hook's tensor"
        )
        copies.append(copy)
    # The copies are made together, but none of them follows another.
    for copy in copies:
        copy.fill_(-1.0)
        assert sum(other.eq(-1.0).all().item() for other in copies) == 1
        copy.fill_(0.0)
