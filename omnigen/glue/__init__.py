"""omnigen's glue between pipeline stages: a finished producer request -> the next stage's
request (prompt, payload). One module per model family; ``resolve`` finds a function by the
dotted name a config gives. Same results as vllm-omni 0.30's ``stage_input_processors``,
written here: nothing in this package imports vllm-omni (which patches vLLM on import).
"""

from .registry import GLUE, VLLM_OMNI_EQUIVALENTS, UnknownGlueError, resolve
from .types import Glue, GlueError, NextStageInput, StageResult

__all__ = [
    "GLUE",
    "VLLM_OMNI_EQUIVALENTS",
    "Glue",
    "GlueError",
    "NextStageInput",
    "StageResult",
    "UnknownGlueError",
    "resolve",
]
