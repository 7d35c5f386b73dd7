"""Version and platform shims: code that papers over a gap in a library we depend on (a version's
quirk, a CPU without CUDA/TE, an SGLang CPU gap, an unsafe or over-wide default in torch). The only
place that knows which library version needs which workaround. Our product (the FP8 Megatron
linears, the aligned attention, the TE form of our recipe, the weight-update group) lives in the
layer that owns it (models/, rollout/), not here.

Owns:
- `versions`: the version gate every entry point calls, and the signature checks of our overrides.
- `megatron_cpu`: running megatron-core on CPU (CUDA calls redirected, device arguments rewritten).
- `megatron_optim`: megatron-core optimizer checkpoint quirks without Apex/TE (raising walks).
- `sglang_cpu` (with its stand-in packages `sglang_cpu_standins/`): SGLang's CUDA-only imports on
  CPU, and the Engine shims that keep a host process safe from SGLang 0.5.23's child handling.
- `sglang_cpu_sampling`: SGLang's seeded sampling on CPU (its murmur hash is a compiled kernel).
- `safe_dcp`: torch.distributed.checkpoint loads that unpickle only checkpoint metadata classes.
- `tcp_store`: TCPStores that listen on their address only (torch listens on every interface), and
  the one free-port helper.
- `process_env`: environments without torchrun's variables for processes a torchrun worker starts
  (inherited, they make the child wait on the elastic agent's store).
Must not import: anything above layer L1 (models, convert, rollout, data, trainer, cli).
"""
