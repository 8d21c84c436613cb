"""Every test process (and the vLLM processes it starts, which inherit the environment) serves
omnigen's tiny test models: omnigen's vLLM plugin registers the classes of the models
``OMNIGEN_MODELS`` names (``omnigen.models``), and no user process gets them unasked."""

import os

os.environ.setdefault("OMNIGEN_MODELS", "omnigen_tiny,omnigen_tiny_omni")
