"""Checkpoint conversion: HF safetensors <-> Megatron torch_dist, and FP8 export for SGLang.

Owns: the row layouts of the families' name tables (tables.py; the tables themselves are in
models/families/<family>.py), streaming safetensors I/O, the two conversion directions, the FP8
export and their command-line arguments. Layer L3: imports only L0-L2 (the model families of
models/) and megatron/torch/safetensors. The entry point (tools/ or cli.py) builds the target
GPTModel on the meta device with megatron_fp8rl.models and hands its `sharded_state_dict()` to
`convert_hf_to_megatron`, so the checkpoint layout (keys, stacked layers, extra-state objects) is
always exactly the one Megatron-Core loads.
Must not import: rollout, data, trainer, cli.
"""
