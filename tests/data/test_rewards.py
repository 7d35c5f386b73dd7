"""Rewards: math-verify and last-number rules; user functions by dotted path; failures score 0."""
import math
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_fp8rl.data.rewards import (
    RewardError, last_number_reward, load_reward_fn, math_verify_reward, score,
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


def _flaky(response: str, answer: str) -> float:
    if response == "raise":
        raise RuntimeError("boom")
    if response == "hang":
        time.sleep(30)
    if response == "nan":
        return math.nan
    if response == "text":
        return "high"
    return 1.0


def test_failures_score_zero_and_are_counted():
    start = time.perf_counter()
    rewards, stats = score(_flaky, ["ok", "raise", "hang", "nan", "text", "ok"], ["1"] * 6, timeout_s=0.5)
    assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert (stats.scored, stats.errors, stats.timeouts, stats.invalid) == (2, 1, 1, 2)
    assert "RuntimeError: boom" in stats.first_error
    assert time.perf_counter() - start < 10


def test_a_closure_is_refused_by_name():
    with pytest.raises(ValueError, match="must be a module-level function"):
        score(lambda response, answer: 1.0, ["1"], ["1"])


@pytest.mark.slow
def test_calls_run_concurrently_each_timed_from_its_own_start():
    """8 calls of 2 s on 4 workers with a 3 s timeout: none times out (each is timed alone; timed
    from the batch start, the second wave would end at 4 s). 4 calls that hang time out together
    after ~3 s, not one after another. 1 s of margin: when an earlier test started multiprocessing's
    forkserver, this module is not preloaded and each worker imports it (~0.5 s on a loaded box).
    Slow: ~7 s of waiting is the property (two 2 s waves, then a 3 s timeout)."""
    rewards, stats = score(_sleep_then_one, ["2"] * 8, ["1"] * 8, timeout_s=3.0, workers=4)
    assert rewards == [1.0] * 8 and stats.timeouts == 0
    start = time.perf_counter()
    rewards, stats = score(_sleep_then_one, ["60"] * 4 + ["0"], ["1"] * 5, timeout_s=3.0, workers=4)
    assert stats.timeouts == 4 and rewards[-1] == 1.0
    assert time.perf_counter() - start < 8.0  # one after another: over 12 s


def _sleep_then_one(response: str, answer: str) -> float:
    time.sleep(float(response))
    return 1.0


def _ignores_alarm(response: str, answer: str) -> float:
    """A reward stuck where its alarm cannot reach it."""
    deadline = time.monotonic() + 600
    while response == "stuck" and time.monotonic() < deadline:
        try:
            time.sleep(600)
        except BaseException:  # swallows whatever the timeout raises
            pass
    return 1.0


def test_a_reward_that_ignores_its_timeout_is_killed():
    import multiprocessing

    before = set(multiprocessing.active_children())
    start = time.perf_counter()
    rewards, stats = score(_ignores_alarm, ["stuck", "fine"], ["1", "1"], timeout_s=0.5, workers=2)
    assert rewards == [0.0, 1.0] and stats.timeouts == 1
    assert "timed out after 0.5 s" in stats.first_error
    assert time.perf_counter() - start < 15
    assert set(multiprocessing.active_children()) <= before  # the stuck worker is gone


@pytest.mark.multiprocess
def test_a_hung_reward_cannot_keep_the_process_alive(tmp_path):
    """The reported case: the summary printed, then the process never exited."""
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parents[2])!r})\n"
              "from megatron_fp8rl.data.rewards import score\n"
              "from tests.data.test_rewards import _ignores_alarm\n"
              "print(score(_ignores_alarm, ['stuck', 'fine'], ['1', '1'], timeout_s=0.5)[0])\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[0.0, 1.0]"


def _touch_then_hang(response: str, answer: str) -> float:
    """Marks its start by creating the file `response`, then hangs like `_ignores_alarm`."""
    Path(response).touch()
    return _ignores_alarm("stuck", answer)


@pytest.mark.multiprocess
def test_a_hung_reward_dies_with_its_killed_parent(tmp_path):
    """kill -9 of the scoring process (the trainer): its hung reward worker, a grandchild under
    multiprocessing's forkserver, must not outlive it (it used to, for the reward's full hang)."""
    started = tmp_path / "started"
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parents[2])!r})\n"
              "from megatron_fp8rl.data.rewards import score\n"
              "from tests.data.test_rewards import _touch_then_hang\n"
              f"score(_touch_then_hang, [{str(started)!r}], ['1'], timeout_s=600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not started.exists() and parent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), "the reward never started"
    descendants = psutil.Process(parent.pid).children(recursive=True)
    parent.kill()
    parent.wait()
    _, alive = psutil.wait_procs(descendants, timeout=5)
    alive = [p for p in alive if _running(p)]  # a zombie is dead: only its reaping is left
    for process in alive:
        process.kill()
    assert not alive, f"outlived the killed parent: {alive}"


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_every_call_failing_stops_with_the_first_error():
    with pytest.raises(RewardError, match=r"all 3 reward calls failed \(3 raised, 0 timed out, 0 invalid\); "
                                          r"first: reward raised RuntimeError: boom"):
        score(_raises, ["a", "b", "c"], ["1"] * 3)


def _raises(response: str, answer: str) -> float:
    raise RuntimeError("boom")


@pytest.mark.parametrize("timeout_s", [0, -1.0, math.nan])
def test_timeout_must_be_positive(timeout_s):
    with pytest.raises(ValueError, match="reward timeout must be > 0 s"):
        score(last_number_reward, ["1"], ["1"], timeout_s=timeout_s)


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"responses \(2\) and answers \(1\)"):
        score(last_number_reward, ["a", "b"], ["1"])
