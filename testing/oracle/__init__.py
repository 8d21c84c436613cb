"""Oracle support: vllm-omni 0.30's runner and serving layer driven as the reference (its import
patches vLLM process-wide: only oracle processes import these)."""
