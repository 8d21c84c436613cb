"""The window policy of a streaming edge (``stages.S.stream``): a value the planner decides and
the pipeline follows. Its own module, so that serving reads it from the built package's
``plan.yaml`` without importing the generator.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class StreamSpec:
    """A streaming edge: the window function and the window sizes."""

    window: str
    chunk_frames: int
    left_context_frames: int
    initial_chunk_frames: int
    ramp: tuple[int, ...] = ()
    coalesce: bool = True
    playback_rate_hz: float | None = None
    playback_lead_s: float = 1.0

    def window_sizes(self, count: int) -> list[int]:
        """The first ``count`` window sizes: the first window, the ramp, then ``chunk_frames``."""
        sizes = [self.initial_chunk_frames, *self.ramp]
        return (sizes + [self.chunk_frames] * max(count - len(sizes), 0))[:count]

    def as_dict(self) -> dict[str, Any]:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StreamSpec:
        return cls(**{**data, "ramp": tuple(data.get("ramp") or ())})
