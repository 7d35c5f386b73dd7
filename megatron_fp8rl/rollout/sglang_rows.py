"""Loading vocabulary tensors into SGLang row chunk by row chunk (runs in SGLang's scheduler).

Owns: the key format of a row chunk (`row_key`, `parse_row_key`) and `load_vocab_rows`, the custom
weight loader the in-process engine registers (SGLang's `custom_weight_loader` server argument;
`update_weights_from_tensor` with `load_format` set to its import path calls it with the model and
the (name, tensor) pairs). SGLang's own loaders take a whole tensor per name, so an embedding larger
than a transfer bucket would need a buffer of its size (1.2-1.6 GB in bf16 at 8B-32B); this one
copies rows [start, start + n) of an embedding or lm_head straight into the rows its TP rank holds.
Must not import: convert, data, trainer, cli; nor sglang (it runs inside SGLang and needs only
the module attributes named below).
"""
from __future__ import annotations

import torch

LOADER = f"{__name__}.load_vocab_rows"
"""The import path SGLang is given (`custom_weight_loader`) and each chunk's `load_format`."""
_MARK = "@rows="


def row_key(name: str, start: int) -> str:
    """The name a row chunk of HF tensor `name` travels under, its first row being `start`."""
    return f"{name}{_MARK}{start}"


def parse_row_key(key: str) -> tuple[str, int]:
    """(HF tensor name, first row) of a `row_key`; ValueError for any other name."""
    name, mark, start = key.rpartition(_MARK)
    if not mark or not start.isdigit():
        raise ValueError(f"row-chunk loader: {key!r} is not a row chunk key (<HF name>{_MARK}<first row>)")
    return name, int(start)


def load_vocab_rows(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Copy each chunk into the vocabulary-parallel module the HF name points at (SGLang's
    VocabParallelEmbedding / ParallelLMHead: `weight` holds rows [org_vocab_start_index,
    org_vocab_end_index) of the vocabulary, then padding). Rows outside this TP rank's range are
    skipped; a chunk's width must equal the module's."""
    for key, rows in named_tensors:
        name, start = parse_row_key(key)
        module = model.get_submodule(name.removesuffix(".weight"))
        indices = getattr(module, "shard_indices", None)
        if indices is None or not name.endswith(".weight"):
            raise ValueError(f"row-chunk loader: {name!r} is not a vocabulary-parallel weight of the served model")
        weight = module.weight.data
        if rows.dim() != 2 or rows.shape[1] != weight.shape[1]:
            raise ValueError(f"row-chunk loader: chunk of {name!r} has shape {tuple(rows.shape)}, "
                             f"expected (rows, {weight.shape[1]})")
        low = max(start, indices.org_vocab_start_index)
        high = min(start + rows.shape[0], indices.org_vocab_end_index)
        if low < high:
            offset = indices.org_vocab_start_index
            weight[low - offset:high - offset].copy_(rows[low - start:high - start])
