"""SGLang configs sized for a 2-core CPU box, and the marker for tests that need SGLang."""
import importlib.util

import pytest

from megatron_fp8rl.rollout.sglang_common import SGLangConfig

# fp32 so SGLang and transformers run the same arithmetic; a 2048-token KV cache keeps RAM small.
CPU_CONFIG = dict(dtype="float32", max_total_tokens=2048, mem_fraction_static=0.8)

# Not imported here: sglang must first be imported after megatron_fp8rl.compat.sglang_cpu.install().
needs_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None, reason="SGLang is not installed (requirements/sglang-cpu.txt)"
)


def sglang_config(model_dir, **overrides) -> SGLangConfig:
    """SGLangConfig for `model_dir` with CPU_CONFIG, then `overrides`."""
    return SGLangConfig(model_path=str(model_dir), **{**CPU_CONFIG, **overrides})
