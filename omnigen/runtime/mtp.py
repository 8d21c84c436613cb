"""Talker MTP mechanics (CONTRACT 2.3): seeding, sampling kwargs, write-back.

The policies (output key, GPU residency, per-row generators, graph mode) are
decided when the runner is generated; these helpers receive them as arguments.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Sequence
from typing import Any

import torch

SEED_KEY = "tts_local_seed"
SAMPLING_NAMES = ("do_sample", "temperature", "top_k", "top_p")


def row_generators(
    cache: dict[str, torch.Generator],
    requests: dict[str, Any],
    req_ids: list[str],
    device: torch.device,
) -> list[torch.Generator | None]:
    """One generator per row: None for unseeded rows, the request's kept generator otherwise.

    Only ``sampling_params.extra_args["tts_local_seed"]`` seeds a row: a plain
    ``sampling_params.seed`` belongs to vLLM's own sampler and does not seed the MTP. A seeded
    request gets its generator on first use and keeps it across steps, so its codes continue one
    random stream; requests no longer in ``requests`` are dropped.
    """
    extras = _extra_args(requests, req_ids)
    if extras.count(None) == len(extras):
        # No row carries extra_args, so none is seeded: the common step, in one C call.
        generators: list[torch.Generator | None] = [None] * len(extras)
    else:
        generators = []
        for req_id, extra in zip(req_ids, extras, strict=True):
            seed = extra.get(SEED_KEY) if type(extra) is dict or isinstance(extra, dict) else None
            if seed is None:
                generators.append(None)
                continue
            seed = int(seed)
            generator = cache.get(req_id)
            if generator is None or generator.device != device:
                generator = torch.Generator(device=device)
                generator.manual_seed(seed)
                cache[req_id] = generator
            generators.append(generator)
    if cache:
        for stale in [req_id for req_id in cache if req_id not in requests]:
            del cache[stale]
    return generators


def _extra_args(requests: dict[str, Any], req_ids: list[str]) -> list[Any]:
    """Each row's ``sampling_params.extra_args`` (None where its request has no sampling params).
    Read by plain attribute reads, falling back to ``getattr`` with defaults only when one is
    missing: a ``getattr`` with a default costs about three times a plain read, and this runs
    for every MTP row of every step."""
    try:
        return [requests[req_id].sampling_params.extra_args for req_id in req_ids]
    except AttributeError:
        return [
            getattr(getattr(requests[req_id], "sampling_params", None), "extra_args", None)
            for req_id in req_ids
        ]


def sampling_kwargs(model_config: Any, defaults: dict[str, Any]) -> dict[str, Any]:
    """``do_sample``/``temperature``/``top_k``/``top_p``, always all four.

    The deployment's ``model_config.subtalker_sampling_params`` dict wins key by key, then the
    stage's configured defaults, else None.
    """
    deployment = getattr(model_config, "subtalker_sampling_params", None)
    if not isinstance(deployment, dict):
        deployment = {}
    return {name: deployment.get(name, defaults.get(name)) for name in SAMPLING_NAMES}


def scatter_rows(inputs_embeds: torch.Tensor, offsets: list[int], rows: torch.Tensor) -> None:
    """Write row i of ``rows`` to ``inputs_embeds[offsets[i]]`` in one device operation."""
    n = len(offsets)
    if n == 0:
        return
    # A padded graph replay returns more rows than there are requests.
    rows = rows if rows.shape[0] == n else rows[:n]
    first = offsets[0]
    if offsets == list(range(first, first + n)):
        inputs_embeds[first : first + n].copy_(rows)
        return
    index = torch.tensor(offsets, dtype=torch.long).to(inputs_embeds.device, non_blocking=True)
    inputs_embeds.index_copy_(0, index, rows)


def store_code_rows(
    runner: Any, req_ids: list[str], rows: tuple[torch.Tensor, ...], output_key: tuple[str, str]
) -> None:
    """Put row i's codes under ``output_key`` in request i's buffer (and mirror it).

    ``rows`` are already where they belong (a host copy, or an owned device copy for a
    GPU-resident key), so they are stored as they are: no per-row copy or merge.
    """
    kind, qualifier = output_key
    requests = runner.requests
    existing = runner.model_intermediate_buffer
    for req_id, row in zip(req_ids, rows, strict=True):
        request = requests.get(req_id)
        if request is None:
            continue
        buffer = existing.get(req_id)
        if buffer is None:
            buffer = runner._request_buffer(req_id)
        sub = buffer.get(kind)
        if type(sub) is not dict and not isinstance(sub, dict):
            sub = buffer[kind] = {}
        sub[qualifier] = row
        request.additional_information_cpu = buffer


def leading_rows(runner: Any, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``rows`` rows of the four MTP buffers (2.1), as views kept per row count in
    ``runner._talker_mtp_views``: a step takes them twice (to stage its rows, to call the
    predictor), and a view costs about a microsecond to make. Views of a buffer that was replaced
    since are dropped and made again."""
    buffers = (
        runner.talker_mtp_input_ids.gpu,
        runner.talker_mtp_inputs_embeds.gpu,
        runner.last_talker_hidden.gpu,
        runner.text_step.gpu,
    )
    cache = runner._talker_mtp_views
    entry = cache.get(rows)
    if entry is not None:
        sources, views = entry
        # By identity: a tensor's == compares elements.
        if all(map(operator.is_, sources, buffers)):
            return views
        cache.clear()
    views = (buffers[0][:rows], buffers[1][:rows], buffers[2][:rows], buffers[3][:rows])
    cache[rows] = (buffers, views)
    return views


def owned_code_rows(codes: torch.Tensor, batch: int, *, on_device: bool) -> tuple[torch.Tensor, ...]:
    """The codes of a step's ``batch`` MTP rows (a padded replay returns more) as one copy of the
    predictor's output (on the device for a GPU-resident output key, else on the host), a row view
    per request. A slice or detach only where it changes something: this runs on every step."""
    if codes.shape[0] != batch:
        codes = codes[:batch]
    if codes.requires_grad:
        codes = codes.detach()
    return row_views(codes.clone() if on_device else codes.to("cpu"))


def row_views(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each row of ``tensor`` as a one-row view (``tensor.split(1)``; split by a list of sizes, which
    makes the same views about a quarter faster: one view per request per step)."""
    return tensor.split([1] * tensor.shape[0])


def stack_rows(tensors: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """The step's MTP inputs (one entry per per-row hook row, one per decode batch) as one tensor
    to copy into the ``(rows, width)`` staging rows: in one device operation when every entry is
    a 1-D vector or every entry a ``(rows, width)`` block (a model may hand back either: Qwen3-Omni's
    talker returns 1-D hidden vectors); anything else is reshaped row by row first."""
    first = tensors[0]
    if len(tensors) == 1 and first.dim() in (1, 2) and first.shape[-1] == width:
        # A single row's 1-D vector as it is: copying it into one staging row broadcasts it.
        return first
    # Whether the entries join is asked of torch (mixed shapes raise), not entry by entry: this
    # runs on every step with one entry per MTP row.
    joined = None
    with contextlib.suppress(RuntimeError):
        if first.dim() == 2:
            joined = torch.cat(tensors)
        elif first.dim() == 1:
            joined = torch.stack(tensors)
    if joined is not None and joined.dim() == 2 and joined.shape[1] == width:
        return joined
    return torch.cat([t.reshape(-1, width) for t in tensors])


def flat_ids(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The step's MTP ids (one entry per hook call) as one 1-D tensor."""
    if len(tensors) == 1 and tensors[0].dim() == 1:
        return tensors[0]
    # Entries of one rank join as they are, and the join flattened keeps row order ((1,) and
    # (1, 1) entries alike); whether they join is asked of torch, not entry by entry (this runs on
    # every step with one entry per MTP row). Mixed ranks are flattened one by one first.
    with contextlib.suppress(RuntimeError):
        return torch.cat(tensors).reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])
