"""From a Hugging Face config to a Megatron-Core TransformerConfig, layer spec and GPTModel.

Owns: reading HF config fields (old and new transformers spellings) into `MegatronModelArgs`,
checking a TP/PP layout against them, choosing the layer spec (TE when Transformer Engine is
usable, else the local spec, optionally with FP8 linear modules), the trainer FP8 backend (ours:
our FP8 linears; te: TE's autocast with the recipe, refused where TE cannot run), and building
the GPTModel chunk of this process (`build_model_from_hf`), also on the meta device (no weights).
Must not import: convert, rollout, data, trainer, cli (layer L2 imports only L0/L1).
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_fp8rl.fp8.recipe import CalibratedDelayedScaling, Fp8Recipe
from megatron_fp8rl.models.family import ModelFamily, UnsupportedModelError
from megatron_fp8rl.models.gpt import build_gpt_model
from megatron_fp8rl.models.megatron_attention import serve_output_layer_in_tiles, with_sdpa_attention
from megatron_fp8rl.models.megatron_fp8_linear import fp8_local_layer_spec
from megatron_fp8rl.models.registry import family_for
from megatron_fp8rl.models.rope import RopeSettings, apply_rope_scaling, rope_settings
from megatron_fp8rl.models.te_recipe import (
    install_megatron_recipe, megatron_fp8_fields, restore_megatron_recipe,
)


@dataclass(frozen=True)
class MegatronModelArgs:
    """Everything needed to build the Megatron GPTModel equivalent of an HF checkpoint."""

    family: ModelFamily
    """The model family the HF config belongs to."""
    config: TransformerConfig
    """Megatron transformer config (this process's TP/PP sizes)."""
    vocab_size: int
    """Embedding rows (the HF vocab size; no padding)."""
    max_sequence_length: int
    """HF `max_position_embeddings`."""
    rope: RopeSettings
    """Rotary base and optional Llama 3.x scaling."""
    tie_embeddings: bool
    """Whether the output layer shares the input embedding."""


def hf_config_dict(hf_config: Any) -> dict[str, Any]:
    """An HF config as a plain dict, from a dict, a `PretrainedConfig`, config.json or its folder."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if isinstance(hf_config, (str, Path)):
        path = Path(hf_config)
        path = path / "config.json" if path.is_dir() else path
        return json.loads(path.read_text())
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(f"cannot read an HF config from {type(hf_config).__name__}")


def head_dim(hf: Mapping[str, Any]) -> int:
    """Per-head channels: `head_dim` when given (Qwen3), else hidden_size / heads."""
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def check_parallel_layout(hf: Mapping[str, Any], tensor_parallel: int, pipeline_parallel: int) -> None:
    """Raise naming the HF field that the TP/PP sizes do not divide."""
    kv_heads = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    for field, value, size, what in (
        ("num_attention_heads", hf["num_attention_heads"], tensor_parallel, "tensor_parallel"),
        ("num_key_value_heads", kv_heads, tensor_parallel, "tensor_parallel"),
        ("vocab_size", hf["vocab_size"], tensor_parallel, "tensor_parallel"),
        ("num_hidden_layers", hf["num_hidden_layers"], pipeline_parallel, "pipeline_parallel"),
    ):
        if value % size:
            raise UnsupportedModelError(f"{what}={size} does not divide {field}={value}")


def transformer_config_from_hf(
    hf_config: Any,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> TransformerConfig:
    """The Megatron TransformerConfig of an HF Llama/Qwen2/Qwen3 config; `overrides` win."""
    hf = hf_config_dict(hf_config)
    family = family_for(hf)
    family.check(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={hf['hidden_act']!r} is not supported (silu)")
    check_parallel_layout(hf, tensor_parallel, pipeline_parallel)
    rope_settings(hf)  # refuse unsupported rope types here, not at build time
    fields = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        kv_channels=head_dim(hf),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias(hf),
        qk_layernorm=family.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(hf.get("initializer_range", 0.02)),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def megatron_args_from_hf(
    hf_config: Any, params_dtype: torch.dtype = torch.float32, **overrides: Any
) -> MegatronModelArgs:
    """`MegatronModelArgs` for this process's TP/PP sizes (Megatron's parallel state)."""
    hf = hf_config_dict(hf_config)
    config = transformer_config_from_hf(
        hf,
        tensor_parallel=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_parallel=parallel_state.get_pipeline_model_parallel_world_size(),
        params_dtype=params_dtype,
        **overrides,
    )
    return MegatronModelArgs(
        family=family_for(hf),
        config=config,
        vocab_size=int(hf["vocab_size"]),
        max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
        rope=rope_settings(hf),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


FP8_BACKENDS = ("ours", "te")
"""Who computes the trainer's FP8 GEMMs: ours (our FP8 linear in the local spec, torch._scaled_mm;
both tiers) or te (Transformer Engine's layers under TE's autocast with the recipe; GPU tier)."""


def transformer_engine_usable() -> bool:
    """TE layers need CUDA and an installed transformer_engine (never installed on the CPU tier)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def check_fp8_backend(fp8: str, fp8_backend: str) -> None:
    """Refuse, naming the keys, a trainer FP8 backend this process cannot run (te without CUDA
    or without Transformer Engine)."""
    if fp8_backend != "te" or fp8 == "none":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"model.fp8_backend=te (model.fp8={fp8}) needs CUDA and Transformer Engine; "
                         "this process has no CUDA device: use model.fp8_backend=ours")
    if importlib.util.find_spec("transformer_engine") is None:
        raise ValueError(f"model.fp8_backend=te (model.fp8={fp8}): CUDA is available but "
                         "transformer_engine is not installed; install it or use model.fp8_backend=ours")


def te_fp8_overrides(fp8_recipe: Fp8Recipe) -> dict[str, Any]:
    """TransformerConfig fields that make TE's autocast run `fp8_recipe`: our calibrated recipe
    is installed into Megatron's recipe selection (models/te_recipe.py); for the others Megatron
    selects TE's own recipe from the fields (any earlier install is undone)."""
    fields = megatron_fp8_fields(fp8_recipe)
    if isinstance(fp8_recipe, CalibratedDelayedScaling):
        install_megatron_recipe(fp8_recipe)
    else:
        restore_megatron_recipe()
    return fields


def layer_spec(
    qk_layernorm: bool,
    use_te: bool | None = None,
    fp8_recipe: Fp8Recipe | None = None,
    fp8_gemm: str = "auto",
) -> ModuleSpec:
    """The transformer layer spec: TE's when `use_te` (default: when TE is usable and there is no
    `fp8_recipe`), else local.

    With `fp8_recipe` and not `use_te`, the local spec's linears are our FP8 drop-ins
    (megatron_fp8rl.models.megatron_fp8_linear); with `use_te`, FP8 comes from TE's autocast
    (the config fields of `te_fp8_overrides`), so the spec is unchanged. Both specs store the
    same checkpoint keys (the local spec maps its separate norms onto TE's fused names).
    `fp8_gemm`: our FP8 linears' GEMM (fp8.gemm.GEMMS; batch_invariant for aligned rollouts).
    """
    use_te = (transformer_engine_usable() and fp8_recipe is None) if use_te is None else use_te
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    if fp8_recipe is not None:
        spec = fp8_local_layer_spec(fp8_recipe, fp8_gemm, qk_layernorm=qk_layernorm, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")
    return with_sdpa_attention(spec)


def build_model_from_hf(
    hf_config: Any,
    params_dtype: torch.dtype = torch.float32,
    use_te: bool | None = None,
    fp8_recipe: Fp8Recipe | None = None,
    device: torch.device | str | None = None,
    fp8_backend: str = "ours",
    fp8_gemm: str = "auto",
    **overrides: Any,
) -> GPTModel:
    """This process's GPTModel chunk for an HF config, with random (or, on meta, no) weights.

    `fp8_backend` (FP8_BACKENDS) says who runs `fp8_recipe`: ours (local spec, our FP8 linears)
    or te (TE spec, the TransformerConfig's fp8 fields; check_fp8_backend first); `fp8_gemm` is
    our FP8 linears' GEMM (layer_spec).
    `device="meta"` builds shapes only (parameter counts, checkpoint layouts); weights come from
    a checkpoint (megatron_fp8rl.convert writes one from HF safetensors).
    """
    if fp8_recipe is not None and fp8_backend == "te":
        overrides = {**te_fp8_overrides(fp8_recipe), **overrides}
        use_te = True
    if device is not None and torch.device(device).type == "meta":
        overrides = {"use_cpu_initialization": True, "perform_initialization": False, **overrides}
    args = megatron_args_from_hf(hf_config, params_dtype=params_dtype, **overrides)
    model = build_gpt_model(
        args.config,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_sequence_length,
        layer_spec=layer_spec(args.family.qk_layernorm, use_te, fp8_recipe, fp8_gemm),
        rotary_base=args.rope.theta,
        tie_embeddings=args.tie_embeddings,
        device=device,
    )
    apply_rope_scaling(model, args.rope)
    serve_output_layer_in_tiles(model)
    return model


def build_conversion_target(hf_config: Any, tensor_parallel: int = 1,
                            pipeline_parallel: int = 1) -> GPTModel:
    """The GPTModel a checkpoint conversion writes for: on the meta device at this process's
    TP/PP (one process: TP=1/PP=1), after checking that the checkpoint will load at
    `tensor_parallel` x `pipeline_parallel`. Matches convert.cli_commands.MetaModelBuilder."""
    hf = hf_config_dict(hf_config)
    check_parallel_layout(hf, tensor_parallel, pipeline_parallel)
    return build_model_from_hf(hf, device="meta")
