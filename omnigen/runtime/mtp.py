"""Talker MTP mechanics (CONTRACT 2.3): the predictor's call, seeding, sampling kwargs, write-back.

The policies (output key, GPU residency, per-row generators, graph mode) are decided when the
runner is generated: the generated runner picks the path and the graph dispatch, and hands them
here as arguments (an ``Execution``) and class constants (``MTP_OUTPUT_KEY``,
``MTP_CODES_ON_DEVICE``, ``MTP_SAMPLING_DEFAULTS``). What no config key changes lives
here once: the batched call, the row-by-row fallback, the write-back.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Sequence
from typing import Any

import torch

from omnigen.runtime import vllm_api

SEED_KEY = "tts_local_seed"
SAMPLING_NAMES = ("do_sample", "temperature", "top_k", "top_p")

# How the predictor runs for a number of rows, as the generated runner's ``_mtp_execution``
# decides it: vLLM's CUDA-graph runtime mode, the batch descriptor of the forward context, and
# the rows handed to the predictor (the captured size a graph replays, else the rows themselves).
Execution = tuple[Any, Any, int]


def call_predictor(runner: Any, execution: Execution, **generator_kwargs: Any) -> tuple[Any, Any]:
    """One call of ``runner.talker_mtp`` on the leading rows of the four MTP buffers, in the
    forward context ``execution`` says, with the stage's sampling kwargs (and a seeded call's
    generators): its ``(embeddings, codes)``."""
    mode, batch_descriptor, padded = execution
    kwargs = sampling_kwargs(runner.vllm_config.model_config, runner.MTP_SAMPLING_DEFAULTS)
    if generator_kwargs:
        kwargs.update(generator_kwargs)
    with vllm_api.set_forward_context(
        None, runner.vllm_config, cudagraph_runtime_mode=mode, batch_descriptor=batch_descriptor
    ):
        return runner.talker_mtp(*leading_rows(runner, padded), **kwargs)


def forward_batched(
    runner: Any,
    req_ids: list[str],
    generators: list[torch.Generator | None],
    inputs_embeds: torch.Tensor,
    start_offsets: list[int] | None,
    execution: Execution,
) -> None:
    """The predictor on all of the step's MTP rows in one call (2.3): its embeddings written to
    each row's place in ``inputs_embeds``, its codes stored under the stage's ``MTP_OUTPUT_KEY`` (an
    owned device copy where ``MTP_CODES_ON_DEVICE``, else a host copy; a row view per request). Seeded rows
    hand their generators over: one as ``generator``, several as ``generators``."""
    batch = len(req_ids)
    if generators.count(None) == batch:
        embeds_out, codes = call_predictor(runner, execution)
    elif batch == 1:
        embeds_out, codes = call_predictor(runner, execution, generator=generators[0])
    else:
        embeds_out, codes = call_predictor(runner, execution, generator=None, generators=generators)
    scatter_rows(inputs_embeds, _offsets(runner, req_ids, start_offsets), embeds_out)
    if codes is None:
        return
    store_code_rows(
        runner,
        req_ids,
        owned_code_rows(codes, batch, on_device=runner.MTP_CODES_ON_DEVICE),
        runner.MTP_OUTPUT_KEY,
    )


def forward_row_by_row(
    runner: Any,
    req_ids: list[str],
    generators: list[torch.Generator | None],
    inputs_embeds: torch.Tensor,
    start_offsets: list[int] | None,
    execution: Execution,
) -> None:
    """One predictor call per row, each from slot 0 (``execution`` is the one-row dispatch), for a
    predictor that takes one generator for the whole call; the four buffers end as they began.

    Only the call is per row: the sampling kwargs and the forward context are set up once, and
    each row's embedding and codes are copied out of the predictor's outputs (a graph replay
    rewrites them) and written back together, as ``forward_batched`` writes them.
    """
    batch = len(req_ids)
    mode, batch_descriptor, padded = execution
    kwargs = sampling_kwargs(runner.vllm_config.model_config, runner.MTP_SAMPLING_DEFAULTS)
    batch_rows = leading_rows(runner, batch)
    staged = [leading.clone() for leading in batch_rows]
    inputs = leading_rows(runner, padded)
    slots = leading_rows(runner, 1)
    embeds_rows = inputs_embeds.new_empty((batch, inputs_embeds.shape[1]))
    codes_rows: torch.Tensor | None = None
    with_codes: list[int] = []
    try:
        with vllm_api.set_forward_context(
            None, runner.vllm_config, cudagraph_runtime_mode=mode, batch_descriptor=batch_descriptor
        ):
            for row, generator in enumerate(generators):
                for slot, saved in zip(slots, staged, strict=True):
                    slot.copy_(saved[row : row + 1])
                # An unseeded row gets no generator argument, as a one-row batch does.
                row_kwargs = kwargs if generator is None else {**kwargs, "generator": generator}
                embeds_out, codes = runner.talker_mtp(*inputs, **row_kwargs)
                embeds_rows[row].copy_(embeds_out[0])
                if codes is None:
                    continue
                if codes_rows is None:
                    codes_rows = codes.new_empty((batch, *codes.shape[1:]))
                codes_rows[row].copy_(codes[0])
                with_codes.append(row)
    finally:
        for leading, saved in zip(batch_rows, staged, strict=True):
            leading.copy_(saved)
    scatter_rows(inputs_embeds, _offsets(runner, req_ids, start_offsets), embeds_rows)
    if codes_rows is None:
        return
    # codes_rows is already the rows' own copy: only a host key moves it.
    rows = row_views(codes_rows if runner.MTP_CODES_ON_DEVICE else codes_rows.to("cpu"))
    if len(with_codes) == batch:
        store_code_rows(runner, req_ids, rows, runner.MTP_OUTPUT_KEY)
    else:
        store_code_rows(
            runner,
            [req_ids[row] for row in with_codes],
            [rows[row] for row in with_codes],
            runner.MTP_OUTPUT_KEY,
        )


def _offsets(runner: Any, req_ids: list[str], start_offsets: list[int] | None) -> list[int]:
    """Each row's place in the step's ``inputs_embeds``: as the caller staged them, else each
    request's first scheduled token (vLLM's ``query_start_loc``)."""
    if start_offsets is not None:
        return start_offsets
    index_of = runner.input_batch.req_id_to_index
    return [int(runner.query_start_loc.cpu[index_of[req_id]]) for req_id in req_ids]


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
