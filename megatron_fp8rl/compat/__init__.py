"""Version shims: the only place that knows which library version needs which workaround.

Owns: running megatron-core on CPU (`megatron_cpu`). Later: SGLang's CUDA-only imports on CPU and
the translation of our FP8 recipe into Transformer Engine's recipe classes.
Must not import: anything above layer L1 (models, convert, rollout, data, trainer, cli).
"""
