"""Prompt sampling resumes exactly where it stopped."""
import pytest

from megatron_fp8rl.data.arithmetic import arithmetic_records
from megatron_fp8rl.data.sampler import PromptSampler

RECORDS = arithmetic_records("train", 10, seed=0)


def test_epochs_cover_dataset_and_reshuffle():
    sampler = PromptSampler(RECORDS, batch_size=5, seed=3)
    epoch0 = sampler.next_batch() + sampler.next_batch()
    epoch1 = sampler.next_batch() + sampler.next_batch()
    assert sorted(r.id for r in epoch0) == sorted(r.id for r in RECORDS) == sorted(r.id for r in epoch1)
    assert [r.id for r in epoch0] != [r.id for r in epoch1]


def test_resume_continues_identically():
    uninterrupted = PromptSampler(RECORDS, batch_size=3, seed=1)
    expected = [[r.id for r in uninterrupted.next_batch()] for _ in range(7)]
    first = PromptSampler(RECORDS, batch_size=3, seed=1)
    got = [[r.id for r in first.next_batch()] for _ in range(4)]
    resumed = PromptSampler(RECORDS, batch_size=3, seed=1)
    resumed.load_state_dict(first.state_dict())
    got += [[r.id for r in resumed.next_batch()] for _ in range(3)]
    assert got == expected


def test_bad_batch_size_and_foreign_state():
    with pytest.raises(ValueError, match=r"batch_size 11 must be in \[1, 10\]"):
        PromptSampler(RECORDS, batch_size=11)
    state = PromptSampler(RECORDS, batch_size=2, seed=1).state_dict()
    with pytest.raises(ValueError, match="sampler state is for 10 records with seed 1"):
        PromptSampler(RECORDS, batch_size=2, seed=2).load_state_dict(state)
