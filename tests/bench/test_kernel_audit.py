"""The static kernel audit (bench/kernel_audit.py): every Triton kernel variant the device FP8 path
can launch compiles for sm_90 with a real launch's specialization, with no spill and with wgmma
where wgmma is meant; the audit's parsers and occupancy arithmetic against hand-worked values; and
the audit itself fails a spilling launch and a kernel whose constexprs a launch cannot see.
Compiles ~100 variants with triton's compiler and ptxas (no GPU; triton's cache and the audit's
report cache make a second run take seconds)."""
import os
import types

import pytest
import torch
import triton

from bench import kernel_audit
from megatron_fp8rl.fp8 import triton_quantize
from megatron_fp8rl.fp8.formats import E4M3

SASS = """
        /*1780*/                   DEPBAR.LE SB0, 0x2 ;                                /* 0x0 */
        /*1a90*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT ;  /* 0x0 */
        /*1b10*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                     /* 0x0 */
        /*1b20*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;                     /* 0x0 */
        /*24f0*/               @P5 BRA 0x1780 ;                                        /* 0x0 */
        /*2500*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                     /* 0x0 */
        /*2510*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;               /* 0x0 */
        /*49c0*/                   BRA 0x49c0;                                         /* 0x0 */
"""
PTXAS = """ptxas-blackwell info    : Compiling entry function '_k' for 'sm_90a'
ptxas-blackwell info    : Function properties for _k
    8 bytes stack frame, 976 bytes spill stores, 1320 bytes spill loads
ptxas-blackwell info    : Used 64 registers, used 1 barriers
ptxas-blackwell info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized
"""


@pytest.fixture
def compiled_mode():
    """Triton's compiler, not its interpreter, whatever TRITON_INTERPRET says."""
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        yield


def test_parsers_read_ptxas_and_the_sass():
    assert kernel_audit.parse_ptxas(PTXAS) == dict(registers=64, spill_stores=976, spill_loads=1320,
                                                   advisories="C7515")
    # one QGMMA (wgmma), one HMMA (mma.sync); of the two waits for all wgmma, one lies in the loop
    # 0x1780..0x24f0 (the backward branch); the self-branch at the end is the kernel's trap
    assert kernel_audit.parse_sass(SASS) == dict(wgmma=1, mma_sync=1, wait_all=1)
    with pytest.raises(ValueError, match="without a register / spill line"):
        kernel_audit.parse_ptxas("ptxas fatal : Unsupported .version 9.4")


@pytest.mark.parametrize("registers,shared,warps,ctas", [
    (178, 73728, 4, 2),  # 23 * 256 registers per warp: 11 warps of registers, 2 CTAs of 4 warps
    (64, 32, 16, 2),  # 2048 registers per warp: 32 warps; 2048 threads: 4 CTAs; registers bind at 2
    (40, 0, 4, 12),  # 1280 registers per warp: 51 warps -> 12 CTAs of 4 (threads would allow 16)
    (32, 0, 1, 32),  # the 32-CTA limit
    (32, 114 * 1024, 4, 1),  # shared memory: 228 KB / (114 KB + 1 KB)
])
def test_ctas_per_sm_follow_h100_limits(registers, shared, warps, ctas):
    assert kernel_audit.ctas_per_sm(registers, shared, warps) == ctas


def test_the_audit_fails_a_spilling_launch(compiled_mode):
    """The column-wise 1x128 quantization with its 128x128 tile held whole over 4 warps: the launch
    that spilled before the kernels walked their tiles in slabs over more warps."""
    quantize, _ = triton_quantize._kernels(False)
    x = torch.empty(8192, 4096, dtype=torch.bfloat16, device="meta")
    counts = torch.empty(5, dtype=torch.int64, device="meta")
    *_, args, options = triton_quantize.quantize_launch(x, E4M3, "group", block=128, colwise=True, counts=counts)
    options.update(SLAB_M=128, num_warps=4)
    report = kernel_audit.audit(kernel_audit.Launch("squeezed", "x 8192x4096", quantize, args, options))
    assert report.spill_stores > 0 and report.problems() == [
        f"squeezed: spills {report.spill_stores} B stored / {report.spill_loads} B loaded per thread"]


def test_the_audit_compiles_as_a_launch_does(compiled_mode):
    """A kernel copied without its annotations (what fp8/triton_quantize.py, triton_gemm.py and
    triton_scaling.py did before: every launch on a GPU failed to compile) fails here as it would at its first launch;
    a compile from a hand-written signature would not notice."""
    _, amax = triton_quantize._kernels(False)
    code = amax.fn
    bare = triton.jit(types.FunctionType(code.__code__, code.__globals__, code.__name__))
    *_, args, options = triton_quantize.amax_launch(torch.empty(64, 256, device="meta"), rows=True)
    with pytest.raises(triton.compiler.CompilationError, match="must be of type tl.constexpr"):
        kernel_audit.audit(kernel_audit.Launch("bare", "x 64x256", bare, args, options))


def test_every_device_path_kernel_variant_compiles_for_sm90_without_spills_or_mma_sync():
    reports, seconds = kernel_audit.run(jobs=os.cpu_count() or 1)
    print(f"{len(reports)} variants audited in {seconds:.0f} s")
    kernels = {report.name.split()[0] for report in reports}
    assert kernels == {"quantize", "amax", "scaling", "gemm"}
    assert [problem for report in reports for problem in report.problems()] == []
    gemms = [report for report in reports if report.wgmma_expected]
    assert gemms and all(report.wgmma > 0 and report.mma_sync == 0 for report in gemms)
