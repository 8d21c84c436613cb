"""The stage features that are one config switch each, declared once.

A feature here is a boolean a stage's config sets and the spec and the plan carry unchanged
(``preprocess.hook``, ``outputs.query_start_loc``, ...): what the runner does with it is the
template's, but where it comes from, which contract clauses it brings, how a runner's docstring
and ``omnigen explain`` word it, and whether ``tests/spec_matrix.yaml`` states it are written
here and nowhere else. ``spec._stage_spec`` reads each from its key, ``plan._plan_stage``
carries it, ``plan._contract_clauses`` and ``StagePlan.capabilities`` list it, and
``render`` words it; ``StageSpec`` and ``StagePlan`` name each as a field (checked when
``omnigen.plan`` is imported, so a feature added here and forgotten there fails at once).

What the planner decides rather than carries (the full-payload policy, the MTP, the decode
batch, the buffer refresh, publishing, the V2 target) has its own function in ``plan.py``,
with its reasons recorded as decisions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    """One stage feature that is a config switch."""

    name: str
    """The field of ``StageSpec`` and ``StagePlan`` that holds it."""
    key: str
    """Its config key under ``stages.<stage>`` (dotted; ``omnigen explain --keys`` documents it)."""
    clauses: tuple[str, ...] = ()
    """The contract clauses (``plan.CLAUSES``) a stage with it implements."""
    wording: str | None = None
    """How the runner's docstring names it among the stage's features (None: not named there)."""
    in_matrix: bool = True
    """Whether ``tests/spec_matrix.yaml`` states it under its own name."""
    generation_only: bool = False
    """Read only on a generation stage (an autoregressive stage carries False)."""


FLAGS: tuple[Flag, ...] = (
    Flag("preprocess_hook", "preprocess.hook", ("3.1", "3.3", "3.6"), "per-row preprocess hook"),
    Flag("batch_preprocess_hook", "preprocess.batch_hook", in_matrix=False),
    Flag("attach_request_features", "preprocess.attach_request_features", ("3.8",)),
    Flag(
        "replace_on_marker",
        "buffers.replace_on_marker",
        ("4.3",),
        "snapshot replacement on a producer marker",
    ),
    Flag("multimodal_outputs", "outputs.multimodal", ("1.1-omni-output",)),
    Flag("decode_step_metadata", "outputs.decode_step_metadata", ("1.2",), "decode-step metadata hooks"),
    Flag("has_finish_decode_step", "outputs.has_finish_decode_step", in_matrix=False),
    Flag("request_end_payload", "outputs.request_end_payload", wording="request-end payload"),
    Flag(
        "make_omni_output",
        "outputs.make_omni_output",
        ("7.2-make-omni-output",),
        "output assembly by make_omni_output",
    ),
    Flag("payload_hidden", "outputs.payload_hidden"),
    Flag("request_token_spans", "outputs.request_token_spans"),
    Flag("query_start_loc", "outputs.query_start_loc", ("7.7-query-start-loc",)),
    Flag("set_batch_req_ids", "outputs.set_batch_req_ids", ("7.7-batch-req-ids",)),
    Flag("logits_sampling_metadata", "outputs.logits_sampling_metadata", ("7.7-logits-metadata",)),
    Flag("mrope", "positions.mrope", ("3.7",)),
    Flag("mrope_fallback", "positions.mrope_fallback", ("7.6",), "text-only M-RoPE positions"),
    Flag("on_requests_finished", "on_requests_finished", ("7.3-finished",)),
    # spec_matrix.yaml states these two together, as the generation step's extra kwargs.
    Flag("seq_token_counts", "generation.seq_token_counts", in_matrix=False, generation_only=True),
    Flag("request_ids", "generation.request_ids", in_matrix=False, generation_only=True),
)


def read_flags(stage_conf: object, *, is_generation: bool) -> dict[str, bool]:
    """Each flag's value in a stage's (schema-checked) config, by field name."""
    values = {}
    for flag in FLAGS:
        if flag.generation_only and not is_generation:
            values[flag.name] = False
            continue
        node = stage_conf
        for part in flag.key.split("."):
            node = getattr(node, part)
        values[flag.name] = bool(node)
    return values
