"""The hand-written bases of the generated Model Runner V2 targets (``<stage>_v2.py``).

vLLM's Model Runner V2 splits what a V1 runner subclass did into seams: per-model behaviour lives
in a ``ModelState`` the runner calls at fixed points, and the runner itself "must only contain
code that is common to every model". A generated V2 target is therefore two classes per stage:
``<Stage>ModelState(OmniModelStateV2, DefaultModelState)``, which holds the omni state (the same
``OmniStateBase`` the V1 runner holds) and carries the generated hook bodies, and
``<Stage>RunnerV2(OmniRunnerV2, GPUModelRunner)``, which builds that state and adds what no state
hook sees (finished requests, cached-request payloads, the step's payloads after sampling).
``docs/model-runner-v2.md`` maps every contract clause onto the seam that carries it here.

Import only where the V2 target runs: these modules import vLLM's V2 runner.
"""

from omnigen.runtime.v2.runner import OmniRunnerV2
from omnigen.runtime.v2.state import (
    FilteredKwargsRopeState,
    OmniModelStateV2,
    RequestRecord,
    TextOnlyRopeState,
)

__all__ = [
    "FilteredKwargsRopeState",
    "OmniModelStateV2",
    "OmniRunnerV2",
    "RequestRecord",
    "TextOnlyRopeState",
]
