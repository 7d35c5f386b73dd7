"""`python -m megatron_fp8rl.rollout.sglang_launch <sglang server flags>`: SGLang's HTTP server, as
`python -m sglang.launch_server` starts it, plus on the CPU tier what seeded sampling needs there
(compat.sglang_cpu_sampling): `SGLangServer` starts this module in its child process.

Owns: that entry point only. Must not import: convert, data, trainer, cli.
"""
from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> None:
    from megatron_fp8rl.compat import sglang_cpu, sglang_cpu_sampling, versions

    versions.gate(os.environ)
    on_cpu = sglang_cpu.install()  # the parent's environment already selects the stand-ins
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.managers.scheduler import run_scheduler_process
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    scheduler = run_scheduler_process
    if on_cpu:
        sglang_cpu_sampling.allow_torch_native_deterministic()
        scheduler = sglang_cpu_sampling.cpu_scheduler_process
    load_plugins()
    server_args = prepare_server_args(argv)
    try:
        server_args.resolve_once()
        launch_server(server_args, run_scheduler_process_func=scheduler)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
