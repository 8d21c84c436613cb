"""omnigen's test support, shared by ``tests/`` and ``benchmarks/``; never imported by the product
(``omnigen``), which the layer contracts in ``.importlinter`` enforce.

* ``tiny_omni``, ``tiny_glue``: omnigen's own tiny, real vLLM models that behave like omni stages
  (``conf/model/omnigen_tiny*.yaml`` declare them by import path, so vLLM registers them only in
  the processes that serve those models), and the glue between them;
* ``checkpoints``: tiny checkpoints of the shipped real architectures written to disk
  (``python -m omnigen_testing.checkpoints``);
* ``contract_support``: the rigs the contract tests and benchmarks drive generated runners with;
* ``mrv2_cpu``: Model Runner V2's Triton kernels simulated on CPU;
* ``oracle``, ``real``, ``qwen3_tts_chain``: vllm-omni 0.30 driven as the reference (its runner,
  its serving layer, its pieces chained by hand).

The package module stays import-light: ``omnigen_tiny*`` serve configs import ``tiny_omni`` in
every vLLM process of their pipeline.
"""
