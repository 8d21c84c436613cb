"""vLLM general plugin: registers the classes of the models ``OMNIGEN_MODELS`` names.

Declared in pyproject.toml as::

    [project.entry-points."vllm.general_plugins"]
    omnigen = "omnigen.plugin:register"

vLLM calls every ``vllm.general_plugins`` entry point (those ``VLLM_PLUGINS`` names, when
set) in each process that builds models: the engine process (when it creates the engine
config) and every worker (``WorkerWrapperBase.init_worker``). ``register`` reads which models
to register from the environment (``omnigen.models.ENV``; omnigen's driver sets it for the
engines it starts) and registers exactly what each model's built package declares
(``omnigen.models``). With the variable unset it registers nothing: a user's vLLM process that
serves no omnigen model is left as it was.
"""

from __future__ import annotations


def register() -> None:
    """Register the declared classes of every model ``OMNIGEN_MODELS`` names (idempotent)."""
    from omnigen import models

    models.register_from_env()
