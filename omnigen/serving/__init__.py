"""Serving whole pipelines on plain vLLM (issue 8)."""
