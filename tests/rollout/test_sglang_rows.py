"""The row-chunk loader's key format and refusals (no SGLang process: the loader is plain torch;
the rows it loads into a served model are tested in test_sglang_engine.py)."""
import pytest
import torch

from megatron_fp8rl.rollout.sglang_rows import load_vocab_rows, parse_row_key, row_key


def test_row_key_round_trips_and_other_names_are_refused():
    assert parse_row_key(row_key("model.embed_tokens.weight", 4096)) == ("model.embed_tokens.weight", 4096)
    for bad in ("model.embed_tokens.weight", "model.embed_tokens.weight@rows=", "lm_head.weight@rows=-3"):
        with pytest.raises(ValueError, match="is not a row chunk key"):
            parse_row_key(bad)


def test_a_weight_without_vocabulary_shards_is_refused_by_name():
    """A chunk named after a module that is not vocabulary-parallel (no shard_indices) is refused
    before anything is copied."""
    model = torch.nn.Module()
    model.norm = torch.nn.LayerNorm(4)
    before = model.norm.weight.detach().clone()
    with pytest.raises(ValueError, match="'norm.weight' is not a vocabulary-parallel weight"):
        load_vocab_rows(model, [(row_key("norm.weight", 0), torch.zeros(1, 4))])
    assert torch.equal(model.norm.weight.detach(), before)
