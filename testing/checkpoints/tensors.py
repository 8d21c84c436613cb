"""Seeded tensor values and safetensors files, shared by every tiny checkpoint writer.

Every tensor is drawn from its own ``torch.Generator`` seeded with (seed, crc32(name)), so a
tensor's value depends only on the seed, its name and its shape. Weights and biases ~ N(0, 0.05);
norm weights 1 + N(0, 0.05); codebook usage counts U(0.5, 1.5) (the codebooks divide by them);
``initialized`` flags 1.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

STD = 0.05


def draw(name: str, shape: Iterable[int], seed: int, dtype: Any = None) -> Any:
    """The tensor called ``name``: a function of (seed, name, shape) only."""
    import torch

    shape = tuple(shape)
    generator = torch.Generator().manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "initialized":
        value = torch.ones(shape)
    elif leaf == "cluster_usage":
        value = torch.rand(shape, generator=generator) + 0.5
    elif name.endswith("norm.weight"):
        value = 1.0 + torch.randn(shape, generator=generator) * STD
    else:
        value = torch.randn(shape, generator=generator) * STD
    return value.to(dtype or torch.float32).contiguous()


def write_tensors(path: Path, shapes: Mapping[str, tuple[int, ...]], seed: int, dtype: Any) -> None:
    """``path`` as one safetensors file holding ``draw(name, shape, seed, dtype)`` for every entry."""
    from safetensors.torch import save_file

    tensors = {name: draw(name, shape, seed, dtype) for name, shape in sorted(shapes.items())}
    save_file(tensors, str(path), metadata={"format": "pt"})
