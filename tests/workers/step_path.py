"""torchrun worker: `megatron-fp8rl train` (cli.main, unchanged) with the actor's optimizer
instrumented: at every `optimizer.step()` it records which functions of the package are on the
stack, outermost first, as `path/in/package.py:qualified.name`. Rank 0 writes the list of stacks
as JSON to the first argument; the others are `train`'s.

    torchrun ... tests/workers/step_path.py OUT.json train KEY=VALUE ...

The package is imported under the main guard only: the reward workers (forkserver children)
re-import this module, and a heavy import there times their first reward out.
"""
import json
import os
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_fp8rl"


def _package_stack() -> list[str]:
    """The package's frames on the caller's stack, outermost first."""
    frames, frame = [], sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if path.is_relative_to(PACKAGE):
            frames.append(f"{path.relative_to(PACKAGE)}:{frame.f_code.co_qualname}")
        frame = frame.f_back
    return frames[::-1]


def _recording(build_optimizer, stacks: list):
    """`build_optimizer` whose optimizers append `_package_stack()` to `stacks` on each step."""

    def build(model, cfg):
        optimizer = build_optimizer(model, cfg)
        step = optimizer.step

        def recorded_step(*args, **kwargs):
            stacks.append(_package_stack())
            return step(*args, **kwargs)

        optimizer.step = recorded_step
        return optimizer

    return build


if __name__ == "__main__":
    from megatron_fp8rl import cli
    from megatron_fp8rl.trainer import actor

    out, argv = Path(sys.argv[1]), sys.argv[2:]
    stacks: list[list[str]] = []
    actor.build_optimizer = _recording(actor.build_optimizer, stacks)
    code = cli.main(argv)
    if os.environ.get("RANK", "0") == "0":
        out.write_text(json.dumps(stacks))
    sys.exit(code)
