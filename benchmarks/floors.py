"""``benchmarks/host_cost.py floors``: the least a CPython runner can spend per request on what the
contract requires, against each batched target of issue 12 (host cost of a decode step).

Measures: the tightest loop for each clause's per-request work, timed (thread CPU time, the least
  of ``--repeats``), and omnigen's own code for the same work.
Baseline: vllm-omni 0.30's runner in the same run: a target's budget is its ratio times that time.
Takes: about 2-3 minutes for the four batched cells at B = 256 with ``--repeats 1 --steps 2``
  (what scripts/test runs), several times that with the default 5 repeats and 8 steps.
Writes: three tables to stdout (the verdicts, each floor, omnigen's code for the same work); with
  ``--json PATH`` a row a cell and batch size to a data file.

    .venv/bin/python benchmarks/host_cost.py floors                 # B = 256, every cell with a batched target
    .venv/bin/python benchmarks/host_cost.py floors --batch 128 --cells plain
    .venv/bin/python benchmarks/host_cost.py floors --repeats 1 --steps 2   # the CI run (scripts/test)

A floor is the tightest loop that does one clause's per-request work for the B requests of a
steady-state decode step of a cell, on the benchmark's own objects (the generated runner's
buffers and requests after the step, the trivial hooks' results): no function call, no
generality and no check the clause does not ask for, each in the cheapest form measured (a
dict's keys then a look-up, not ``.items()``; a ``stack`` then ``unbind``, not a ``cat`` split by
sizes): a runner that beats a floor shows the floor was not one. What a runner that keeps the
contract's data pays per request, however it is written, is at least the sum of its cell's
floors: a dict per request that updates merge into one level deep and that mirrors as
``additional_information_cpu`` (4.1), a tensor per request for each stored value (its codes row,
2.3; an owned copy of a GPU-resident update, 4.1 as vllm-omni keeps it), four runner keys per
request (3.1), every buffer put back when a step fails (issue 9).

A target's budget is the target ratio times vllm-omni's µs per request, measured in the same run
(``host_overhead.measure``, hooks excluded). The whole step's floor does every clause a cell
pays in as few passes over the rows as its step allows (a runner would not loop once per
clause). Where the lower of the two, the sum of the clauses' floors and the whole step's, is more
than the budget, the target cannot be met without changing the contract. Floors are the least of
``--repeats`` timings (a bound, not a typical figure), on this thread's CPU time as the
benchmark measures, the model's hooks returning at once (a hook's own time is not a runner's),
and they leave work out rather than add any (the journal's does not look at the mirrors, no
floor counts the step's fixed costs or the GC): an "out of reach" holds, a "within reach" is
optimistic: timed alone, a floor runs in caches its own loop keeps warm. (Timed as a lane taking
turns with the runners a step at a time, as ``host_cost.py wall --cold-caches`` runs them, a floor's
Python loops over cold buffers came out slower than omnigen's C-level passes: 6.1 µs a request
against 4.3-5.3 for qwen3_tts at B = 256, so a floor timed that way bounds nothing.) The same
bound against ``MARGINAL_TARGET`` answers the marginal-cost target.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import timeit
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from benchmarks import host_overhead
from benchmarks.host_overhead import CELLS
from omnigen.runtime import buffers, mtp, phases
from omnigen_testing.oracle import harness

TARGETS = {"tts_mtp": 0.12, "tts_mtp_seeded": 0.12, "plain": 0.2, "omni_talker": 0.35}
"""Issue 12's ratio targets at B = 256 for the batched cells (omnigen / vllm-omni)."""
MARGINAL_TARGET = 1.5
"""µs per added request in the batched shapes."""
INTEGER_DTYPES = frozenset({torch.int32, torch.int64})
FLOATING_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""The dtypes a floor's checks accept: looked up by ``t.dtype in``, the cheapest dtype check
(``t.is_floating_point()`` is a method call, 0.3k instructions more)."""


@dataclass
class Step:
    """One steady-state decode step of a cell, as the runner holds it after the step."""

    cell: str
    req_ids: list[str]
    buffers: dict[str, dict[str, Any]]
    requests: dict[str, Any]
    prompt_lens: Any
    computed: Any
    gpu_keys: frozenset[tuple[str, str]]
    ids: torch.Tensor
    embeds: torch.Tensor
    updates: list[dict[str, Any]]
    """Each row's update without its MTP inputs (what is merged)."""
    row_results: list[tuple[Any, Any, dict[str, Any]]]
    """Per-row hooks: each row's ``(ids, embeddings, update)`` as the hook returned it."""
    codes: torch.Tensor | None
    width: int
    generators: dict[str, Any]
    """The runner's kept MTP generators (2.3)."""
    model: Any
    """The trivial-hooks model."""
    recorder: host_overhead.HookRecorder
    """Records the model's hook calls (``instructions.py`` asks whether a floor calls the model, to
    count its hook calls apart)."""
    runner: Any
    """The generated runner whose step this is (for omnigen's own code on the same work)."""


def steady_step(cell_key: str, batch: int) -> Step:
    """The cell's runner after a prefill and two decode steps of ``batch`` requests."""
    cell = CELLS[cell_key]
    host_overhead._room(batch, False)
    policy, ours, _, extra = host_overhead._classes(cell)
    scen, plan = host_overhead.scenario(batch, 3, mixed=False, seeded_share=cell.seeded_share)
    with harness.harness_patches(extra):
        prep = host_overhead._prepare(ours, policy, extra, scen, plan)
        host_overhead._drive(prep)
    runner = prep.runner
    model = runner.model
    req_ids = list(runner.input_batch.req_ids)
    n = len(req_ids)
    ids = runner.input_ids.gpu[:n]
    embeds = runner.inputs_embeds.gpu[:n]
    row_results = []
    if policy.flags.decode_batching == "none":
        for row, req_id in enumerate(req_ids):
            infos = runner.model_intermediate_buffer[req_id]
            row_results.append(model.preprocess(ids[row : row + 1], embeds[row : row + 1], **infos))
    updates = (
        [{k: v for k, v in update.items() if k != "mtp_inputs"} for _, _, update in row_results]
        if row_results
        else model._updates(n)
    )
    codes = model._codes[:n] if policy.flags.mtp else None
    return Step(
        cell=cell_key,
        req_ids=req_ids,
        buffers=runner.model_intermediate_buffer,
        requests=runner.requests,
        prompt_lens=runner.input_batch.num_prompt_tokens[:n],
        computed=runner.input_batch.num_computed_tokens_cpu[:n],
        gpu_keys=runner.GPU_RESIDENT_KEYS,
        ids=ids,
        embeds=embeds,
        updates=updates,
        row_results=row_results,
        codes=codes,
        width=int(embeds.shape[1]),
        generators=getattr(runner, "_talker_mtp_generators", {}),
        model=model,
        recorder=host_overhead.HookRecorder(model, runner),
        runner=runner,
    )


# -- The floors: each does one clause's work for every row of the step, once. ----------------


def runner_keys(step: Step) -> None:
    """3.1: each row's runner keys read from vLLM's input batch and stored in its buffer."""
    get = step.buffers.get
    prompt_lens = step.prompt_lens.tolist()
    computed = step.computed.tolist()
    for req_id, prompt_len, done in zip(step.req_ids, prompt_lens, computed, strict=True):
        buffer = get(req_id)
        buffer["request_id"] = req_id
        buffer["_omni_prompt_len"] = prompt_len
        buffer["_omni_num_computed_tokens"] = done
        buffer["_omni_is_prefill"] = done < prompt_len


def journal(step: Step) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Issue 9: a copy of each row's buffer and of each dict in it, to put back if the step fails
    (a hook may write into any of them; the mirrors are not even looked at)."""
    get = step.buffers.get
    saved = []
    for req_id in step.req_ids:
        buffer = get(req_id)
        saved.append((buffer, buffer.copy()))
        for value in buffer.values():
            if type(value) is dict:
                saved.append((value, value.copy()))
    return saved


def merges(step: Step) -> None:
    """4.1: each row's update merged one level deep, a host tensor kept as it is, a GPU-resident
    one left for ``owned_copies``; the buffer mirrored."""
    get = step.buffers.get
    requests = step.requests
    gpu_keys = step.gpu_keys
    for req_id, update in zip(step.req_ids, step.updates, strict=True):
        buffer = get(req_id)
        for key in update:
            value = update[key]
            if type(value) is not dict:
                buffer[key] = value
                continue
            sub = buffer.get(key)
            if sub is None:
                sub = buffer[key] = {}
            for qualifier in value:
                item = value[qualifier]
                if (key, qualifier) in gpu_keys:
                    continue
                sub[qualifier] = item if item.is_cpu else item.cpu()
        requests[req_id].additional_information_cpu = buffer


def owned_copies_batched(step: Step) -> None:
    """4.1, GPU-resident keys: one copy of every row's tensor, a view per row stored in its buffer
    (the runner copies them once the step's hooks have all run, per-row hooks' too). The step's
    rows are of one shape: stacked and unbound, the cheapest per row (no sizes to read)."""
    get = step.buffers.get
    for key, qualifier in step.gpu_keys:
        subs, tensors = [], []
        for req_id, update in zip(step.req_ids, step.updates, strict=True):
            value = update.get(key)
            if value is not None and qualifier in value:
                subs.append(get(req_id)[key])
                tensors.append(value[qualifier])
        if not tensors:
            continue
        for sub, copy in zip(subs, torch.stack(tensors).unbind(), strict=True):
            sub[qualifier] = copy


def code_rows(step: Step) -> None:
    """2.3: the predictor's codes copied once, a one-row view per request stored in its buffer."""
    get = step.buffers.get
    rows = step.codes.clone().split([1] * len(step.req_ids))
    for req_id, row in zip(step.req_ids, rows, strict=True):
        get(req_id)["codes"]["audio"] = row


def generators(step: Step) -> list[Any]:
    """2.3: each seeded row's kept generator looked up by its ``tts_local_seed`` (None: unseeded)."""
    requests = step.requests
    kept = step.generators
    found = []
    for req_id in step.req_ids:
        extra = requests[req_id].sampling_params.extra_args
        seed = extra.get("tts_local_seed") if extra else None
        found.append(None if seed is None else kept.get(req_id))
    return found


def _row_views(tensor: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """The tensor's rows by one split; inside inference mode (the step's), of an inference tensor
    on the same memory: a view of one carries no autograd view record (3k instructions a row
    less), where vLLM's persistent buffers, made outside inference mode, are ordinary tensors."""
    if torch.is_inference_mode_enabled() and not tensor.is_inference():
        tensor = tensor.new_empty(0).set_(tensor)
    return tensor.split(sizes)


def row_hook_calls(step: Step) -> None:
    """3.3, per-row hooks: each row's id and embedding slices (one split each) and the hook called
    with them and the row's buffer as keyword arguments; what it returns is dropped (the time
    inside the hook is not counted, as the benchmark does not count it)."""
    get = step.buffers.get
    preprocess = step.model.preprocess
    sizes = [1] * len(step.req_ids)
    for req_id, row_ids, row_embeds in zip(
        step.req_ids, _row_views(step.ids, sizes), _row_views(step.embeds, sizes), strict=True
    ):
        preprocess(input_ids=row_ids, input_embeds=row_embeds, **get(req_id))


def batch_hook_call(step: Step) -> None:
    """3.3, a decode batch: one hook call with the rows' buffers; the per-row results it returns
    (an update dict per row) are dropped (the time inside the hook is not counted)."""
    get = step.buffers.get
    step.model.preprocess_decode_batch(input_ids=step.ids, req_infos=[get(req_id) for req_id in step.req_ids])


def row_checks(step: Step) -> None:
    """3.5 / issue 9, per-row hooks: each result's arity, types, width, dtypes and MTP inputs
    checked before anything is written (the row's shape built once)."""
    width = step.width
    shape = (1, width)
    for out in step.row_results:
        if type(out) is not tuple or len(out) != 3:
            raise ValueError("not an (ids, embeddings, update) triple")
        ids, embeds, update = out
        mtp = update.get("mtp_inputs") if type(update) is dict else None
        # In line, not a call (a call costs about 1.5k instructions a row).
        if not (
            type(mtp) is tuple
            and len(mtp) == 2
            and embeds.shape == shape
            and embeds.dtype in FLOATING_DTYPES
            and ids.numel() == 1
            and ids.dtype in INTEGER_DTYPES
            and mtp[0].numel() == width
            and mtp[1].numel() == width
            and mtp[0].dtype in FLOATING_DTYPES
            and mtp[1].dtype in FLOATING_DTYPES
        ):
            raise ValueError("a row's result does not fit its row")


def _mtp_entries(step: Step) -> tuple[list[torch.Tensor], ...]:
    """Each MTP row's ids, embeddings and hidden pair taken from its result, a list each (as the
    row loop collects them)."""
    ids, embeds, hidden, text = [], [], [], []
    for row_ids, row_embeds, update in step.row_results:
        last_hidden, text_step = update["mtp_inputs"]
        ids.append(row_ids)
        embeds.append(row_embeds)
        hidden.append(last_hidden)
        text.append(text_step)
    return ids, embeds, hidden, text


def mtp_gather(step: Step) -> tuple[torch.Tensor, ...]:
    """3.4, per-row hooks: the MTP rows' ids, embeddings and hidden pairs collected from their
    results and joined, one tensor each, to stage in the MTP buffers."""
    ids, embeds, hidden, text = _mtp_entries(step)
    return torch.cat(ids), torch.cat(embeds), torch.stack(hidden), torch.stack(text)


FLOORS: dict[str, tuple[str, Callable[[Step], Any]]] = {
    "runner_keys": ("3.1", runner_keys),
    "journal": ("issue 9", journal),
    "merges": ("4.1", merges),
    "owned_copies": ("4.1 gpu_resident", owned_copies_batched),
    "code_rows": ("2.3", code_rows),
    "generators": ("2.3 seeds", generators),
    "hook_calls": ("3.3 a batch", batch_hook_call),
    "row_hook_calls": ("3.3 per row", row_hook_calls),
    "row_checks": ("3.5", row_checks),
    "mtp_gather": ("3.4", mtp_gather),
}
CELL_FLOORS = {
    "tts_mtp": ("runner_keys", "hook_calls", "journal", "merges", "owned_copies", "code_rows"),
    "tts_mtp_seeded": (
        "runner_keys",
        "hook_calls",
        "journal",
        "merges",
        "owned_copies",
        "code_rows",
        "generators",
    ),
    "plain": ("runner_keys", "hook_calls", "journal", "merges"),
    "omni_talker": (
        "runner_keys",
        "row_hook_calls",
        "row_checks",
        "journal",
        "merges",
        "owned_copies",
        "mtp_gather",
        "code_rows",
    ),
}
"""What each cell's step must do per request (its configuration: decode batching, MTP, seeds)."""


# -- The whole step's floor: every clause a cell pays, in as few passes as the step allows. --
# The separate floors each loop over the rows; a runner would do a row's work together. A batch
# takes two passes (the journal and the runner keys before the batch hook, which sees them; the
# merges and copies after it); per-row hooks one, and the codes a second after the predictor.
# The loops repeat the separate floors' bodies inline on purpose: a floor makes no call per row.


def _owned_views(step: Step) -> dict[tuple[str, str], tuple[torch.Tensor, ...]]:
    """Each GPU-resident key's tensors of the step's updates copied in one ``stack``, a view per row."""
    n = len(step.req_ids)
    owned = {}
    for key, qualifier in step.gpu_keys:
        tensors = [u[key][qualifier] for u in step.updates if qualifier in u.get(key, ())]
        if not tensors:
            continue
        if len(tensors) != n:
            # The copies are stored by row: a key on some rows only would go unstored.
            raise ValueError(f"{key}.{qualifier} is in {len(tensors)} of the step's {n} updates")
        owned[key, qualifier] = torch.stack(tensors).unbind()
    return owned


def whole_step_batched(step: Step) -> None:
    """A decode batch's per-request work (tts, plain) in two passes over the rows."""
    get = step.buffers.get
    requests = step.requests
    gpu_keys = step.gpu_keys
    paid = CELL_FLOORS[step.cell]
    n = len(step.req_ids)
    saved = []
    row_buffers = []
    prompt_lens = step.prompt_lens.tolist()
    computed = step.computed.tolist()
    for req_id, prompt_len, done in zip(step.req_ids, prompt_lens, computed, strict=True):
        buffer = get(req_id)
        saved.append((buffer, buffer.copy()))
        for value in buffer.values():
            if type(value) is dict:
                saved.append((value, value.copy()))
        buffer["request_id"] = req_id
        buffer["_omni_prompt_len"] = prompt_len
        buffer["_omni_num_computed_tokens"] = done
        buffer["_omni_is_prefill"] = done < prompt_len
        row_buffers.append(buffer)
    step.model.preprocess_decode_batch(input_ids=step.ids, req_infos=row_buffers)
    owned = _owned_views(step) if "owned_copies" in paid else {}
    codes = step.codes.clone().split([1] * n) if "code_rows" in paid else None
    seeded = "generators" in paid
    for row, (req_id, buffer, update) in enumerate(zip(step.req_ids, row_buffers, step.updates, strict=True)):
        for key in update:
            value = update[key]
            sub = buffer.get(key)
            if sub is None:
                sub = buffer[key] = {}
            for qualifier in value:
                item = value[qualifier]
                copies = owned.get((key, qualifier))
                if copies is not None:
                    sub[qualifier] = copies[row]
                elif (key, qualifier) not in gpu_keys:
                    sub[qualifier] = item if item.is_cpu else item.cpu()
        if codes is not None:
            buffer["codes"]["audio"] = codes[row]
        request = requests[req_id]
        if seeded:
            extra = request.sampling_params.extra_args
            if extra and extra.get("tts_local_seed") is not None:
                step.generators.get(req_id)
        request.additional_information_cpu = buffer


def whole_step_per_row(step: Step) -> None:
    """Per-row hooks with MTP (the talker): one pass for the hooks, a second for the owned copies
    and the codes."""
    get = step.buffers.get
    requests = step.requests
    gpu_keys = step.gpu_keys
    width = step.width
    shape = (1, width)
    preprocess = step.model.preprocess
    n = len(step.req_ids)
    sizes = [1] * n
    prompt_lens = step.prompt_lens.tolist()
    computed = step.computed.tolist()
    saved = []
    ids, embeds, hidden, text = [], [], [], []
    rows = zip(
        step.req_ids,
        prompt_lens,
        computed,
        _row_views(step.ids, sizes),
        _row_views(step.embeds, sizes),
        step.row_results,
        step.updates,
        strict=True,
    )
    for req_id, prompt_len, done, row_ids, row_embeds, out, update in rows:
        buffer = get(req_id)
        saved.append((buffer, buffer.copy()))
        for value in buffer.values():
            if type(value) is dict:
                saved.append((value, value.copy()))
        buffer["request_id"] = req_id
        buffer["_omni_prompt_len"] = prompt_len
        buffer["_omni_num_computed_tokens"] = done
        buffer["_omni_is_prefill"] = done < prompt_len
        preprocess(input_ids=row_ids, input_embeds=row_embeds, **buffer)
        # ``out`` stands for what the call returned (the call's own result is dropped, as the
        # hook-call floor drops it; the step's kept results are what is checked and merged).
        out_ids, out_embeds, out_update = out
        mtp = out_update.get("mtp_inputs")
        if not (
            type(mtp) is tuple
            and len(mtp) == 2
            and out_embeds.shape == shape
            and out_embeds.dtype in FLOATING_DTYPES
            and out_ids.numel() == 1
            and out_ids.dtype in INTEGER_DTYPES
            and mtp[0].numel() == width
            and mtp[1].numel() == width
            and mtp[0].dtype in FLOATING_DTYPES
            and mtp[1].dtype in FLOATING_DTYPES
        ):
            raise ValueError("a row's result does not fit its row")
        ids.append(out_ids)
        embeds.append(out_embeds)
        hidden.append(mtp[0])
        text.append(mtp[1])
        for key in update:
            value = update[key]
            sub = buffer.get(key)
            if sub is None:
                sub = buffer[key] = {}
            for qualifier in value:
                item = value[qualifier]
                if (key, qualifier) not in gpu_keys:
                    sub[qualifier] = item if item.is_cpu else item.cpu()
        requests[req_id].additional_information_cpu = buffer
    torch.cat(ids), torch.cat(embeds), torch.stack(hidden), torch.stack(text)
    # The GPU-resident updates' copies once every hook has run, then the codes.
    owned = _owned_views(step)
    codes = step.codes.clone().split(sizes)
    for row, req_id in enumerate(step.req_ids):
        buffer = get(req_id)
        for (key, qualifier), copies in owned.items():
            buffer[key][qualifier] = copies[row]
        buffer["codes"]["audio"] = codes[row]


def whole_step(step: Step) -> None:
    """Every clause ``step.cell`` pays, in as few passes as its step allows."""
    if "row_hook_calls" in CELL_FLOORS[step.cell]:
        whole_step_per_row(step)
    else:
        whole_step_batched(step)


# -- omnigen's own code for the same work, timed the same way: where it spends more than a floor. --


def omnigen_runner_keys(step: Step) -> None:
    runner = step.runner
    scheduled = dict.fromkeys(step.req_ids, 1)
    rows = phases.read_row_phases(runner.input_batch, runner.query_start_loc, scheduled)
    phases.stamp_rows(runner, rows)


def omnigen_journal(step: Step) -> None:
    phases.StepJournal(step.runner, step.req_ids, step.ids, step.embeds)


def omnigen_merges(step: Step) -> None:
    """The merges as the generated runner makes them, per-row hooks' and a decode batch's alike:
    one loop over the step's rows once its hooks have run, then the owned copies."""
    row_buffers = [step.buffers[req_id] for req_id in step.req_ids]
    requests = [step.requests[req_id] for req_id in step.req_ids]
    deferred: buffers.DeferredCopies = {}
    buffers.merge_updates(row_buffers, requests, step.updates, step.runner.GPU_RESIDENT_KEYS, deferred)
    buffers.store_owned_copies(deferred)


def omnigen_code_rows(step: Step) -> None:
    runner = step.runner
    on_device = runner.MTP_OUTPUT_KEY in runner.GPU_RESIDENT_KEYS
    rows = mtp.owned_code_rows(step.codes, len(step.req_ids), on_device=on_device)
    mtp.store_code_rows(runner, step.req_ids, rows, runner.MTP_OUTPUT_KEY)


def omnigen_generators(step: Step) -> None:
    runner = step.runner
    mtp.row_generators(runner._talker_mtp_generators, runner.requests, step.req_ids, step.ids.device)


def omnigen_mtp_gather(step: Step) -> None:
    mtp_width = step.runner.last_talker_hidden.gpu.shape[1]
    ids, embeds, hidden, text = _mtp_entries(step)
    mtp.flat_ids(ids)
    mtp.stack_rows(embeds, step.width)
    mtp.stack_rows(hidden, mtp_width)
    mtp.stack_rows(text, mtp_width)


OMNIGEN_CODE: dict[str, tuple[tuple[str, ...], Callable[[Step], Any]]] = {
    "read_row_phases + stamps (more: each row's offsets and the step's checks' facts)": (
        ("runner_keys",),
        omnigen_runner_keys,
    ),
    "StepJournal (more: each row's buffer object, its mirror, the step's inputs)": (
        ("journal",),
        omnigen_journal,
    ),
    "merges with their owned copies": (("merges", "owned_copies"), omnigen_merges),
    "owned_code_rows + store_code_rows": (("code_rows",), omnigen_code_rows),
    "row_generators (every row: unseeded ones too)": (("generators",), omnigen_generators),
    "flat_ids + stack_rows": (("mtp_gather",), omnigen_mtp_gather),
}
"""omnigen's code for the work of some floors (``label -> (those floors, the code)``). A talker-MTP
row's checks (the ``row_checks`` floor's work) are written into the generated row loop, so they
are counted with the whole runner, not alone."""


def omnigen_code_for(cell: str) -> dict[str, tuple[tuple[str, ...], Callable[[Step], Any]]]:
    """The entries of ``OMNIGEN_CODE`` for the work of ``cell``'s floors, each with the floors it pays."""
    paid = CELL_FLOORS[cell]
    found = {}
    for label, (names, code) in OMNIGEN_CODE.items():
        names = tuple(name for name in names if name in paid)
        if names:
            found[label] = (names, code)
    return found


def us_per_request(fn: Callable[[Step], Any], step: Step, number: int = 20) -> float:
    """µs per request of one timing of ``number`` calls of ``fn`` (a floor, or omnigen's code for
    the same work), the model's hooks and predictor standing in as functions that return at once
    (``_returning_at_once``): a floor drops what a hook returns, so the call's own cost (its
    arguments, a buffer as keywords) is timed and the time inside the hook is not, with nothing
    subtracted. (Timing the trivial hooks and subtracting their replay, 1-2 µs a request against
    a batch call's 0.04, let the replay's noise make that floor negative.)"""
    with _returning_at_once(step.model):
        gc.collect()
        gc.freeze()
        try:
            with host_overhead.step_mode():
                fn(step)
                seconds = timeit.Timer(lambda: fn(step), timer=host_overhead._clock).timeit(number)
        finally:
            gc.unfreeze()
    return seconds / number / len(step.req_ids) * 1e6


@contextlib.contextmanager
def _returning_at_once(model: Any) -> Iterator[None]:
    """The model's hooks (``host_overhead.HOOKS``) and code predictor replaced by a function that
    takes any arguments and returns None, then put back (as ``HookRecorder`` puts back its
    wrappers)."""
    names = [name for name in (*host_overhead.HOOKS, "talker_mtp") if callable(getattr(model, name, None))]
    saved = [(model, name, model.__dict__.get(name, host_overhead._ABSENT)) for name in names]
    for name in names:
        setattr(model, name, _return_at_once)
    try:
        yield
    finally:
        host_overhead.HookRecorder.uninstall(saved)


def _return_at_once(*args: Any, **kwargs: Any) -> None:
    return None


def floors_at(cells: list[str], batch: int, repeats: int, steps: int) -> list[dict[str, Any]]:
    """Each cell's floors, vllm-omni's and omnigen's µs per request and its budget, at ``batch``.

    In every repeat the floors are timed and then both runners measured, so the floors and the
    budget see the same state of a shared machine; a floor is its least timing (a bound), the
    runners' figures are medians (as ``host_overhead`` reports them)."""
    results = []
    for key in cells:
        step = steady_step(key, batch)
        timings: dict[str, list[float]] = {name: [] for name in CELL_FLOORS[key]}
        code = omnigen_code_for(key)
        code_timings: dict[str, list[float]] = {label: [] for label in code}
        whole, oracle, omnigen = [], [], []
        for _ in range(repeats):
            for name in timings:
                timings[name].append(us_per_request(FLOORS[name][1], step))
            whole.append(us_per_request(whole_step, step))
            for label, (_, fn) in code.items():
                code_timings[label].append(us_per_request(fn, step))
            measured = host_overhead.measure(CELLS[key], batch, steps, 1)
            oracle.append(measured["oracle_us"])
            omnigen.append(measured["omnigen_us"])
        floors = {name: min(values) for name, values in timings.items()}
        results.append(
            {
                "cell": key,
                "floors": floors,
                "sum": sum(floors.values()),
                "whole_step": min(whole),
                # The lower of the two bounds decides (an "out of reach" must hold for either).
                "floor": min(sum(floors.values()), min(whole)),
                "omnigen_code": {
                    label: (sum(floors[name] for name in code[label][0]), min(values))
                    for label, values in code_timings.items()
                },
                "oracle_us": statistics.median(oracle),
                "omnigen_us": statistics.median(omnigen),
                "budget": TARGETS[key] * statistics.median(oracle),
            }
        )
    return results


def verdict(floor: float, limit: float) -> str:
    """Whether a cell whose floors add up to ``floor`` µs per request can stay within ``limit``."""
    if floor > limit:
        return f"out of reach: {floor / limit:.2f}x"
    return f"within reach: room {limit - floor:.2f}"


def report(results: list[dict[str, Any]], batch: int, console: Console) -> None:
    summary = Table(
        title=f"Floors against the batched targets, B = {batch}, µs per request", box=box.MARKDOWN
    )
    columns = (
        "cell",
        "target",
        "vllm-omni",
        "budget",
        "sum of floors",
        "whole step",
        "omnigen",
        "ratio target",
        "marginal",
    )
    for column in columns:
        summary.add_column(column, justify="left" if column == "cell" else "right")
    for r in results:
        target = TARGETS[r["cell"]]
        summary.add_row(
            CELLS[r["cell"]].label,
            f"{target:.2f}",
            f"{r['oracle_us']:.2f}",
            f"{r['budget']:.2f}",
            f"{r['sum']:.2f}",
            f"{r['whole_step']:.2f}",
            f"{r['omnigen_us']:.2f}",
            verdict(r["floor"], r["budget"]),
            verdict(r["floor"], MARGINAL_TARGET),
        )
    console.print(summary)
    names = [name for name in FLOORS if any(name in r["floors"] for r in results)]
    detail = Table(title="Each floor, µs per request", box=box.MARKDOWN)
    detail.add_column("floor")
    detail.add_column("clause")
    for r in results:
        detail.add_column(r["cell"], justify="right")
    for name in names:
        detail.add_row(
            name,
            FLOORS[name][0],
            *(f"{r['floors'][name]:.2f}" if name in r["floors"] else "" for r in results),
        )
    console.print(detail)
    labels = [label for label in OMNIGEN_CODE if any(label in r["omnigen_code"] for r in results)]
    code = Table(
        title="omnigen's code for the same work, in isolation: floor / omnigen, µs per request",
        box=box.MARKDOWN,
    )
    code.add_column("omnigen")
    for r in results:
        code.add_column(r["cell"], justify="right")
    for label in labels:
        cells = []
        for r in results:
            pair = r["omnigen_code"].get(label)
            cells.append(f"{pair[0]:.2f} / {pair[1]:.2f}" if pair else "")
        code.add_row(label, *cells)
    console.print(code)
    console.print(
        "A target is out of reach where the lower of a cell's two floors (the sum of its clauses' "
        "floors, the whole step's in as few passes as it allows) is more than its budget (target x "
        f"vllm-omni), and the marginal one where it is more than {MARGINAL_TARGET} µs."
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``host_cost.py floors``'s own switches (``--cells``, ``--batch``, ``--steps``, ``--json`` and
    ``--outside-inference-mode`` are every mode's: ``host_cost.common_arguments``)."""
    parser.set_defaults(cells=list(TARGETS), batch=[256], steps=8)
    parser.add_argument("--repeats", type=int, default=5, help="timings of each floor (the least is kept)")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``host_cost.py floors``: at each ``--batch``, each cell's floors and both runners (rows)."""
    unknown = [cell for cell in args.cells if cell not in TARGETS]
    if unknown:
        raise SystemExit(
            f"host_cost.py floors: no batched target for {', '.join(unknown)}; the cells with one: "
            f"{', '.join(TARGETS)}"
        )
    console = Console(width=200)
    rows = []
    for batch in args.batch:
        results = floors_at(args.cells, batch, args.repeats, args.steps)
        report(results, batch, console)
        rows += [{"batch": batch, **result} for result in results]
    return rows
