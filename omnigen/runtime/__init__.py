"""Hand-written building blocks that generated runners compose.

Nothing here asks a model what it is: every per-model policy is decided when
the runner is generated and arrives here as an argument or a class constant.
"""
