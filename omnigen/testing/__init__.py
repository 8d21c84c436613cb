"""Test support: tiny, real vLLM models that behave like omni stages.

Nothing here is imported by the runtime. ``omnigen.testing.tiny_omni`` holds
Llama-shaped models small enough to run through ``vllm.LLM`` on a CPU in seconds
(random weights, ``load_format="dummy"``), with the hooks a talker / code2wav
stage exposes and a record of every call the runner made into them.

This package module stays import-light on purpose: ``omnigen.plugin`` (vLLM's
``vllm.general_plugins`` entry point) imports ``omnigen.testing.tiny_omni`` in every
vLLM process it is loaded in, and the config helper is used before any engine starts.
"""
