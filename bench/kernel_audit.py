"""Static audit of every Triton kernel variant the device FP8 path can launch, for Hopper (sm_90),
without a GPU (issue 64 item 5).

Each variant is compiled as a real launch compiles it: the launch site's own argument builder
(fp8/triton_quantize.py `quantize_launch` / `amax_launch`, fp8/triton_scaling.py `scaling_launch`,
fp8/triton_gemm.py `gemm_launch`)
is called on meta tensors of Qwen3-8B shapes (an allocation on the meta device starts at address
0, 16-byte aligned like a fresh CUDA allocation), triton's own binder turns those arguments into
the signature, the constexprs and the tt.divisibility attributes (pointers, and integers divisible
by 16), and `triton.compile` targets GPUTarget("cuda", 90, 32) with the launch's num_warps /
num_stages. Two token counts per launch site (8192, and 50: an RL micro-batch padded to its longest
sample) give the integer specializations real runs get; variants whose specialization coincides
are compiled once.
From each compile: ptxas -v on the PTX (triton's ptxas and flags, `--gpu-name sm_90a`) gives
registers per thread, spill stores / loads and its performance advisories (C7xxx codes: e.g. wgmma
serialized); triton's metadata gives the dynamic shared memory; cuobjdump -sass of the cubin
counts wgmma ([HQI]GMMA) and mma.sync ([HQI]MMA) instructions and the waits for every wgmma in
flight (`WARPGROUP.DEPBAR.LE gsb0, 0x0`) inside the K loop. CTAs per SM follow from H100 limits
(65536 registers allocated per warp in 256-register units, 228 KB shared memory with 1 KB reserved
per CTA, 2048 threads, 32 CTAs).

Compile time (120 variants, 2 processes, on the shared 2-core CPU box at load average 15-20): 530 s
wall and ~2 CPU minutes with triton's cache empty; 11-40 s once triton's cache and the audit's
report cache (`_assembler_reports`) hold them.
To audit a new kernel, add a function yielding `Launch`es to LAUNCH_SITES.
Run: python bench/kernel_audit.py [--out results/kernel_audit/sm90.md] [--jobs 2]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from megatron_fp8rl.fp8 import triton_gemm, triton_quantize, triton_scaling
from megatron_fp8rl.fp8.formats import E4M3, E5M2

TARGET_ARCH = 90
HIDDEN, TOKENS = 4096, (8192, 50)
"""Qwen3-8B's hidden size (the K of every quantized activation and the N of the GEMMs) and the
token counts whose alignments a launch is specialized for."""
H100 = dict(regs=65536, smem=228 * 1024, smem_per_cta_reserved=1024, threads=2048, ctas=32)
"""Per-SM limits of an H100 / H200 (CUDA occupancy calculator, compute capability 9.0)."""
OUT = Path(__file__).resolve().parents[1] / "results" / "kernel_audit" / "sm90.md"
COMMAND = "PYTHONPATH=. python bench/kernel_audit.py --out results/kernel_audit/sm90.md"
AUDIT_VERSION = 1
"""Part of the report cache's key (`_assembler_reports`): bump it when the parsers change."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch a launch site can make: `kernel` (triton.jit-wrapped, compiled mode) with the
    positional `args` and keyword `options` (constexprs, num_warps, num_stages) it passes."""
    name: str
    shape: str
    """The tensor shapes it was built for (which decide the integer specialization)."""
    kernel: object
    args: tuple
    options: dict
    wgmma: bool = False
    """Whether the kernel is meant to run on Hopper's wgmma tensor cores (the audit fails an
    mma.sync fallback)."""


@dataclasses.dataclass
class Report:
    """ptxas's and the SASS's account of one compiled variant."""
    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared: int
    warps: int
    stages: int
    ctas_per_sm: int
    wgmma: int
    mma_sync: int
    wait_all: int
    advisories: str
    wgmma_expected: bool
    seconds: float

    def problems(self) -> list[str]:
        """What the audit fails: spills, or an mma.sync fallback / no wgmma where wgmma is meant."""
        found = []
        if self.spill_stores or self.spill_loads:
            found.append(f"{self.name}: spills {self.spill_stores} B stored / {self.spill_loads} B loaded per thread")
        if self.wgmma_expected and (self.mma_sync or not self.wgmma):
            found.append(f"{self.name}: {self.wgmma} wgmma and {self.mma_sync} mma.sync instructions")
        return found


def _meta(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def quantize_launches() -> Iterator[Launch]:
    """Every `quantize_codes` launch fp8/device_quantize.py can make, for bf16 and fp32 inputs:
    given per-tensor scales (format x transposed copy x amax, statistics always counted), given
    per-row scales (device_quantize_rows), 1xG groups (G x column-wise copy) and GxG blocks (G x
    transposed copy), statistics on."""
    quantize, _ = triton_quantize._kernels(False)
    fmts, dtypes = (E4M3, E5M2), (torch.bfloat16, torch.float32)
    layouts = [("tensor", 128, dict(transposed=t, amax=a)) for t, a in itertools.product((False, True), repeat=2)]
    layouts.append(("row", 128, {}))
    layouts += [("group", g, dict(colwise=c)) for g, c in itertools.product((32, 128), (False, True))]
    layouts += [("block", g, dict(transposed=t)) for g, t in itertools.product((32, 128), (False, True))]
    for (scales, block, flags), fmt, dtype, tokens in itertools.product(layouts, fmts, dtypes, TOKENS):
        x = _meta(tokens, HIDDEN, dtype=dtype)
        given = {"tensor": _meta(()), "row": _meta(tokens)}.get(scales)
        counts = None if scales == "row" else _meta(len(triton_quantize.COUNTERS), dtype=torch.int64)
        *_, args, options = triton_quantize.quantize_launch(x, fmt, scales, given, block, counts=counts, **flags)
        label = " ".join([f"{scales}{block if scales in ('group', 'block') else ''}"]
                         + [name for name, on in flags.items() if on])
        yield Launch(f"quantize {label} {fmt.name} {str(dtype)[6:]}", f"x {tokens}x{HIDDEN}", quantize, args, options)


def amax_launches() -> Iterator[Launch]:
    """Every `row_bounds` launch: the plain amax pass per format name, and with the calibrated
    recipe's overflow count."""
    _, amax = triton_quantize._kernels(False)
    variants = ((True, False), (False, False), (False, True))  # (per row, overflow count)
    for fmt, (rows, overflow), dtype, tokens in itertools.product((E4M3, E5M2), variants,
                                                                  (torch.bfloat16, torch.float32), TOKENS):
        scale = _meta(()) if overflow else None
        *_, args, options = triton_quantize.amax_launch(_meta(tokens, HIDDEN, dtype=dtype), scale, fmt.name, rows)
        label = "amax rows" if rows else f"amax tensor{' overflow' if overflow else ''}"
        yield Launch(f"{label} {fmt.name} {str(dtype)[6:]}", f"x {tokens}x{HIDDEN}", amax, args, options)


def scaling_launches() -> Iterator[Launch]:
    """Every `_scaling_kernel` launch (fp8/triton_scaling.py): each mode, in one launch or split
    around an amax all-reduce (PRE, POST), delayed scaling with 'max' and 'most_recent'."""
    kernel = triton_scaling._kernel(False)
    history = _meta(1024)
    out = {"scale": _meta(()), "scale_inv": _meta(()), "state_scale": _meta(()),
           "recalibrated": _meta((), dtype=torch.bool)}
    phases = ((True, True), (True, False), (False, True))
    for mode, (pre, post), most_recent in itertools.product(triton_scaling.MODES, phases, (False, True)):
        if most_recent and mode != "delayed":
            continue
        args, options = triton_scaling.scaling_launch(
            mode, E4M3, _meta(64), out, partial=_meta(64), overflow=_meta(64, dtype=torch.int32), numel=8192 * HIDDEN,
            history=history, state_scale=_meta(()), counts=_meta(5, dtype=torch.int64), margin=0, tolerance=0.05,
            most_recent=most_recent, pre=pre, post=post)
        phase = "" if pre and post else (" pre" if pre else " post")
        yield Launch(f"scaling {mode}{phase}{' most_recent' if most_recent else ''}", "history 1024", kernel,
                     args, options)


def gemm_launches() -> Iterator[Launch]:
    """Every `triton_fp8_matmul_nt` launch: per tensor, 1xG x GxG blocks and 1xG x 1xG groups
    (G 32, 128), fp32 and bf16 out, E4M3 x E4M3 (forward) and E5M2 x E4M3 (dgrad / wgrad under
    'hybrid'); forward / dgrad shapes (K = hidden) and the wgrad's (K = tokens)."""
    kernel = triton_gemm._wrapped(False)
    schemes = [(None, False)] + [(g, rows) for g in triton_gemm.GROUPS for rows in (False, True)]
    pairs = ((torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.float8_e5m2, torch.float8_e4m3fn))
    for (group, b_rows), (a_type, b_type), out, tokens in itertools.product(
            schemes, pairs, triton_gemm.OUT_DTYPES, TOKENS):
        for m, n, k in ((tokens, HIDDEN, HIDDEN), (HIDDEN, HIDDEN, tokens)):
            a, b = _meta(m, k, dtype=a_type), _meta(n, k, dtype=b_type)
            if group is None:
                sa, sb = _meta(()), _meta(())
            else:
                sa = _meta(m, math.ceil(k / group))
                sb = _meta(n if b_rows else math.ceil(n / group), math.ceil(k / group))
            *_, args, options = triton_gemm.gemm_launch(a, b, sa, sb, group, b_rows, out)
            scheme = "tensor" if group is None else f"1x{group} x {'1x' if b_rows else f'{group}x'}{group}"
            name = f"gemm {scheme} {str(a_type)[12:]}x{str(b_type)[12:]} {str(out)[6:]}"
            yield Launch(name, f"MNK {m},{n},{k}", kernel, args, options, wgmma=True)


LAUNCH_SITES: list[Callable[[], Iterator[Launch]]] = [quantize_launches, amax_launches, scaling_launches,
                                                       gemm_launches]
"""Everything the device path launches; a new kernel's launch site adds its generator here."""


def _specialize(launch: Launch):
    """(signature, constexprs, attrs, options) a launch with these arguments compiles, from
    triton's own binder (triton.runtime.jit, as `JITFunction.run`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", TARGET_ARCH, 32))
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.options)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.options, bound, specialization, options)
    return signature, constexprs, attrs, options


def variants() -> dict[str, tuple[Launch, str]]:
    """{specialization key: (the first launch compiling it, the launches sharing it: their names
    and shapes)}."""
    found: dict[str, tuple[Launch, dict]] = {}
    for site in LAUNCH_SITES:
        for launch in site():
            signature, constexprs, attrs, options = _specialize(launch)
            spec = (launch.kernel.fn.__name__, sorted(signature.items()), sorted(constexprs.items()),
                    sorted(attrs.items()), options.num_warps, options.num_stages)
            _, shapes = found.setdefault(repr(spec), (launch, {}))
            shapes.setdefault(launch.name, []).append(launch.shape)
    return {key: (launch, "; ".join(f"{name} ({', '.join(shape)})" for name, shape in shapes.items()))
            for key, (launch, shapes) in found.items()}


_variants_once = functools.cache(variants)


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def ctas_per_sm(registers: int, shared: int, warps: int) -> int:
    """Resident CTAs per SM under H100's limits (module docstring)."""
    regs_per_warp = math.ceil(registers * 32 / 256) * 256
    by_regs = (H100["regs"] // regs_per_warp) // warps if regs_per_warp else H100["ctas"]
    by_smem = H100["smem"] // (shared + H100["smem_per_cta_reserved"])
    return min(by_regs, by_smem, H100["threads"] // (32 * warps), H100["ctas"])


def parse_ptxas(text: str) -> dict:
    """Registers and spill bytes from `ptxas -v` output, and its C7xxx advisories (the codes)."""
    used = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if used is None or spills is None:
        raise ValueError(f"ptxas -v output without a register / spill line:\n{text}")
    advisories = sorted(set(re.findall(r"\((C7\d+)\)", text)))
    return dict(registers=int(used.group(1)), spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)),
                advisories=",".join(advisories) or "-")


def parse_sass(sass: str) -> dict:
    """wgmma ([HQI]GMMA: Hopper's asynchronous warpgroup MMA; QGMMA for FP8), mma.sync ([HQI]MMA)
    counts, and the waits for every wgmma in flight (WARPGROUP.DEPBAR.LE gsb0, 0x0) inside a loop
    (between a backward branch and its target), i.e. once per K tile."""
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)
    address = [(int(at, 16), text) for at, text in lines]
    loops = [(int(m.group(1), 16), at) for at, text in address
             if (m := re.search(r"\bBRA\s+(?:`?\(?)0x([0-9a-f]+)", text)) and int(m.group(1), 16) < at]
    waits = [at for at, text in address if re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0\b", text)]
    return dict(wgmma=sum(bool(re.search(r"\b[HQI]GMMA\.", text)) for _, text in address),
                mma_sync=sum(bool(re.search(r"\b[HQI]MMA\.", text)) for _, text in address),
                wait_all=sum(any(lo <= at <= hi for lo, hi in loops) for at in waits))


def _ptxas_report(ptx: str, folder: Path, fp_fusion: bool) -> str:
    """ptxas -v's report on `ptx`, run as triton's make_cubin runs it for Hopper (its ptxas
    binary and flags; the cubin is the one triton wrote)."""
    from triton.backends.nvidia.compiler import get_ptxas

    source = folder / "kernel.ptx"
    source.write_text(ptx)
    command = [get_ptxas(TARGET_ARCH).path, "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v",
               "--regAllocOptLevel=2", f"--gpu-name=sm_{TARGET_ARCH}a", str(source), "-o", str(folder / "ptxas.cubin")]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return done.stderr + done.stdout


def _assembler_reports(compiled, fp_fusion: bool) -> tuple[dict, dict]:
    """(parse_ptxas, parse_sass) of a compiled kernel, kept in triton's cache beside it (keyed by
    the compiled kernel's hash: same PTX and cubin, same reports), so a second audit of an
    unchanged kernel reads them instead of running ptxas and cuobjdump again."""
    from triton.runtime.cache import get_cache_manager

    cache = get_cache_manager(hashlib.sha256(f"kernel_audit {AUDIT_VERSION} {compiled.hash}".encode()).hexdigest())
    kept = cache.get_file("reports.json")
    if kept is not None:
        return tuple(json.loads(Path(kept).read_text()))
    with tempfile.TemporaryDirectory() as folder:
        report = _ptxas_report(compiled.asm["ptx"], Path(folder), fp_fusion)
        cubin = Path(folder) / "triton.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    reports = (parse_ptxas(report), parse_sass(sass))
    cache.put(json.dumps(reports), "reports.json", binary=False)
    return reports


def audit(launch: Launch) -> Report:
    """Compile one launch for sm_90 and read ptxas's and the SASS's account of it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    start = time.perf_counter()
    signature, constexprs, attrs, options = _specialize(launch)
    compiled = compile(ASTSource(launch.kernel, signature, constexprs, attrs),
                       target=GPUTarget("cuda", TARGET_ARCH, 32), options=options.__dict__)
    registers, sass_counts = _assembler_reports(compiled, options.enable_fp_fusion)
    shared, warps = compiled.metadata.shared, compiled.metadata.num_warps
    return Report(name=launch.name, **registers, shared=shared, warps=warps, stages=compiled.metadata.num_stages,
                  ctas_per_sm=ctas_per_sm(registers["registers"], shared, warps), **sass_counts,
                  wgmma_expected=launch.wgmma, seconds=time.perf_counter() - start)


def _audit_key(key: str) -> Report:
    """A worker's job: the variant `key` of a fresh enumeration (launches hold kernels, which do
    not pickle; every process enumerates the same variants)."""
    launch, names = _variants_once()[key]
    report = audit(launch)
    report.name = names
    return report


def run(jobs: int = 2) -> tuple[list[Report], float]:
    """Reports of every variant (compiled in `jobs` processes) and the wall seconds it took."""
    from triton import knobs

    start = time.perf_counter()
    with knobs.runtime.scope():
        knobs.runtime.interpret = False  # the compiled-mode kernels, whatever TRITON_INTERPRET says
        keys = list(variants())
    if jobs <= 1:
        with knobs.runtime.scope():
            knobs.runtime.interpret = False
            reports = [_audit_key(key) for key in keys]
    else:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context, initializer=_compiled_mode) as pool:
            reports = list(pool.map(_audit_key, keys))
    return reports, time.perf_counter() - start


def _compiled_mode() -> None:
    from triton import knobs

    knobs.runtime.interpret = False


def table(reports: list[Report], seconds: float, jobs: int) -> str:
    """The markdown report: header with the command, one row per variant, the problems found."""
    import triton

    lines = [f"# Triton kernel audit, sm_90 (H100 / H200), triton {triton.__version__}", "",
             f"Written by `{COMMAND}` ({len(reports)} variants compiled in {seconds:.0f} s with {jobs} "
             "processes; bench/kernel_audit.py's docstring says how).", "",
             "regs: per thread (ptxas); spill: bytes stored / loaded per thread; smem: dynamic shared memory "
             "(bytes); CTAs/SM: resident under H100 limits; wgmma / mma.sync: SASS HGMMA / HMMA "
             "instructions; wait-all: `WARPGROUP.DEPBAR.LE gsb0, 0x0` (wait for every wgmma in flight) inside a loop; "
             "advisories: ptxas's C7xxx performance messages.", "",
             "| variant (launches sharing it) | warps | stages | regs | spill | smem | CTAs/SM | wgmma | mma.sync "
             "| wait-all | advisories |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(reports, key=lambda r: r.name):
        lines.append(f"| {r.name} | {r.warps} | {r.stages} | {r.registers} | {r.spill_stores} / {r.spill_loads} "
                     f"| {r.shared} | {r.ctas_per_sm} | {r.wgmma} | {r.mma_sync} | {r.wait_all} | {r.advisories} |")
    problems = [p for r in reports for p in r.problems()]
    lines += ["", f"Problems: {len(problems)}"] + [f"- {p}" for p in problems]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    reports, seconds = run(args.jobs)
    text = table(reports, seconds, args.jobs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 1 if any(r.problems() for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
