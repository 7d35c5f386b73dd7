"""Reward functions and scoring with failure accounting.

Owns: the built-in rewards (math-verify answer equivalence, last-number match), loading a user
reward function from a dotted path, and scoring a batch so that a reward that raises, times out or
returns a non-finite value scores 0 and is counted instead of crashing the run.
Must not import: models, convert, rollout, trainer, cli.

A reward function is `fn(response: str, answer: str) -> float`.
"""
from __future__ import annotations

import concurrent.futures as futures
import importlib
import math
import re
from dataclasses import dataclass
from typing import Callable

RewardFn = Callable[[str, str], float]
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 when math-verify finds the response's first extracted answer equivalent to `answer`.

    Extraction is math-verify's default (LaTeX and plain expressions); the response side uses
    `first_match` so listing several candidates earns nothing. Timeouts are handled by the scorer
    (math-verify's own use signal alarms, which only work on the main thread).
    """
    from math_verify import parse, verify

    gold = parse(answer, parsing_timeout=None)
    predicted = parse(response, extraction_mode="first_match", parsing_timeout=None)
    return 1.0 if gold and predicted and verify(gold, predicted, timeout_seconds=None) else 0.0


def last_number_reward(response: str, answer: str) -> float:
    """1.0 when the last number in the response equals the numeric `answer` (the demo's rule)."""
    numbers = _NUMBER.findall(response.replace(",", ""))
    if not numbers:
        return 0.0
    try:
        return 1.0 if float(numbers[-1]) == float(answer) else 0.0
    except ValueError:
        return 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math_verify": math_verify_reward,
    "last_number": last_number_reward,
}


def load_reward_fn(spec: str) -> RewardFn:
    """A built-in name, or a user function as 'package.module:function' / 'package.module.function'."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"reward {spec!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) "
                         "nor a dotted path 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


@dataclass
class RewardStats:
    """How a batch of reward calls went."""

    scored: int = 0
    """Calls that returned a finite number."""
    errors: int = 0
    """Calls that raised (scored 0)."""
    timeouts: int = 0
    """Calls that did not finish within the timeout (scored 0)."""
    invalid: int = 0
    """Calls that returned a non-number or a non-finite value (scored 0)."""
    first_error: str = ""
    """The first failure's message, for the log."""


def score(fn: RewardFn, responses: list[str], answers: list[str], timeout_s: float = 10.0,
          workers: int = 4) -> tuple[list[float], RewardStats]:
    """Rewards for each (response, answer) pair; failures score 0 and are counted in the stats.

    Calls run in a thread pool. A call that times out cannot be interrupted (Python threads
    cannot be killed): it is abandoned and scored 0; the pool does not wait for it.
    """
    if len(responses) != len(answers):
        raise ValueError(f"responses ({len(responses)}) and answers ({len(answers)}) differ in length")
    stats, rewards = RewardStats(), []
    pool = futures.ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="reward")
    try:
        pending = [pool.submit(fn, r, a) for r, a in zip(responses, answers)]
        for future in pending:
            rewards.append(_collect(future, timeout_s, stats))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return rewards, stats


def _collect(future: futures.Future, timeout_s: float, stats: RewardStats) -> float:
    try:
        value = future.result(timeout=timeout_s)
    except futures.TimeoutError:
        stats.timeouts += 1
        stats.first_error = stats.first_error or f"reward timed out after {timeout_s} s"
        return 0.0
    except Exception as exc:  # a user reward may raise anything; it must not end the run
        stats.errors += 1
        stats.first_error = stats.first_error or f"reward raised {type(exc).__name__}: {exc}"
        return 0.0
    try:
        value = float(value)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        stats.invalid += 1
        stats.first_error = stats.first_error or "reward returned a non-finite or non-numeric value"
        return 0.0
    stats.scored += 1
    return value
