"""Build a Megatron-Core GPTModel for this process's pipeline stage.

Owns: GPTModel construction (pre/post-process flags from Megatron's parallel state, layer spec
choice) and the tiny reference config used by the CPU demo and the tests.
Must not import: convert, rollout, data, trainer, cli.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec


def tiny_transformer_config(
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_query_groups: int = 2,
    ffn_hidden_size: int = 128,
    params_dtype: torch.dtype = torch.float32,
) -> TransformerConfig:
    """A Llama-shaped config (RMSNorm, SwiGLU, RoPE, GQA, no biases) small enough for CPU tests.

    Dropout is off so runs at different TP/PP layouts are comparable token for token.
    `params_dtype=torch.bfloat16` is Megatron bf16 mixed precision (`bf16=True`).
    """
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        ffn_hidden_size=ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=params_dtype,
    )


def build_gpt_model(
    config: TransformerConfig,
    vocab_size: int,
    max_sequence_length: int,
    layer_spec: ModuleSpec | None = None,
    rotary_base: float = 10000.0,
    tie_embeddings: bool = True,
    device: torch.device | str | None = None,
) -> GPTModel:
    """The GPTModel chunk this process owns: embedding on the first stage, output layer on the last.

    `layer_spec` defaults to Megatron's local (non-TE) spec, which runs on the CPU tier.
    `device` defaults to the current GPU when there is one, else the CPU; "meta" builds shapes
    only (the config must then have `use_cpu_initialization=True`, or Megatron allocates on the
    accelerator).
    """
    if layer_spec is None:
        layer_spec = get_gpt_layer_local_spec(normalization=config.normalization)
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            return _gpt_model(config, vocab_size, max_sequence_length, layer_spec, rotary_base,
                              tie_embeddings)
    model = _gpt_model(config, vocab_size, max_sequence_length, layer_spec, rotary_base,
                       tie_embeddings)
    if device is not None:
        return model.to(device)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def _gpt_model(config, vocab_size, max_sequence_length, layer_spec, rotary_base, tie_embeddings):
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=tie_embeddings,
        position_embedding_type="rope",
        rotary_base=rotary_base,
    )
