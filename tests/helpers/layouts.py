"""The TP/PP layouts a torchrun worker walks through (imports nothing of Megatron's until called:
init_distributed installs the CPU compatibility layer first)."""
from __future__ import annotations

from typing import Iterator


def each_layout(tags: list[str], seed: int = 11) -> Iterator[str]:
    """In a torchrun worker: Megatron's parallel state rebuilt for each layout tag "tpXppY" (world
    size / (X*Y) data-parallel replicas) before the tag is yielded; torch.distributed shut down
    after the last."""
    from megatron.core import parallel_state

    from megatron_fp8rl.launch import init_distributed, shutdown_distributed

    for tag in tags:
        tp, pp = (int(n) for n in tag[2:].split("pp"))
        parallel_state.destroy_model_parallel()
        init_distributed(tp, pp, seed=seed)
        yield tag
    shutdown_distributed()
