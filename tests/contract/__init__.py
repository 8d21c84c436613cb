"""Contract tests: shared/docs/CONTRACT.md, clause by clause, on CPU against real vLLM types."""
