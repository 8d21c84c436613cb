"""Engine-level differential tests on vllm-omni 0.30's real model classes (issue 7)."""
