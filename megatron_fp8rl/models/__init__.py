"""Megatron-Core models: configs and GPTModel construction for this process's pipeline stage.

Owns: turning a model description into a Megatron `TransformerConfig`, a layer spec and a
`GPTModel`, and the product layers that go into it: our FP8 Megatron linears
(megatron_fp8_linear.py), the SGLang-layout SDPA attention (megatron_attention.py) and the
SGLang-side patches that make its served arithmetic repeatable (served_arithmetic.py); our calibrated FP8
recipe as a Transformer Engine recipe and its hook into Megatron's recipe selection (te_recipe.py).
Must not import: convert, rollout, data, trainer, cli (layer L2 imports only L0/L1).
The family files (family.py, families/, registry.py) are pure data that every
layer above reads, the SGLang plugin included: they import only the standard library.
"""
