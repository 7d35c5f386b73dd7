"""Per-family name maps between HF and Megatron-Core checkpoints, with their split/merge layouts.

Owns: `Rule` (one Megatron tensor <- one or more HF tensors), the Llama, Qwen2 and Qwen3 tables,
`table_for(architecture)` and `row_pieces` (how a Megatron tensor's rows are cut from its HF
tensors). Megatron keys are the *checkpoint* keys of Megatron-Core 0.16.1's torch_dist format:
decoder layers are stacked (key without the layer number; layer = offset on axis 0), and the local
spec's separate norms are stored under TE's fused names (`linear_qkv.layer_norm_weight`,
`linear_fc1.layer_norm_weight`), so one table serves both specs.

Layouts (a Megatron tensor is the dim-0 concatenation of row ranges of its HF tensors):
- copy:    the one HF tensor as is.
- qkv:     per query group g: [q heads of g; k of g; v of g] from q_proj, k_proj, v_proj
           (weights [rows, hidden] and biases [rows] alike). Contiguous groups shard over TP.
- gate_up: [gate; up] from gate_proj, up_proj (Megatron's checkpoint stores the full fc1 in this
           order; each TP rank holds [gate shard; up shard] in memory).
Must not import: models, rollout, data, trainer, cli.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from megatron_fp8rl.convert.safetensors_io import CheckpointError

LAYER_PREFIX = "decoder.layers."
"""Megatron keys under this prefix are stacked over layers (axis 0 = layer)."""


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor and the HF tensors it is made of."""

    megatron: str
    """Megatron checkpoint key (stacked over layers when it starts with LAYER_PREFIX)."""
    hf: tuple[str, ...]
    """HF tensor names; `{layer}` stands for the layer number."""
    layout: str = "copy"
    """How the HF tensors' rows make up the Megatron tensor: copy, qkv or gate_up."""

    def hf_names(self, layer: int | None) -> tuple[str, ...]:
        return tuple(name.format(layer=layer) for name in self.hf)


@dataclass(frozen=True)
class AttentionShape:
    """The head counts the qkv layout needs."""

    num_query_groups: int
    """Key/value heads."""
    heads_per_group: int
    """Query heads per key/value head."""
    head_dim: int
    """Channels per head."""

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "AttentionShape":
        heads = int(hf["num_attention_heads"])
        groups = int(hf.get("num_key_value_heads") or heads)
        dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
        if heads % groups:
            raise CheckpointError(f"num_attention_heads={heads} is not a multiple of "
                                  f"num_key_value_heads={groups}")
        return cls(groups, heads // groups, dim)


Piece = tuple[int, int, int]
"""(index into Rule.hf, first row, end row) of a row range of one HF tensor."""


def row_pieces(rule: Rule, attention: AttentionShape, rows: int) -> list[Piece]:
    """The HF row ranges whose dim-0 concatenation is the Megatron tensor of `rows` rows."""
    if rule.layout == "copy":
        pieces = [(0, 0, rows)]
    elif rule.layout == "gate_up":
        if rows % 2:
            raise CheckpointError(f"{rule.megatron}: gate_up tensor has an odd row count {rows}")
        pieces = [(0, 0, rows // 2), (1, 0, rows // 2)]
    elif rule.layout == "qkv":
        a = attention
        q_rows = a.heads_per_group * a.head_dim
        pieces = []
        for g in range(a.num_query_groups):
            pieces += [(0, g * q_rows, (g + 1) * q_rows),
                       (1, g * a.head_dim, (g + 1) * a.head_dim),
                       (2, g * a.head_dim, (g + 1) * a.head_dim)]
    else:
        raise ValueError(f"{rule.megatron}: unknown layout {rule.layout!r}")
    total = sum(end - start for _, start, end in pieces)
    if total != rows:
        raise CheckpointError(
            f"{rule.megatron}: {rows} rows, but the {rule.layout} layout of the HF config "
            f"(heads/groups/head_dim) makes {total}"
        )
    return pieces


def hf_row_counts(rule: Rule, pieces: list[Piece]) -> list[int]:
    """Rows each HF tensor of `rule` must have, given its pieces."""
    return [max(end for i, _, end in pieces if i == index) for index in range(len(rule.hf))]


_LAYER = "model.layers.{layer}."
LLAMA: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
    Rule("decoder.layers.self_attention.linear_qkv.layer_norm_weight",
         (_LAYER + "input_layernorm.weight",)),
    Rule("decoder.layers.self_attention.linear_qkv.weight",
         tuple(_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    Rule("decoder.layers.self_attention.linear_proj.weight", (_LAYER + "self_attn.o_proj.weight",)),
    Rule("decoder.layers.mlp.linear_fc1.layer_norm_weight",
         (_LAYER + "post_attention_layernorm.weight",)),
    Rule("decoder.layers.mlp.linear_fc1.weight",
         (_LAYER + "mlp.gate_proj.weight", _LAYER + "mlp.up_proj.weight"), "gate_up"),
    Rule("decoder.layers.mlp.linear_fc2.weight", (_LAYER + "mlp.down_proj.weight",)),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",)),
)
QWEN2: tuple[Rule, ...] = LLAMA + (
    Rule("decoder.layers.self_attention.linear_qkv.bias",
         tuple(_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"),
)
QWEN3: tuple[Rule, ...] = LLAMA + (
    Rule("decoder.layers.self_attention.q_layernorm.weight", (_LAYER + "self_attn.q_norm.weight",)),
    Rule("decoder.layers.self_attention.k_layernorm.weight", (_LAYER + "self_attn.k_norm.weight",)),
)
TABLES: dict[str, tuple[Rule, ...]] = {
    "LlamaForCausalLM": LLAMA,
    "Qwen2ForCausalLM": QWEN2,
    "Qwen3ForCausalLM": QWEN3,
}
"""HF architecture -> table (the same names as megatron_fp8rl.models.registry)."""

IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
"""HF tensors that are derived buffers, not weights (old Llama checkpoints store them)."""


def table_for(hf: Mapping[str, Any]) -> tuple[Rule, ...]:
    """The table of an HF config dict; raises listing the supported architectures."""
    for architecture in hf.get("architectures") or []:
        if architecture in TABLES:
            return TABLES[architecture]
    raise CheckpointError(
        f"unsupported architecture {hf.get('architectures') or hf.get('model_type')!r}; "
        f"supported: {', '.join(sorted(TABLES))}"
    )
