"""From an omnigen stage plan to the oracle's run-time ``Policy`` (dummy-model flags).

A generated runner has its stage's policies baked in; the oracle probes the
model for them at run time. ``policy_from_plan`` says, for one plan, which flags
the dummy model must carry so the oracle behaves like that stage. It reads the
plan by attribute name only (``omnigen.plan.StagePlan``), so this module does
not import omnigen.

Plan field -> what the oracle is told:

  preprocess_hook              -> flags.has_preprocess
  refresh_every_step           -> flags.refresh_buffers (the oracle refreshes every stage that
                                  has a hook anyway, gated on hasattr(model, "has_preprocess"))
  batch_preprocess_hook        -> flags.batch_hook (model.preprocess_batch)
  decode_batch                 -> flags.decode_batching ("none" | "mtp" | "plain")
  mtp is not None              -> flags.mtp (model.talker_mtp)
  mtp.graph ("safe"/"unsafe")  -> flags.mtp_graph_safe = True / False (already resolved from "auto")
  mtp.per_row_generators       -> flags.per_row_generators: "always" -> True, "never" -> False,
                                  "eager_only" -> True unless the predictor is wrapped
                                  (graph safe and Policy.cudagraph == "full")
  mtp.output_key               -> flags.mtp_output_key
  gpu_resident_keys (+ the MTP output key when output_key_gpu_resident)
                               -> flags.gpu_resident_keys
  mtp.sampling_defaults        -> Policy.subtalker_sampling_params, unless the test passes a
                                  deployment dict: the oracle has no stage defaults, so the
                                  defaults are handed to both runners as the deployment's dict
  replace_on_marker            -> flags.replace_snapshots (the oracle then replaces on *every*
                                  payload, marker or not: generate the scenario with
                                  ScenarioConfig(replace_marker="always") to compare)
  multimodal_outputs           -> flags.multimodal_outputs
  decode_step_metadata         -> flags.decode_step_metadata
  attach_request_features      -> flags.attach_request_features (class named like MiMo's)
  async_chunk                  -> Policy.async_chunk

What the oracle cannot express raises ``Unexpressible``: a hook stage that does
not refresh its buffers every step; payload sync before the rows that differs
from "refreshes and not async_chunk" (the oracle syncs in _preprocess exactly then).
"""

from __future__ import annotations

from typing import Any

from .dummy_model import ModelFlags
from .harness import Policy


class Unexpressible(ValueError):
    """The plan asks for a behaviour the oracle has no run-time switch for."""


def _value(x: Any) -> Any:
    return getattr(x, "value", x)


def policy_from_plan(
    plan: Any,
    *,
    cudagraph: str = "none",
    subtalker_sampling_params: dict | None = None,
    multimodal_inputs: bool = False,
    forward: bool = False,
) -> Policy:
    """The oracle ``Policy`` that makes the oracle behave like ``plan``'s generated runner."""
    mtp = plan.mtp
    if plan.preprocess_hook and not plan.refresh_every_step:
        raise Unexpressible("the oracle refreshes buffers every step on any stage with a preprocess hook")
    # The oracle's sync sits inside its buffer-refresh block: a stage that neither has a hook
    # nor refreshes never syncs before the rows, whatever async_chunk says.
    oracle_syncs = bool(plan.preprocess_hook or plan.refresh_every_step) and not plan.async_chunk
    if bool(getattr(plan, "sync_payloads_before_rows", oracle_syncs)) != oracle_syncs:
        raise Unexpressible(
            "the oracle syncs local stage payloads before the rows exactly when it refreshes "
            "buffers (hook or refresh_every_step) and not async_chunk"
        )
    gpu_keys = {tuple(k) for k in plan.gpu_resident_keys}
    flags: dict[str, Any] = {
        "has_preprocess": bool(plan.preprocess_hook),
        "refresh_buffers": bool(plan.refresh_every_step),
        "batch_hook": bool(plan.batch_preprocess_hook),
        "decode_batching": _value(plan.decode_batch),
        "mtp": mtp is not None,
        "replace_snapshots": bool(plan.replace_on_marker),
        "multimodal_outputs": bool(plan.multimodal_outputs),
        "decode_step_metadata": bool(plan.decode_step_metadata),
        "attach_request_features": bool(plan.attach_request_features),
        "multimodal_inputs": multimodal_inputs,
        "make_omni_output": bool(plan.make_omni_output),
        "query_start_loc": bool(plan.query_start_loc),
        "set_batch_req_ids": bool(plan.set_batch_req_ids),
    }
    sampling = subtalker_sampling_params
    if mtp is not None:
        safe = _value(mtp.graph) == "safe"
        wrapped = safe and cudagraph == "full"
        per_row = _value(mtp.per_row_generators)
        flags["mtp_graph_safe"] = safe
        flags["per_row_generators"] = per_row == "always" or (per_row == "eager_only" and not wrapped)
        flags["mtp_output_key"] = tuple(mtp.output_key)
        if getattr(mtp, "output_key_gpu_resident", False):
            gpu_keys.add(tuple(mtp.output_key))
        if sampling is None and mtp.sampling_defaults:
            sampling = dict(mtp.sampling_defaults)
    flags["gpu_resident_keys"] = frozenset(gpu_keys)
    return Policy(
        flags=ModelFlags(**flags),
        cudagraph=cudagraph,
        subtalker_sampling_params=sampling,
        async_chunk=bool(plan.async_chunk),
        forward=forward,
        name=f"{plan.model}/{plan.stage}",
    )
