"""The training side of the RL loop: Megatron optimizer steps, and later the RL step loop.

Owns: wrapping models in Megatron DDP, the optimizer, one forward/backward/step over micro-batches.
Must not import: cli (layer L4 imports L0-L3 only).
"""
