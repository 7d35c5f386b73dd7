"""Run the real SGLang 0.5.23 on a machine without CUDA (the CPU tier).

Owns: the stand-in modules for SGLang's CUDA-only imports, the environment SGLang's processes need on
CPU, and the Engine shims that keep a host process safe (`start_engine`, `close_sockets`,
`contain_child_failures`): SGLang 0.5.23 kills its host when a child fails and leaks ZeroMQ
sockets that later hang the host's garbage collector. These are SGLang-version shims, not CPU-only.
Must not import: anything of ours above layer L1 (models, convert, rollout, data, trainer, cli).

What SGLang needs on CPU (measured with SGLang 0.5.23, torch 2.13.0+cpu):
- `SGLANG_USE_CPU_ENGINE=1` before sglang is imported: `sglang.srt.utils.is_cpu()` reads it and
  modules branch on it at import time (without it the rotary embedding imports `vllm`).
- `torchvision` is imported at module import time (`sglang/srt/multimodal/internvl_utils.py`, and
  transformers' image utilities once torchvision looks installed). PyPI torchvision cannot sit beside
  CPU torch 2.13, so a stand-in package answers every `torchvision.*` import; every attribute is a
  placeholder that raises `StandInCalledError` when called.
- `sgl_kernel` (SGLang's compiled kernels; the CPU build needs AMX) is imported for eight CPU names
  (`CPU_SGL_KERNEL_NAMES`) that plain text generation never calls. The stand-in offers exactly
  those, each raising when called; any other name raises ImportError so SGLang's own
  `try: from sgl_kernel import ... except ImportError` fallbacks stay in force.

Why stand-ins live in a folder on `sys.path` rather than in an SGLang plugin: SGLang's scheduler and
detokenizer are *spawned* processes that import `sglang.srt.managers.scheduler` (and with it
torchvision and sgl_kernel) while unpickling their target, before `load_plugins()` runs, so a
`sglang.srt.plugins` entry point comes too late. multiprocessing's spawn copies the parent's
`sys.path` into the child before unpickling, so a folder of stand-in packages put on the parent's
`sys.path` reaches the in-process Engine's children; a server started as a subprocess gets the same
folder through `PYTHONPATH` (`subprocess_env`).

Usage: call `install()` once, explicitly, before importing sglang (never as an import side effect).
On a machine with CUDA it does nothing: the real packages are used there.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import signal
import sys
import types
from pathlib import Path
from typing import Callable

from megatron_fp8rl.compat.process_env import without_torchrun_env
from megatron_fp8rl.compat.versions import expect, require

import torch

STANDIN_DIR = Path(__file__).resolve().parent / "sglang_cpu_standins"
CPU_SGL_KERNEL_NAMES = (
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "verify_tree_greedy_cpu",
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "build_tree_kernel_efficient_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
)
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}


class StandInCalledError(RuntimeError):
    """Code called into a CPU-tier stand-in for a CUDA-only package."""


class StandIn:
    """A placeholder for an attribute of a missing package: attribute access chains (so module-level
    constants such as `InterpolationMode.BICUBIC` resolve), calling it raises."""

    def __init__(self, qualname: str):
        self._qualname = qualname
        self._children: dict[str, StandIn] = {}

    def __getattr__(self, name: str) -> "StandIn":
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in self._children:
            self._children[name] = StandIn(f"{self._qualname}.{name}")
        return self._children[name]

    def __call__(self, *args, **kwargs):
        raise StandInCalledError(
            f"{self._qualname} was called, but it is a CPU-tier stand-in installed by "
            "megatron_fp8rl.compat.sglang_cpu: the real package is CUDA-only and not installed here"
        )

    def __repr__(self) -> str:
        return f"<CPU-tier stand-in {self._qualname}>"


def _lenient_getattr(module_name: str) -> Callable[[str], StandIn]:
    cache: dict[str, StandIn] = {}

    def __getattr__(name: str) -> StandIn:
        if name.startswith("__"):
            raise AttributeError(name)
        return cache.setdefault(name, StandIn(f"{module_name}.{name}"))

    return __getattr__


class _StandInSubmodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers `import <root>.<anything>` with a lenient stand-in module."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name, f"CPU-tier stand-in for {spec.name}")
        module.__path__ = []
        module.__getattr__ = _lenient_getattr(spec.name)
        return module

    def exec_module(self, module):
        return None


def make_lenient_package(namespace: dict) -> None:
    """Turn the package whose globals are `namespace` into a lenient stand-in: every submodule
    imports, every attribute is a `StandIn` (used for torchvision)."""
    root = namespace["__name__"]
    namespace["__getattr__"] = _lenient_getattr(root)
    if not any(isinstance(f, _StandInSubmodules) and f.root == root for f in sys.meta_path):
        sys.meta_path.append(_StandInSubmodules(root))


def make_strict_package(namespace: dict, names: tuple[str, ...]) -> None:
    """Give the package whose globals are `namespace` exactly `names`, each a raising `StandIn`;
    other names stay missing, so `from pkg import other` raises ImportError (used for sgl_kernel)."""
    for name in names:
        namespace[name] = StandIn(f"{namespace['__name__']}.{name}")


def needed() -> bool:
    """Whether this machine needs the stand-ins (no CUDA device)."""
    return not torch.cuda.is_available()


def install() -> bool:
    """Put the stand-in folder first on `sys.path` and set `CPU_ENV` in `os.environ`, so this
    process and SGLang's spawned children import the stand-ins. Returns False (and does nothing)
    on a machine with CUDA. Raises if sglang was imported before, with CPU mode off."""
    if not needed():
        return False
    _check_version()
    if "sglang.srt.utils.common" in sys.modules and os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        raise RuntimeError(
            "sglang was imported before megatron_fp8rl.compat.sglang_cpu.install(): its CPU mode "
            "(SGLANG_USE_CPU_ENGINE=1) is decided at import time; call install() first"
        )
    if str(STANDIN_DIR) not in sys.path:
        sys.path.insert(0, str(STANDIN_DIR))
    os.environ.update(CPU_ENV)
    return True


def subprocess_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for an SGLang server subprocess: `base` (default os.environ) plus, on the CPU
    tier, `CPU_ENV` and the stand-in folder first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    if needed():
        env.update(CPU_ENV)
        paths = [str(STANDIN_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _check_version() -> None:
    require("sglang")


def start_engine(kwargs: dict):
    """`sglang.Engine(**kwargs)` that, when start-up fails, closes the ZeroMQ sockets its
    half-built tokenizer manager opened. SGLang 0.5.23 drops that manager with its sockets open;
    when the garbage collector later finalizes their context, `zmq.Context.term()` blocks forever
    (seen: a later Engine's start-up hung in `Context.__del__`)."""
    from sglang.srt.entrypoints.engine import Engine, init_tokenizer_manager

    expect(Engine, "init_tokenizer_manager_func", dist="sglang",
           params=("server_args", "port_args", "TokenizerManagerClass"))
    expect(Engine, "run_scheduler_process_func", dist="sglang")
    created = []

    def recording_init(server_args, port_args):
        manager, template_manager = init_tokenizer_manager(server_args, port_args)
        created.append(manager)
        return manager, template_manager

    class _Engine(Engine):
        init_tokenizer_manager_func = staticmethod(recording_init)

    if needed():  # seeded sampling on CPU (deterministic inference): compat/sglang_cpu_sampling.py
        from megatron_fp8rl.compat import sglang_cpu_sampling

        sglang_cpu_sampling.allow_torch_native_deterministic()
        _Engine.run_scheduler_process_func = staticmethod(sglang_cpu_sampling.cpu_scheduler_process)

    try:
        with without_torchrun_env():  # the scheduler must not join a torchrun rendezvous
            return _Engine(**kwargs)
    except BaseException:
        for manager in created:
            close_sockets(manager)
        raise


def close_sockets(*owners) -> None:
    """Destroy, with linger 0, the ZeroMQ contexts behind the sockets SGLang's Engine and tokenizer
    manager hold (`send_to_rpc`, `recv_from_detokenizer`, `send_to_scheduler`), so finalizing them
    never blocks on messages to a dead peer."""
    import zmq

    for owner in owners:
        for attr in ("send_to_rpc", "recv_from_detokenizer", "send_to_scheduler"):
            sock = getattr(owner, attr, None)
            if isinstance(sock, zmq.Socket) and not sock.closed:
                sock.context.destroy(linger=0)


def contain_child_failures(engine, on_failure: Callable[[], None]) -> None:
    """Keep a failing SGLang child from killing this process.

    SGLang 0.5.23's children send SIGQUIT to the process that started them when they fail; the
    in-process Engine answers by killing its whole process tree *including itself* (the launch-phase
    handler, and `TokenizerManager`'s running-phase handler installed on the first request). Here
    both are replaced by `on_failure`, which is called from the engine's event loop; it should mark
    the engine dead and stop the loop so the pending call returns.
    SIGTERM stays the host's: on the first request `TokenizerManager` moves SIGTERM onto its event
    loop (asyncio's add_signal_handler replaces the host's Python handler) with a handler that only
    drains requests, so a host told to stop never heard of it. Here that handler does nothing when
    the host had a handler of its own (the host re-installs it after the first request; see
    trainer/stop.py), and otherwise restores the default action: terminate.
    """
    manager = engine.tokenizer_manager
    handler_class = expect(manager, "signal_handler_class", dist="sglang")
    for name in ("running_phase_sigquit_handler", "sigterm_handler"):
        expect(handler_class, name, dist="sglang", params=("self", "signum", "frame"))

    class _ContainedSignalHandler(handler_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.host_sigterm = signal.getsignal(signal.SIGTERM)  # before the loop takes SIGTERM over

        def running_phase_sigquit_handler(self, signum=None, frame=None):
            on_failure()

        def sigterm_handler(self, signum=None, frame=None):
            if callable(self.host_sigterm):
                return
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    manager.signal_handler_class = _ContainedSignalHandler
    signal.signal(signal.SIGQUIT, lambda signum, frame: on_failure())
