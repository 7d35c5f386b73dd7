"""CPU-tier stand-in for sgl_kernel (see megatron_fp8rl/compat/sglang_cpu.py).

Imported as the top-level package `sgl_kernel` only when `megatron_fp8rl.compat.sglang_cpu.install()`
put this folder on sys.path. Offers only the CPU kernel names SGLang imports on the CPU tier, each
raising when called; other names raise ImportError so SGLang keeps its own fallbacks.
Must not import: anything of ours except megatron_fp8rl.compat.sglang_cpu.
"""
from megatron_fp8rl.compat import sglang_cpu

__version__ = "0.0.0+megatron_fp8rl.standin"
sglang_cpu.make_strict_package(globals(), sglang_cpu.CPU_SGL_KERNEL_NAMES)
