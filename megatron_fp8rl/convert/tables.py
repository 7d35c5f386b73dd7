"""How a Megatron tensor's rows are cut from its HF tensors: the layouts of the family tables.

Owns: `AttentionShape` (the head counts the qkv layout needs) and `row_pieces` / `hf_row_counts`.
The name/layout tables themselves are the model families' (models/families/<family>.py: `Rule`,
`ModelFamily.rules`). Megatron keys are the *checkpoint* keys of Megatron-Core 0.16.1's
torch_dist format: decoder layers are stacked (key without the layer number; layer = offset on
axis 0), and the local spec's separate norms are stored under TE's fused names, so one table
serves both specs.

Layouts (a Megatron tensor is the dim-0 concatenation of row ranges of its HF tensors):
- copy:    the one HF tensor as is.
- qkv:     per query group g: [q heads of g; k of g; v of g] from q_proj, k_proj, v_proj
           (weights [rows, hidden] and biases [rows] alike). Contiguous groups shard over TP.
- gate_up: [gate; up] from gate_proj, up_proj (Megatron's checkpoint stores the full fc1 in this
           order; each TP rank holds [gate shard; up shard] in memory).
Must not import: rollout, data, trainer, cli.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from megatron_fp8rl.convert.safetensors_io import CheckpointError
from megatron_fp8rl.models.family import Rule


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
