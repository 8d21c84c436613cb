"""Contract tests: docs/contract.md, clause by clause, on CPU against real vLLM types."""
