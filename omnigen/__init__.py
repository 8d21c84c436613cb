"""omnigen: declarative configs to specialized vLLM omni model runners."""

__version__ = "0.1.0"
