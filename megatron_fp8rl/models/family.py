"""What a model family is: every fact that tells Llama, Qwen2 and Qwen3 apart, as plain data.

Owns: `ModelFamily` (HF config mapping, the checkpoint name/layout table, the decoder linears and
how Megatron and SGLang fuse them), `Rule`, `DecoderLinear`, `UnsupportedModelError` and the
`reject` helper the family files share. Each family lives in its own file under families/
(llama.py, qwen2.py, qwen3.py) and defines one `ModelFamily`; registry.py finds them. Every
consumer derives from
the family: models/hf.py (the Megatron config), convert/ (conversion, FP8 export), trainer/
rollout_fp8.py (the weight sync) and rollout/sglang_fp8.py (the SGLang plugin, which loads this in
SGLang's own processes: so this file and the family files import only the standard library).
Must not import: torch, megatron, compat, convert, rollout, data, trainer, cli.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

LAYER_PREFIX = "decoder.layers."
"""Megatron checkpoint keys under this prefix are stacked over layers (axis 0 = layer)."""
HF_LAYER = "model.layers.{layer}."
"""The HF name prefix of decoder layer `layer`'s tensors."""
LAYOUTS = ("copy", "qkv", "gate_up")
"""How HF tensors' rows make up a Megatron tensor (convert/tables.row_pieces cuts them):
copy: the one HF tensor as is; qkv: per query group [q heads; k; v] from q, k, v;
gate_up: [gate; up]."""
_HF_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_SGLANG_LAYER_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


class UnsupportedModelError(ValueError):
    """The Hugging Face config or checkpoint describes a model this package cannot handle."""


@dataclass(frozen=True)
class Rule:
    """One Megatron checkpoint tensor and the HF tensors it is made of."""

    megatron: str
    """Megatron checkpoint key (stacked over layers when it starts with LAYER_PREFIX)."""
    hf: tuple[str, ...]
    """HF tensor names; `{layer}` stands for the layer number."""
    layout: str = "copy"
    """How the HF tensors' rows make up the Megatron tensor: one of LAYOUTS."""

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"{self.megatron}: unknown layout {self.layout!r} (valid: {', '.join(LAYOUTS)})")

    def hf_names(self, layer: int | None) -> tuple[str, ...]:
        return tuple(name.format(layer=layer) for name in self.hf)


@dataclass(frozen=True)
class DecoderLinear:
    """One linear of a decoder layer: FP8 in the trainer, in the export, in each sync and in SGLang.
    Megatron and SGLang may fuse several HF linears into it."""

    megatron: str
    """Its path inside a Megatron TransformerLayer ("self_attention.linear_qkv")."""
    hf: tuple[str, ...]
    """The HF linears it is made of, inside model.layers.{layer}, in Megatron's row order."""
    layout: str
    """How their rows make up the Megatron weight: one of LAYOUTS."""
    sglang: str
    """Its module name inside an SGLang decoder layer ("self_attn.qkv_proj")."""
    sglang_shards: tuple[str | int, ...] = ()
    """The shard ids SGLang's weight loaders pass for `hf`, in the same order; () when unfused."""

    def rule(self, param: str = "weight") -> Rule:
        """The checkpoint rule of its `param` ("weight", "bias")."""
        return Rule(f"{LAYER_PREFIX}{self.megatron}.{param}",
                    tuple(f"{HF_LAYER}{module}.{param}" for module in self.hf), self.layout)


@dataclass(frozen=True)
class ModelFamily:
    """One decoder family: its HF config mapping and all of its checkpoint and module names."""

    name: str
    """Short name ("llama", "qwen2", "qwen3")."""
    architectures: tuple[str, ...]
    """HF `architectures` entries that select this family."""
    model_types: tuple[str, ...]
    """HF `model_type` values that select this family when `architectures` is absent."""
    qkv_bias: Callable[[Mapping[str, Any]], bool]
    """Whether q/k/v projections carry a bias, from the HF config dict."""
    qk_layernorm: bool
    """Whether queries and keys pass through a per-head RMSNorm (Qwen3)."""
    check: Callable[[Mapping[str, Any]], None]
    """Raises UnsupportedModelError for settings of this family that we cannot map."""
    linears: tuple[DecoderLinear, ...]
    """The decoder linears; their weights are the FP8 tensors of export, sync and serving."""
    tensors: tuple[Rule, ...]
    """Every other checkpoint tensor (embeddings, norms, biases, output layer)."""
    derived_hf_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    """HF tensors that are derived buffers, not weights (old Llama checkpoints store them)."""

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The checkpoint name/layout table: one rule per Megatron tensor."""
        return tuple(linear.rule() for linear in self.linears) + self.tensors

    def hf_names(self, num_layers: int) -> set[str]:
        """Every HF tensor name the table gives a checkpoint of `num_layers` decoder layers."""
        return {name for rule in self.rules
                for layer in (range(num_layers) if rule.megatron.startswith(LAYER_PREFIX) else [None])
                for name in rule.hf_names(layer)}

    def weight_linear(self, hf_tensor: str) -> tuple[int, DecoderLinear] | None:
        """(layer, linear) when `hf_tensor` is the weight of a decoder linear, None for the
        family's other tensors; raises naming the family and the tensor when its table lacks it."""
        match = _HF_LAYER_NAME.match(hf_tensor)
        template = HF_LAYER + match.group(2) if match else hf_tensor
        known = any(template in rule.hf for rule in self.rules) or hf_tensor.endswith(self.derived_hf_suffixes)
        if not known:
            raise UnsupportedModelError(f"{self.name}: HF tensor {hf_tensor} is not in the family's name "
                                        f"table (models/families/{self.name}.py)")
        if match is None or not hf_tensor.endswith(".weight"):
            return None
        module = match.group(2)[: -len(".weight")]
        return next(((int(match.group(1)), linear) for linear in self.linears if module in linear.hf), None)

    def decoder_linear(self, hf_module: str) -> tuple[int, DecoderLinear]:
        """'model.layers.3.self_attn.k_proj' -> (3, the linear it is part of); raises naming the
        family and the module when it is no decoder linear of the family."""
        match = _HF_LAYER_NAME.match(hf_module)
        for linear in self.linears if match else ():
            if match.group(2) in linear.hf:
                return int(match.group(1)), linear
        raise UnsupportedModelError(f"{self.name}: {hf_module} is not a decoder linear of the family "
                                    f"(models/families/{self.name}.py: {self._linear_names('hf')})")

    def sglang_linear(self, prefix: str) -> tuple[int, DecoderLinear]:
        """'model.layers.3.self_attn.qkv_proj' (an SGLang module) -> (3, its linear); raises
        naming the family and the module when the family has no such linear."""
        match = _SGLANG_LAYER_NAME.match(prefix)
        for linear in self.linears if match else ():
            if match.group(2) == linear.sglang:
                return int(match.group(1)), linear
        raise UnsupportedModelError(f"{self.name}: SGLang linear {prefix} is not a decoder linear of the "
                                    f"family (models/families/{self.name}.py: {self._linear_names('sglang')})")

    def _linear_names(self, side: str) -> str:
        names = [m for linear in self.linears for m in (linear.hf if side == "hf" else (linear.sglang,))]
        return ", ".join(names)


def reject(hf_config: Mapping[str, Any], field: str, allowed: Any, family: str) -> None:
    """Raise when `hf_config[field]` is set to something other than `allowed`."""
    value = hf_config.get(field, allowed)
    if value != allowed and value is not None:
        raise UnsupportedModelError(
            f"{family}: config field {field}={value!r} is not supported (expected {allowed!r})"
        )
