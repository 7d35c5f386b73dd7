"""Stopping a run when told: SIGTERM (Slurm, Kubernetes, `timeout`) or SIGINT (Ctrl-C).

Owns: `StopSignals`, a context manager that replaces the process's SIGTERM/SIGINT handlers (the
in-process SGLang engine installs one that ignores SIGTERM) by one that only records the signal,
and `StopRequested`, raised by the loop once the current step is done and a checkpoint written.
A second signal abandons the step at once (KeyboardInterrupt). Ranks act on global rank 0's
record (torchrun forwards the signal to every worker), so all stop after the same step.
Must not import: cli.
"""
from __future__ import annotations

import signal

import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(Exception):
    """The run was told to stop; it saved a checkpoint after `step` and exits non-zero."""

    def __init__(self, signum: int, step: int, checkpoint):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; "
                         f"checkpoint {checkpoint} (rerun the same command to resume)")


class StopSignals:
    """`with StopSignals() as stops:` ... `stops.agreed()` after each step."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _record(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: abandoning the step")
        self.signum = signum

    def __enter__(self) -> "StopSignals":
        self._previous = {sig: signal.signal(sig, self._record) for sig in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def agreed(self) -> int | None:
        """Collective: the signal global rank 0 received, if any. Re-installs the handlers: the
        in-process SGLang engine takes SIGTERM over on its first request (compat/sglang_cpu.py)."""
        for sig in SIGNALS:
            signal.signal(sig, self._record)
        box = [self.signum]
        dist.broadcast_object_list(box, src=0)
        return box[0]
