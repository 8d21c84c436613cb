"""vLLM general plugin: makes omnigen's tiny test models known to vLLM.

Declared in pyproject.toml as::

    [project.entry-points."vllm.general_plugins"]
    omnigen = "omnigen.plugin:register"

vLLM calls every ``vllm.general_plugins`` entry point in each process that builds
models: the engine process (when it creates the engine config), every worker
(``WorkerWrapperBase.init_worker``) and the subprocess that inspects an
out-of-tree model class. ``register`` must therefore be cheap, import nothing
heavy and be idempotent; it registers by ``"module:Class"`` string so the model
module is imported only when vLLM actually loads or inspects that architecture.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    """Register the tiny omni architectures with vLLM's ModelRegistry (idempotent)."""
    global _registered
    if _registered:
        return

    from vllm import ModelRegistry

    from omnigen.testing.tiny_omni import TINY_ARCHS

    supported = ModelRegistry.get_supported_archs()
    for arch, qualname in TINY_ARCHS.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, qualname)
    _registered = True
