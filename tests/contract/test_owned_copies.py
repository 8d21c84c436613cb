"""The copies a buffer keeps (CONTRACT 4.1): ``buffers.owned_copies`` joins a batch's tensors into
one device copy only when that gives each tensor its own exact copy; ``to_host`` copies nothing
it need not."""

from __future__ import annotations

import pytest
import torch

from omnigen.runtime import buffers


def _check_owned(sources: list[torch.Tensor], copies: list[torch.Tensor]) -> None:
    assert len(copies) == len(sources)
    originals = [s.detach().clone() for s in sources]
    for source, copy, original in zip(sources, copies, originals, strict=True):
        assert copy.dtype == source.dtype and copy.shape == source.shape
        assert torch.equal(copy, original)
        assert not copy.requires_grad
    with torch.no_grad():
        for source in sources:
            source.add_(1)  # the sources change: no copy follows
    for copy, original in zip(copies, originals, strict=True):
        assert torch.equal(copy, original)
    for i, copy in enumerate(copies):  # nor does any copy follow another
        if copy.numel():
            copy.fill_(-7)
            for j, other in enumerate(copies):
                if j != i and other.numel():
                    assert not torch.equal(other, torch.full_like(other, -7))
            copy.copy_(originals[i])


CASES = {
    "rows of one batch": lambda: list(torch.arange(12.0).reshape(6, 2).split(1)),
    "blocks of several rows": lambda: [torch.ones(2, 3), torch.zeros(1, 3), torch.full((3, 3), 2.0)],
    "1-d vectors of several lengths": lambda: [torch.arange(3.0), torch.arange(5.0)],
    "mixed dtypes": lambda: [torch.ones(1, 2), torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.int64)],
    "0-d tensors": lambda: [torch.tensor(1.0), torch.tensor(2.0)],
    "trailing shapes differ": lambda: [torch.ones(1, 2), torch.ones(1, 3)],
    "autograd sources": lambda: [torch.ones(1, 2, requires_grad=True), torch.zeros(1, 2, requires_grad=True)],
    "one tensor": lambda: [torch.ones(2, 2)],
    "an empty one": lambda: [torch.ones(0, 2), torch.ones(1, 2)],
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_each_tensor_gets_its_own_exact_copy(case):
    sources = CASES[case]()
    _check_owned(sources, buffers.owned_copies(sources))


JOINABLE = {
    "rows of one shape (stacked)": lambda: list(torch.arange(8.0).reshape(4, 2).split(1)),
    "0-d tensors (stacked)": lambda: [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)],
    "blocks of several row counts (joined)": lambda: [torch.ones(2, 3), torch.zeros(1, 3), torch.ones(3, 3)],
}


@pytest.mark.parametrize("case", list(JOINABLE))
def test_a_joinable_batch_is_one_copy(case):
    sources = JOINABLE[case]()
    copies = buffers.owned_copies(sources)
    _check_owned(sources, copies)
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1, "one device copy for the batch"
    assert all(
        c.untyped_storage().data_ptr() != s.untyped_storage().data_ptr()
        for c, s in zip(copies, sources, strict=True)
    )


def test_to_host_copies_only_what_needs_it():
    plain = torch.ones(2, 3)
    assert buffers.to_host(plain) is plain, "a contiguous host tensor is kept as it is"
    strided = torch.ones(3, 2).t()
    kept = buffers.to_host(strided)
    assert kept.is_contiguous() and torch.equal(kept, strided)
    grad = torch.ones(2, requires_grad=True)
    assert not buffers.to_host(grad).requires_grad
    assert not buffers.keep_on_device(grad).requires_grad
    assert buffers.keep_on_device(plain) is not plain and torch.equal(buffers.keep_on_device(plain), plain)


def test_a_merge_stores_host_tensors_as_to_host_keeps_them():
    """``merge_updates`` writes ``to_host``'s rule inline for the common value (a contiguous host
    tensor that needs no detach, stored as it is): a strided one or one that requires grad still
    goes through it."""
    plain, strided = torch.ones(2, 3), torch.arange(6.0).reshape(3, 2).t()
    grad = torch.ones(2, requires_grad=True)
    buffer: dict = {}
    request = type("Request", (), {})()
    update = {"hidden": {"plain": plain, "strided": strided, "grad": grad}}
    buffers.merge_updates([buffer], [request], [update], frozenset())
    kept = buffer["hidden"]
    assert kept["plain"] is plain
    assert kept["strided"].is_contiguous() and torch.equal(kept["strided"], strided)
    assert not kept["grad"].requires_grad and torch.equal(kept["grad"], grad.detach())
    assert request.additional_information_cpu is buffer
