"""Rollout: the engine interface the trainer uses and its SGLang implementations.

Owns: `engine` (interface, dataclasses, errors), `weights` (validating updates), `sglang_common`
(config and translation), `sglang_engine` (in-process Engine), `sglang_server` (server subprocess +
HTTP client), `sglang_fp8` (our FP8 quantization method inside SGLang, registered by the
`sglang.srt.plugins` entry point in setup.py), `weight_update_group` (the trainer's side of
SGLang's weight-update process group). Importing this package imports neither sglang nor
requests' servers; the SGLang modules are imported by name.
Must not import: convert, data, trainer, cli (layer L3 imports only L0-L2 of ours).
"""
from megatron_fp8rl.rollout.engine import (
    RolloutEngine,
    RolloutEngineError,
    RolloutSample,
    SamplingParams,
    WeightUpdateError,
)

__all__ = ["RolloutEngine", "RolloutEngineError", "RolloutSample", "SamplingParams", "WeightUpdateError"]
