"""The engine-level differential harness on vllm-omni 0.30's real model classes: each case runs
through vLLM's CPU engine with vllm-omni's runner (the oracle side) and with omnigen's generated
runner, in processes of their own (``run_side``), and the traces are compared."""
