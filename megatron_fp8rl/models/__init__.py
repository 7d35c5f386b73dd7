"""Megatron-Core models: configs and GPTModel construction for this process's pipeline stage.

Owns: turning a model description into a Megatron `TransformerConfig`, a layer spec and a
`GPTModel`. Must not import: convert, rollout, data, trainer, cli (layer L2 imports only L0/L1).
"""
