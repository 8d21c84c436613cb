"""Oracle support: vllm-omni 0.30's runner and serving layer driven as the reference (its import
patches vLLM process-wide: only oracle processes import these). ``runners``, the stage runners and
engines of the real-model pipeline oracles, is import-light (vLLM and vllm-omni only inside its
functions): the pipeline tests import it in pytest's process too."""
