"""vLLM's Model Runner V2 on a CPU without Triton: only the Triton kernels are simulated.

vLLM's V2 runner (``vllm.v1.worker.gpu``) moves its per-step bookkeeping into Triton kernels:
staged writes into persistent tensors, the step's token ids and positions, block tables and
slot mappings, the sampler's temperature and Gumbel sampling, and the post-step update of the
request state. Without Triton, vLLM imports them through ``vllm.triton_utils``' placeholder,
whose ``@triton.jit`` returns the Python function as it is, so every launch
(``kernel[grid](...)``) fails with ``TypeError: 'function' object is not subscriptable``.
Everything around the launches (the runner, its Python bookkeeping, the model states, the
attention metadata, the CPU attention itself) is plain Python and torch and runs on a CPU.

:func:`install` replaces each kernel object that vLLM's V2 modules bind at import with a
:class:`SimKernel`: the same launch syntax, ``kernel[grid](*args, **kwargs)``, running a
torch/numpy re-implementation of that kernel's body over the grid, on the same tensors (on a CPU
a kernel's "pointer" arguments are the tensors themselves; where a kernel takes a tensor of
raw addresses, the simulation reads and writes that host memory at those addresses, as the
kernel would). Nothing else of vLLM is replaced: the launchers around the kernels, the runner's
``execute_model``/``sample_tokens``, its ``RequestState``, ``InputBatch``, ``BlockTables`` and
``Sampler`` are vLLM's own code.

Which kernels are simulated is :data:`SIMULATED` (module, kernel name); a V2 step that reaches
any other kernel fails with :class:`KernelNotSimulated` naming it, never silently. The
simulations cover the paths a greedy or seeded-random step of a decoder-only model without
speculative decoding, LoRA, structured outputs, penalties or logprobs takes.

``vllm.config.vllm``'s ``HAS_TRITON`` is the one other thing :func:`allow_v2_without_triton`
sets (vLLM refuses ``VLLM_USE_V2_MODEL_RUNNER=1`` without Triton while building its config);
tests call it only in the process they run V2 in.

For tests and benchmarks only: this makes no device faster, and a GPU run of V2 runs vLLM's
real kernels.
"""

from __future__ import annotations

import ctypes
import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

import torch


class KernelNotSimulated(NotImplementedError):
    """A V2 step reached a Triton kernel this module does not simulate."""


class SimKernel:
    """A Triton kernel object stand-in: ``kernel[grid](*args, **kwargs)`` runs ``body``."""

    def __init__(self, name: str, body: Callable[..., None]) -> None:
        self.name = name
        self.body = body
        self.launches = 0

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)

        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches += 1
            kwargs.pop("num_warps", None)
            kwargs.pop("num_stages", None)
            self.body(tuple(int(g) for g in grid), *args, **kwargs)

        return launch

    def __repr__(self) -> str:
        return f"SimKernel({self.name})"


class _Unsimulated:
    def __init__(self, name: str) -> None:
        self.name = name

    def __getitem__(self, grid: Any) -> Any:
        raise KernelNotSimulated(
            f"Model Runner V2 launched the Triton kernel {self.name}, which omnigen_testing.mrv2_cpu "
            "does not simulate; this V2 path needs a GPU (or a simulation of that kernel)"
        )


# -- host memory behind a raw address ------------------------------------------------------------


def _at(address: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``numel`` elements of host memory at ``address`` (what a kernel's cast of a
    loaded pointer reads and writes)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = (ctypes.c_byte * nbytes).from_address(int(address))
    return torch.frombuffer(raw, dtype=dtype, count=numel)


def _i(t: torch.Tensor, i: int) -> int:
    return int(t.reshape(-1)[i])


# -- vllm.v1.worker.gpu.buffer_utils ---------------------------------------------------------------


def _apply_write(
    grid, output, output_stride, write_indices, write_starts, write_contents, write_cu_lens,
    write_group_ids, BLOCK_SIZE, MULTI_GROUP,
) -> None:  # fmt: skip
    contents = write_contents.reshape(-1)
    for pid in range(grid[0]):
        row = _i(write_indices, pid)
        start = _i(write_starts, pid)
        cu_start = _i(write_cu_lens, pid - 1) if pid > 0 else 0
        cu_end = _i(write_cu_lens, pid)
        values = contents[cu_start:cu_end]
        if MULTI_GROUP:
            group = _i(write_group_ids, pid)
            base = int(output.reshape(-1)[group].item())
            stride = _i(output_stride, group)
            target = _at(base + 4 * (row * stride + start), cu_end - cu_start, torch.int32)
            target.copy_(values.to(torch.int32))
        else:
            flat = output.view(-1) if output.is_contiguous() else None
            if flat is None:
                raise KernelNotSimulated("_apply_write_kernel on a non-contiguous output")
            offset = row * int(output_stride) + start
            flat[offset : offset + (cu_end - cu_start)].copy_(values.to(output.dtype))


# -- vllm.v1.worker.gpu.input_batch ----------------------------------------------------------------


def _prepare_prefill_inputs(
    grid, input_ids, next_prefill_tokens, next_prefill_tokens_stride, num_lookahead, idx_mapping,
    query_start_loc, all_token_ids, all_token_ids_stride, prefill_lens, num_computed_tokens,
    BLOCK_SIZE, LOOKAHEAD_BLOCK,
) -> None:  # fmt: skip
    for batch in range(grid[0]):
        req = _i(idx_mapping, batch)
        prefill_len = _i(prefill_lens, req)
        computed = _i(num_computed_tokens, req)
        if computed >= prefill_len:
            continue
        start, end = _i(query_start_loc, batch), _i(query_start_loc, batch + 1)
        query_len = end - start
        input_ids[start:end] = all_token_ids[req, computed : computed + query_len].to(input_ids.dtype)
        for ahead in range(int(num_lookahead)):
            pos = computed + query_len + ahead
            token = int(all_token_ids[req, pos]) if pos < prefill_len else 0
            next_prefill_tokens[ahead, req] = token


def _prepare_pos_seq_lens(
    grid, pos, seq_lens, idx_mapping, query_start_loc, num_computed_tokens, max_num_reqs, BLOCK_SIZE
) -> None:
    num_reqs = grid[0] - 1
    seq_lens[num_reqs:max_num_reqs] = 0
    for batch in range(num_reqs):
        req = _i(idx_mapping, batch)
        computed = _i(num_computed_tokens, req)
        start, end = _i(query_start_loc, batch), _i(query_start_loc, batch + 1)
        seq_lens[batch] = computed + end - start
        pos[start:end] = torch.arange(computed, computed + end - start, dtype=pos.dtype)


def _combine_sampled_and_draft_tokens(
    grid, input_ids, idx_mapping, last_sampled_tokens, query_start_loc, seq_lens, prefill_len,
    draft_tokens, draft_tokens_stride, cu_num_logits, logits_indices, BLOCK_SIZE,
    NUM_NEW_SAMPLED_TOKENS=1,
) -> None:  # fmt: skip
    for batch in range(grid[0]):
        req = _i(idx_mapping, batch)
        cu_start, cu_end = _i(cu_num_logits, batch), _i(cu_num_logits, batch + 1)
        num_logits = cu_end - cu_start
        num_draft = num_logits - NUM_NEW_SAMPLED_TOKENS
        query_end = _i(query_start_loc, batch + 1)
        logits_start = query_end - num_logits
        logits_indices[cu_start:cu_end] = torch.arange(logits_start, logits_start + num_logits)
        seq_len = _i(seq_lens, batch)
        plen = _i(prefill_len, req)
        if seq_len <= plen:
            continue
        if NUM_NEW_SAMPLED_TOKENS > 0 and seq_len - num_logits >= plen:
            input_ids[logits_start] = last_sampled_tokens.reshape(-1)[req]
        if num_draft > 0:
            input_ids[query_end - num_draft : query_end] = draft_tokens[req, :num_draft]


def _get_num_sampled_and_rejected(
    grid, num_sampled, num_rejected, seq_lens, cu_num_logits, idx_mapping, prefill_len
) -> None:
    for batch in range(grid[0]):
        req = _i(idx_mapping, batch)
        chunked = _i(seq_lens, batch) < _i(prefill_len, req)
        sampled = 0 if chunked else _i(num_sampled, batch)
        num_sampled[batch] = sampled
        logits = _i(cu_num_logits, batch + 1) - _i(cu_num_logits, batch)
        num_rejected[batch] = 0 if chunked else logits - sampled


def _post_update(
    grid, idx_mapping, num_computed_tokens, last_sampled_tokens, output_bin_counts,
    output_bin_counts_stride, sampled_tokens, sampled_tokens_stride, num_sampled, num_rejected,
    query_start_loc, all_token_ids, all_token_ids_stride, total_len,
) -> None:  # fmt: skip
    last = last_sampled_tokens.reshape(-1)
    for batch in range(grid[0]):
        req = _i(idx_mapping, batch)
        if req < 0:
            continue
        length = _i(total_len, req)
        sampled = _i(num_sampled, batch)
        if sampled > 0:
            last[req] = sampled_tokens[batch, sampled - 1]
            total_len[req] = length + sampled
        for i in range(sampled):
            token = int(sampled_tokens[batch, i])
            all_token_ids[req, length + i] = token
            if output_bin_counts is not None:
                output_bin_counts[req, token] += 1
        query_len = 0
        if query_start_loc is not None:
            query_len = _i(query_start_loc, batch + 1) - _i(query_start_loc, batch)
        delta = query_len - _i(num_rejected, batch)
        if delta:
            num_computed_tokens[req] += delta


def _post_update_num_computed_tokens(grid, idx_mapping, num_computed_tokens, query_start_loc) -> None:
    for batch in range(grid[0]):
        req = _i(idx_mapping, batch)
        num_computed_tokens[req] += _i(query_start_loc, batch + 1) - _i(query_start_loc, batch)


def _expand_idx_mapping(
    grid, idx_mapping, expanded_idx_mapping, expanded_local_pos, cu_num_logits, BLOCK_SIZE
) -> None:
    for batch in range(grid[0]):
        start, end = _i(cu_num_logits, batch), _i(cu_num_logits, batch + 1)
        expanded_idx_mapping[start:end] = _i(idx_mapping, batch)
        expanded_local_pos[start:end] = torch.arange(end - start, dtype=expanded_local_pos.dtype)


# -- vllm.v1.worker.gpu.block_table ----------------------------------------------------------------


def _gather_block_tables(
    grid, batch_idx_to_req_idx, src_block_table_ptrs, dst_block_table_ptrs, block_table_strides,
    num_blocks, num_blocks_stride, num_reqs, BLOCK_SIZE,
) -> None:  # fmt: skip
    groups, padded = grid
    for group in range(groups):
        stride = _i(block_table_strides, group)
        src = int(src_block_table_ptrs.reshape(-1)[group].item())
        dst = int(dst_block_table_ptrs.reshape(-1)[group].item())
        for batch in range(padded):
            dst_row = _at(dst + 4 * batch * stride, stride, torch.int32)
            if batch >= int(num_reqs):
                dst_row.zero_()
                continue
            req = _i(batch_idx_to_req_idx, batch)
            count = int(num_blocks.reshape(-1)[group * int(num_blocks_stride) + req])
            dst_row[:count] = _at(src + 4 * req * stride, count, torch.int32)


def _compute_slot_mappings(
    grid, max_num_tokens, idx_mapping, query_start_loc, pos, block_table_ptrs, block_table_strides,
    block_sizes, slot_mapping_enabled, dcp_sharded, slot_mappings, slot_mappings_stride, cp_rank,
    CP_SIZE, CP_INTERLEAVE, PAD_ID, TRITON_BLOCK_SIZE,
) -> None:  # fmt: skip
    if CP_SIZE != 1:
        raise KernelNotSimulated("_compute_slot_mappings_kernel with context parallelism")
    groups, programs = grid
    num_reqs = programs - 1
    for group in range(groups):
        out = slot_mappings[group]
        out[_i(query_start_loc, num_reqs) : int(max_num_tokens)] = PAD_ID
        table = int(block_table_ptrs.reshape(-1)[group].item())
        stride = _i(block_table_strides, group)
        block_size = _i(block_sizes, group)
        enabled = bool(slot_mapping_enabled.reshape(-1)[group])
        for batch in range(num_reqs):
            req = _i(idx_mapping, batch)
            start, end = _i(query_start_loc, batch), _i(query_start_loc, batch + 1)
            for offset in range(start, end):
                if not enabled or req < 0:
                    out[offset] = PAD_ID
                    continue
                position = _i(pos, offset)
                block = int(_at(table + 4 * (req * stride + position // block_size), 1, torch.int32)[0])
                out[offset] = block * block_size + position % block_size


# -- vllm.v1.worker.gpu.sample ---------------------------------------------------------------------


def _temperature(
    grid, logits, logits_stride, expanded_idx_mapping, temperature, vocab_size, BLOCK_SIZE
) -> None:
    for token in range(grid[0]):
        req = _i(expanded_idx_mapping, token)
        temp = float(temperature.reshape(-1)[req])
        if temp == 0.0 or temp == 1.0:
            continue
        logits[token, :vocab_size] = logits[token, :vocab_size] / temp


def _gumbel_noise(seed: int, pos: int, keys: torch.Tensor) -> torch.Tensor:
    """Gumbel noise for the vocabulary entries ``keys`` of the request's stream at ``pos``:
    torch's generator seeded by ``(seed, pos)``, not vLLM's murmur3 hash, so a random V2 step
    here is reproducible with itself, not with a GPU's draw (greedy steps are exact)."""
    generator = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(pos)) % (2**63))
    uniform = torch.rand(int(keys.max()) + 1, generator=generator, dtype=torch.float64)[keys]
    return -torch.log(-torch.log(uniform.clamp_(1e-20, 1.0 - 1e-16)))


def _gumbel_sample(
    grid, local_argmax, local_argmax_stride, local_max, local_max_stride, logits_cache,
    logits_cache_stride_0, logits_cache_stride_1, logits_cache_col, logits_cache_source,
    logits_cache_source_stride, logits, logits_stride, expanded_idx_mapping, seeds, pos, temp,
    vocab_size, BLOCK_SIZE, IS_DRAFTING, APPLY_TEMPERATURE, USE_FP64, PER_TOKEN_COL,
) -> None:  # fmt: skip
    """Per (token, vocabulary block): the block's argmax of the logits (temperature 0) or of the
    logits over the temperature plus Gumbel noise, and its value (``gumbel_noised_argmax``)."""
    if logits_cache is not None:
        raise KernelNotSimulated("_gumbel_sample_kernel with a draft logits cache (speculative decoding)")
    num_tokens, num_blocks = grid
    dtype = torch.float64 if USE_FP64 else torch.float32
    for token in range(num_tokens):
        req = _i(expanded_idx_mapping, token)
        t = float(temp.reshape(-1)[req]) if req >= 0 else 0.0
        for block in range(num_blocks):
            keys = torch.arange(block * BLOCK_SIZE, min((block + 1) * BLOCK_SIZE, vocab_size))
            values = logits[token, keys].to(torch.float32)
            if t != 0.0 and APPLY_TEMPERATURE:
                values = values / t
            values = values.to(dtype)
            if t != 0.0:
                noise_pos = _i(pos, token) + ((1 << 30) if IS_DRAFTING else 0)
                values = values + _gumbel_noise(_i(seeds, req), noise_pos, keys).to(dtype)
            index = int(torch.argmax(values))
            local_argmax[token, block] = block * BLOCK_SIZE + index
            local_max[token, block] = values[index]


# -- installation ----------------------------------------------------------------------------------

SIMULATED: dict[tuple[str, str], Callable[..., None]] = {
    ("vllm.v1.worker.gpu.buffer_utils", "_apply_write_kernel"): _apply_write,
    ("vllm.v1.worker.gpu.input_batch", "_prepare_prefill_inputs_kernel"): _prepare_prefill_inputs,
    ("vllm.v1.worker.gpu.input_batch", "_prepare_pos_seq_lens_kernel"): _prepare_pos_seq_lens,
    (
        "vllm.v1.worker.gpu.input_batch",
        "_combine_sampled_and_draft_tokens_kernel",
    ): _combine_sampled_and_draft_tokens,
    (
        "vllm.v1.worker.gpu.input_batch",
        "_get_num_sampled_and_rejected_kernel",
    ): _get_num_sampled_and_rejected,
    ("vllm.v1.worker.gpu.input_batch", "_post_update_kernel"): _post_update,
    (
        "vllm.v1.worker.gpu.input_batch",
        "_post_update_num_computed_tokens_kernel",
    ): _post_update_num_computed_tokens,
    ("vllm.v1.worker.gpu.input_batch", "_expand_idx_mapping_kernel"): _expand_idx_mapping,
    ("vllm.v1.worker.gpu.block_table", "_gather_block_tables_kernel"): _gather_block_tables,
    ("vllm.v1.worker.gpu.block_table", "_compute_slot_mappings_kernel"): _compute_slot_mappings,
    ("vllm.v1.worker.gpu.sample.gumbel", "_temperature_kernel"): _temperature,
    ("vllm.v1.worker.gpu.sample.gumbel", "_gumbel_sample_kernel"): _gumbel_sample,
}
"""(module, kernel) -> the simulation of that kernel's body."""

_V2_PACKAGE = "vllm.v1.worker.gpu"


def install() -> dict[str, SimKernel]:
    """Replace every Triton kernel the V2 runner's modules bind with its simulation, or with a
    stand-in that fails naming it; idempotent. Returns the simulated kernels by name."""
    import vllm.v1.worker.gpu.model_runner  # noqa: F401  (loads the runner's modules)

    for module_name, _ in SIMULATED:
        importlib.import_module(module_name)
    _complete_placeholder()
    installed: dict[str, SimKernel] = {}

    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(_V2_PACKAGE):
            continue
        for name, value in list(vars(module).items()):
            if not name.endswith("_kernel"):
                continue
            body = SIMULATED.get((module_name, name))
            if body is not None:
                if not isinstance(value, SimKernel):
                    setattr(module, name, SimKernel(f"{module_name}.{name}", body))
                installed[name] = getattr(module, name)
            elif isinstance(value, types.FunctionType):
                setattr(module, name, _Unsimulated(f"{module_name}.{name}"))
    return installed


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _complete_placeholder() -> None:
    """vLLM's Triton placeholder module lacks ``triton.next_power_of_2``, a host-side helper the
    launchers call to size a kernel's block: give it Triton's definition."""
    from vllm.triton_utils import triton

    if not hasattr(triton, "next_power_of_2"):
        triton.next_power_of_2 = _next_power_of_2


def allow_v2_without_triton() -> None:
    """Let vLLM build a config with ``VLLM_USE_V2_MODEL_RUNNER=1`` where Triton is missing (its
    config validation refuses it), for a process whose kernels :func:`install` simulated."""
    import vllm.config.vllm as config_module

    config_module.HAS_TRITON = True


__all__ = ["SIMULATED", "KernelNotSimulated", "SimKernel", "allow_v2_without_triton", "install"]
