"""CPU-tier stand-in for torchvision (see megatron_fp8rl/compat/sglang_cpu.py).

Imported as the top-level package `torchvision` only when `megatron_fp8rl.compat.sglang_cpu.install()`
put this folder on sys.path. Every submodule imports and every attribute raises when called.
Must not import: anything of ours except megatron_fp8rl.compat.sglang_cpu.
"""
from megatron_fp8rl.compat import sglang_cpu

__version__ = "0.0.0+megatron_fp8rl.standin"
sglang_cpu.make_lenient_package(globals())
