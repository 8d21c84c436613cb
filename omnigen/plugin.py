"""vLLM general plugin: makes omnigen's tiny test models known to vLLM.

Declared in pyproject.toml as::

    [project.entry-points."vllm.general_plugins"]
    omnigen = "omnigen.plugin:register"

vLLM calls every ``vllm.general_plugins`` entry point (those ``VLLM_PLUGINS`` names, when
set) in each process that builds models: the engine process (when it creates the engine
config) and every worker (``WorkerWrapperBase.init_worker``). ``register`` must therefore be
cheap and idempotent.

It registers the model classes themselves, not ``"module:Class"`` strings. vLLM inspects a
string-registered out-of-tree class in a fresh ``python -m`` subprocess (to keep CUDA out
of the parent), which re-imports vLLM: about 10 s per architecture on these CPUs whenever
its modelinfo cache (``$VLLM_CACHE_ROOT/modelinfos``, keyed by the module's hash) is cold,
i.e. on every fresh machine and after every edit of ``tiny_omni.py``. The tiny models'
module imports only torch at module level (vLLM's own imports are inside the classes) and
touches no device, so importing it here costs a few milliseconds.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    """Register the tiny omni architectures with vLLM's ModelRegistry (idempotent)."""
    global _registered
    if _registered:
        return

    from vllm import ModelRegistry

    from omnigen.testing import tiny_omni

    supported = ModelRegistry.get_supported_archs()
    for arch, qualname in tiny_omni.TINY_ARCHS.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, getattr(tiny_omni, qualname.rpartition(":")[2]))
    _registered = True
