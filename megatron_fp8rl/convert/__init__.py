"""Checkpoint conversion: HF safetensors <-> Megatron torch_dist, and FP8 export for SGLang.

Owns: the per-family name/layout tables (tables.py), streaming safetensors I/O, the two
conversion directions, the FP8 export and their command-line arguments. Layer L2: imports only
L0/L1 and megatron/torch/safetensors. It does not import models/ (same layer): the entry point
(tools/ or cli.py) builds the target GPTModel on the meta device with megatron_fp8rl.models and
hands its `sharded_state_dict()` to `convert_hf_to_megatron`, so the checkpoint layout (keys,
stacked layers, extra-state objects) is always exactly the one Megatron-Core loads.
Must not import: models, rollout, data, trainer, cli.
"""
