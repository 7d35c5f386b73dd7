"""Version shims: the only place that knows which library version needs which workaround.

Owns:
- `versions`: the version gate every entry point calls, and the signature checks of our overrides.
- `megatron_cpu`: running megatron-core on CPU (CUDA calls redirected, device arguments rewritten).
- `megatron_optim`: megatron-core optimizer checkpoint quirks without Apex/TE (raising walks).
- `sglang_cpu`: SGLang's CUDA-only imports on CPU.
- `safe_dcp`: torch.distributed.checkpoint loads that unpickle only checkpoint metadata classes.
- `tcp_store`: TCPStores that listen on their address only (torch listens on every interface).
Must not import: anything above layer L1 (models, convert, rollout, data, trainer, cli).
"""
