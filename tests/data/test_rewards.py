"""Rewards: math-verify and last-number rules; user functions by dotted path; failures score 0."""
import math
import threading
import time

import pytest

from megatron_fp8rl.data.rewards import (
    last_number_reward, load_reward_fn, math_verify_reward, score,
)


@pytest.mark.parametrize("response, answer, expected", [
    ("The answer is 47.", "47", 1.0),
    ("12+35 = 50", "47", 0.0),
    (r"So the result is $\frac{1}{2}$", "0.5", 1.0),
    (r"\boxed{3/4}", r"\frac{3}{4}", 1.0),
    ("no idea", "47", 0.0),
])
def test_math_verify_reward(response, answer, expected):
    assert math_verify_reward(response, answer) == expected


@pytest.mark.parametrize("response, answer, expected", [
    ("47", "47", 1.0), ("It is 40, no, 47", "47", 1.0), ("47 or 48", "47", 0.0),
    ("-12", "-12", 1.0), ("1,234", "1234", 1.0), ("", "1", 0.0),
])
def test_last_number_reward(response, answer, expected):
    assert last_number_reward(response, answer) == expected


def user_reward_length(response: str, answer: str) -> float:
    return float(len(response))


def test_load_builtin_and_dotted():
    assert load_reward_fn("last_number") is last_number_reward
    assert load_reward_fn(f"{__name__}:user_reward_length")("abc", "") == 3.0
    assert load_reward_fn(f"{__name__}.user_reward_length")("ab", "") == 2.0
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        load_reward_fn("no_such_module:f")
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        load_reward_fn(f"{__name__}:missing")


def test_failures_score_zero_and_are_counted():
    release = threading.Event()

    def flaky(response: str, answer: str) -> float:
        if response == "raise":
            raise RuntimeError("boom")
        if response == "hang":
            release.wait(30)
        if response == "nan":
            return math.nan
        if response == "text":
            return "high"
        return 1.0

    start = time.perf_counter()
    rewards, stats = score(flaky, ["ok", "raise", "hang", "nan", "text", "ok"], ["1"] * 6, timeout_s=0.5)
    release.set()
    assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert (stats.scored, stats.errors, stats.timeouts, stats.invalid) == (2, 1, 1, 2)
    assert "RuntimeError: boom" in stats.first_error
    assert time.perf_counter() - start < 10


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"responses \(2\) and answers \(1\)"):
        score(last_number_reward, ["a", "b"], ["1"])
