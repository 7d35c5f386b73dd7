"""Reward functions and scoring with failure accounting.

Owns: the built-in rewards (math-verify answer equivalence, last-number match), loading a user
reward function from a dotted path, and scoring a batch in a bounded pool of worker processes so
that a reward that raises, times out or returns a non-finite value scores 0 and is counted instead
of crashing the run, a hung reward cannot keep the process alive nor outlive it (kill -9
included), and a batch in which every call
failed stops the run with the first failure's text.
Must not import: convert, rollout, trainer, cli.

A reward function is `fn(response: str, answer: str) -> float`.
"""
from __future__ import annotations

import importlib
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

import psutil

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


class RewardError(RuntimeError):
    """Every reward call of a batch failed: the run would learn from nothing."""


def _call(fn: RewardFn, response: str, answer: str, connection, trainer_pid: int) -> None:
    """Runs in a worker process: sends (outcome, value-or-message), outcome one of ok, error,
    invalid. Exits as soon as the process that started it (`trainer_pid`) is gone."""
    _exit_with(trainer_pid)
    try:
        value = fn(response, answer)
    except Exception as exc:  # a user reward may raise anything; it must not end the run
        connection.send(("error", f"reward raised {type(exc).__name__}: {exc}"))
        return
    try:
        value = float(value)
    except (TypeError, ValueError):
        value = math.nan
    connection.send(("ok", value) if math.isfinite(value)
                    else ("invalid", "reward returned a non-finite or non-numeric value"))


def _exit_with(pid: int, every_s: float = 0.2) -> None:
    """End this worker (os._exit) within `every_s` of process `pid` dying, however it died.
    PR_SET_PDEATHSIG cannot do it: a worker's parent is multiprocessing's forkserver, not the
    trainer, and the forkserver stays up while any worker holds its liveness pipe, so a hung worker
    kept it (and itself) alive after a kill -9 of the trainer. A thread watches the trainer instead."""
    try:
        trainer = psutil.Process(pid)
    except psutil.NoSuchProcess:
        os._exit(1)

    def watch() -> None:
        while _alive(trainer):
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-trainer", daemon=True).start()


def _alive(process: psutil.Process) -> bool:
    """Running and not a zombie (a killed trainer its parent has not reaped yet is gone too)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _context(fn: RewardFn):
    """multiprocessing's forkserver: workers fork from a clean single-threaded server (forking the
    trainer itself, with its gloo/ZMQ threads, can deadlock the child), with the reward's module
    preloaded so each call starts in milliseconds."""
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(f"reward function {fn!r} must be a module-level function (it runs in worker "
                         f"processes): {exc}") from None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, fn.__module__])
    return context


def score(fn: RewardFn, responses: list[str], answers: list[str], timeout_s: float = 10.0,
          workers: int = 4) -> tuple[list[float], RewardStats]:
    """Rewards for each (response, answer) pair; failures score 0 and are counted in the stats.
    RewardError (with the first failure's text) when every call failed.

    Each call runs in its own worker process, at most `workers` at once, timed from its own start;
    one still running after `timeout_s` is killed (whatever it is stuck in) and scored 0, so a hung
    reward cannot hold up the batch beyond its timeout or keep the process alive.
    """
    if len(responses) != len(answers):
        raise ValueError(f"responses ({len(responses)}) and answers ({len(answers)}) differ in length")
    if not timeout_s > 0:
        raise ValueError(f"reward timeout must be > 0 s, got {timeout_s}")
    context, outcomes = _context(fn), [None] * len(responses)
    queue, running = list(enumerate(zip(responses, answers))), {}
    try:
        while queue or running:
            while queue and len(running) < max(1, workers):
                index, (response, answer) = queue.pop(0)
                receiver, sender = context.Pipe(duplex=False)
                process = context.Process(target=_call, args=(fn, response, answer, sender, os.getpid()),
                                          daemon=True)
                process.start()
                sender.close()
                running[index] = (process, receiver, time.monotonic() + timeout_s)
            _reap(running, outcomes, timeout_s)
    finally:
        for process, _, _ in running.values():
            process.kill()
    return _tally(outcomes)


def _reap(running: dict, outcomes: list, timeout_s: float) -> None:
    """Wait until a running call ends or reaches its deadline; record and drop those that did."""
    soonest = min(deadline for _, _, deadline in running.values())
    multiprocessing.connection.wait([r for _, r, _ in running.values()],
                                    timeout=max(0.0, soonest - time.monotonic()))
    for index, (process, receiver, deadline) in list(running.items()):
        if receiver.poll():
            try:
                outcomes[index] = receiver.recv()
            except EOFError:  # the worker died without answering
                outcomes[index] = ("error", f"reward worker exited with code {process.exitcode}")
        elif time.monotonic() >= deadline:
            outcomes[index] = ("timeout", f"reward timed out after {timeout_s} s")
        else:
            continue
        process.kill()
        process.join()
        receiver.close()
        del running[index]


def _tally(outcomes: list[tuple[str, object]]) -> tuple[list[float], RewardStats]:
    stats, rewards = RewardStats(), []
    for outcome, value in outcomes:
        if outcome == "ok":
            stats.scored += 1
            rewards.append(value)
            continue
        field = {"error": "errors", "timeout": "timeouts", "invalid": "invalid"}[outcome]
        setattr(stats, field, getattr(stats, field) + 1)
        stats.first_error = stats.first_error or str(value)
        rewards.append(0.0)
    if outcomes and stats.scored == 0:
        raise RewardError(f"all {len(outcomes)} reward calls failed ({stats.errors} raised, "
                          f"{stats.timeouts} timed out, {stats.invalid} invalid); first: {stats.first_error}")
    return rewards, stats
