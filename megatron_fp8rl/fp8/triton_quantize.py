"""Fused FP8 quantization kernels in Triton: one pass over x writes codes, scales and statistics.

Owns: the kernels `_quantize_kernel` (codes, in-kernel scales for groups and blocks, a transposed
or column-wise copy, statistics counters, the tensor's amax) and `_amax_kernel` (the per-row finite
max |x| a per-tensor or per-row scale needs before the quantization pass, and the overflow count of
the calibrated recipe's predicted scale), their host launchers `quantize_codes` and `row_bounds` /
`tensor_bounds`, and what those launch (`quantize_launch`, `amax_launch`: arguments, grid and
num_warps without launching; bench/kernel_audit.py compiles every variant from them).
fp8/device_quantize.py picks the launches per quantizer.
Must not import: megatron, megatron_fp8rl.compat or anything above layer L0 (torch and triton
only; only the device path imports this module, so the CPU tier never imports triton).

Arithmetic (equal to fp8/quantize.py's bit for bit, tests/fp8/test_triton_quantize.py):
- scale from a bound c (fp8/quantize.py `scale_from_bound`): fp8_max * (1 / c) (torch evaluates
  `fp8_max / c` so) times 2**-margin (exact, as the division by 2**margin is), 1 where c <= 0,
  FP32_MAX where it overflows; scale_inv = 1 / scale; both divisions correctly rounded (`div_rn`:
  a plain `/` compiles to an approximate division on NVIDIA GPUs);
- codes: v = x * scale in fp32, clamped to +-fp8_max, rounded to the FP8 grid to nearest even by
  integer arithmetic on v's bits (normal range) or by adding a power of two whose fp32 ulp is the
  FP8 subnormal step (subnormal range), written as uint8 bit patterns. NaN -> 0x7F with x's sign
  (as torch's cast), -0 -> 0x80, inf -> +-fp8_max. Done by hand because the interpreter's fp8 casts
  round ties away from zero and map NaN otherwise: the same code then runs compiled and interpreted.
- statistics (fp8/stats.py `reference_stats`, rowwise copy only), added into int64 counters on the
  device: [saturated, underflow, finite non-zero, non-finite, NaN].
The only interpreter-only difference is the scope `_kernels` runs them in: under TRITON_INTERPRET
the kernels call the undecorated bodies of `tl.max` / `tl.sum` (triton.language wraps them with
`triton.jit` when it is imported, and a kernel wrapped for the interpreter cannot call a
compiled-mode JIT function; which mode they got depends on whether the variable was set before the
process first imported triton).
Kernels are wrapped at first use per mode (`_kernels`), never at import.
"""
from __future__ import annotations

import functools
import struct
import types

import torch
import triton
import triton.language as tl

FP32_MAX = torch.finfo(torch.float32).max
COUNTERS = ("saturated", "underflow", "nonzero", "nonfinite", "nan")
"""The int64 counters a quantization adds into, in this order."""
SCALES = {"tensor": 0, "row": 1, "group": 2, "block": 3}
"""Where a launch's scales come from: one given scale, one given per row, computed per 1 x BLOCK_K
group of each row, or computed per BLOCK_M x BLOCK_K block."""
TENSOR_TILE = (32, 128)
"""(BLOCK_M, BLOCK_K) of per-tensor and per-row launches and of the amax pass."""
MAX_ELEMENTS = 2**31
"""Offsets are 32-bit in the kernels."""
SLAB_ROWS = 32
"""Rows of its tile a quantize program holds in registers at once: 128-row tiles (GxG blocks,
column-wise groups) are walked in slabs (a 128x128 tile held whole spilled 2.7-5.6 KB per thread
at 4 warps and ~1 KB at 16; bench/kernel_audit.py, results/kernel_audit/sm90.md)."""
ELEMENTS_PER_THREAD = 8
"""Slab elements per thread (`warps_for`): a thread holds x, |x|, its codes and masks per element
(8: 16 warps on a 32x128 slab, 50-90 registers, 16-byte loads of bf16; at 16 the 128-row tiles took
144-189 registers, one 8-warp CTA per SM)."""


def _fp8_codes(v, FMAX: tl.constexpr, SHIFT: tl.constexpr, HALF: tl.constexpr, EXP_SHIFT: tl.constexpr,
               MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr, MAGIC_BITS: tl.constexpr):
    """uint8 FP8 bit patterns of fp32 v = x * scale (module docstring); SHIFT = 23 - mantissa
    bits, HALF = 2**(SHIFT - 1) - 1 (round to nearest even on the dropped bits)."""
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    is_nan = v != v
    mag = tl.abs(tl.minimum(tl.maximum(v, -FMAX), FMAX))
    bits = mag.to(tl.int32, bitcast=True)
    normal = ((bits + HALF + ((bits >> SHIFT) & 1)) >> SHIFT) - EXP_SHIFT
    subnormal = (mag + MAGIC).to(tl.int32, bitcast=True) - MAGIC_BITS
    code = tl.where(mag < MIN_NORMAL, subnormal, normal)
    code = tl.where(is_nan, 0x7F, code) | (sign << 7)
    return code.to(tl.uint8)


def _scale_of(bound, FMAX: tl.constexpr, MARGIN_MUL: tl.constexpr):
    """scale_from_bound(bound, fp8_max, margin) for finite bounds >= 0 (module docstring)."""
    scale = FMAX * tl.math.div_rn(1.0, bound) * MARGIN_MUL
    scale = tl.where(bound > 0.0, scale, 1.0)
    return tl.where(scale == float("inf"), 3.4028234663852886e38, scale)


def _load_slab(x_ptr, row0, cols, M, K, stride_xm, SLAB_M: tl.constexpr):
    """Rows row0 .. row0 + SLAB_M of x [M, K] at columns `cols`, in fp32 (0 outside x): (rows, the
    in-bounds mask, x, |x|, |x| finite, |x| with non-finite elements as 0)."""
    rows = row0 + tl.arange(0, SLAB_M)
    inside = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    magnitude = tl.abs(x)
    finite = magnitude < float("inf")
    return rows, inside, x, magnitude, finite, tl.where(finite, magnitude, 0.0)


def _column_bounds(x_ptr, row0, cols, M, K, stride_xm, BLOCK_M: tl.constexpr, SLAB_M: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """Each column's finite max |x| over rows row0 .. row0 + BLOCK_M (the first pass of block and
    column-wise scales), read slab by slab."""
    bound = tl.full((SLAB_M, BLOCK_K), 0.0, tl.float32)
    for slab in range(0, BLOCK_M, SLAB_M):
        finite_mag = _load_slab(x_ptr, row0 + slab, cols, M, K, stride_xm, SLAB_M)[5]
        bound = tl.maximum(bound, finite_mag)
    return _max(bound, 0)


def _quantize_kernel(x_ptr, q_ptr, qt_ptr, s_ptr, st_ptr, scale_ptr, amax_ptr, counts_ptr,
                     M, K, stride_xm, stride_qm, stride_qtk, stride_sm, stride_stk,
                     FMAX: tl.constexpr, LIMIT: tl.constexpr, SHIFT: tl.constexpr, HALF: tl.constexpr,
                     EXP_SHIFT: tl.constexpr,
                     MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr, MAGIC_BITS: tl.constexpr,
                     MARGIN_MUL: tl.constexpr, SCALES: tl.constexpr, TRANSPOSED: tl.constexpr,
                     COLWISE: tl.constexpr, AMAX: tl.constexpr, STATS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SLAB_M: tl.constexpr):
    """Quantize one [BLOCK_M, BLOCK_K] tile of x [M, K] (module docstring), SLAB_M rows at a
    time (registers hold one slab; block and column-wise scales read the tile once more first, for
    its maxima). SCALES: see SCALES. TRANSPOSED: also write the codes transposed into qt [K, M]
    (blocks: their scales into st). COLWISE (groups): also quantize the tile with one scale per
    column (BLOCK_M x 1 groups) into qt [K, M] and st [K, cdiv(M, BLOCK_M)]. AMAX: this program's
    max |x| over non-NaN elements into amax_ptr[program]. STATS: add the counters (COUNTERS) into
    counts_ptr."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    if SCALES == 3 or COLWISE:
        column_bound = _column_bounds(x_ptr, pid_m * BLOCK_M, cols, M, K, stride_xm, BLOCK_M, SLAB_M, BLOCK_K)
    if SCALES == 3:
        block_scale = _scale_of(_max(column_bound, 0), FMAX, MARGIN_MUL)
        block_scale_inv = tl.math.div_rn(1.0, block_scale)
        tl.store(s_ptr + pid_m * stride_sm + pid_k, block_scale_inv)
        if TRANSPOSED:
            tl.store(st_ptr + pid_k * stride_stk + pid_m, block_scale_inv)
    if COLWISE:
        col_scale = _scale_of(column_bound, FMAX, MARGIN_MUL)
        tl.store(st_ptr + cols * stride_stk + pid_m, tl.math.div_rn(1.0, col_scale), mask=cols < K)
    amax = tl.full((), 0.0, tl.float32)
    saturated = tl.full((), 0, tl.int32)
    underflow = tl.full((), 0, tl.int32)
    nonzero = tl.full((), 0, tl.int32)
    nonfinite = tl.full((), 0, tl.int32)
    nans = tl.full((), 0, tl.int32)
    for slab in range(0, BLOCK_M, SLAB_M):
        rows, inside, x, magnitude, finite, finite_mag = _load_slab(x_ptr, pid_m * BLOCK_M + slab, cols, M, K,
                                                                    stride_xm, SLAB_M)
        if SCALES == 0:
            scale = tl.load(scale_ptr)
        elif SCALES == 1:
            scale = tl.load(scale_ptr + rows, mask=rows < M, other=1.0)[:, None]
        elif SCALES == 2:
            row_scale = _scale_of(_max(finite_mag, 1), FMAX, MARGIN_MUL)
            tl.store(s_ptr + rows * stride_sm + pid_k, tl.math.div_rn(1.0, row_scale), mask=rows < M)
            scale = row_scale[:, None]
        else:
            scale = block_scale
        codes = _fp8_codes(x * scale, FMAX, SHIFT, HALF, EXP_SHIFT, MIN_NORMAL, MAGIC, MAGIC_BITS)
        tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], codes, mask=inside)
        transposed_at = qt_ptr + cols[None, :] * stride_qtk + rows[:, None]
        if TRANSPOSED:
            tl.store(transposed_at, codes, mask=inside)
        if COLWISE:
            col_codes = _fp8_codes(x * col_scale[None, :], FMAX, SHIFT, HALF, EXP_SHIFT, MIN_NORMAL, MAGIC,
                                   MAGIC_BITS)
            tl.store(transposed_at, col_codes, mask=inside)
        if AMAX:
            amax = tl.maximum(amax, _max(_max(tl.where(x == x, magnitude, 0.0), 1), 0))
        if STATS:
            is_nonzero = finite & (x != 0.0)
            saturated += _sum(_sum((finite & (tl.abs(x * scale) > LIMIT)).to(tl.int32), 1), 0)
            underflow += _sum(_sum((is_nonzero & ((codes & 0x7F) == 0)).to(tl.int32), 1), 0)
            nonzero += _sum(_sum(is_nonzero.to(tl.int32), 1), 0)
            nonfinite += _sum(_sum((~finite).to(tl.int32), 1), 0)
            nans += _sum(_sum((x != x).to(tl.int32), 1), 0)
    if AMAX:
        tl.store(amax_ptr + pid_m * tl.num_programs(1) + pid_k, amax)
    if STATS:
        tl.atomic_add(counts_ptr + 0, saturated.to(tl.int64))
        tl.atomic_add(counts_ptr + 1, underflow.to(tl.int64))
        tl.atomic_add(counts_ptr + 2, nonzero.to(tl.int64))
        tl.atomic_add(counts_ptr + 3, nonfinite.to(tl.int64))
        tl.atomic_add(counts_ptr + 4, nans.to(tl.int64))


def _amax_kernel(x_ptr, bound_ptr, scale_ptr, overflow_ptr, M, K, stride_xm, LIMIT: tl.constexpr,
                 OVERFLOW: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Max |x| over the finite elements: ROWS, each row's within this program's columns into
    bound [cdiv(K, BLOCK_K), M]; else this program's tile's into bound[program] (a per-tensor
    scale reduces far fewer partials). OVERFLOW: the count of this program's elements whose
    |x * scale_ptr[0]| is finite and above LIMIT (the calibrated recipe's overflow check) into
    overflow_ptr[program] (int32; stored, not added: no zeroed buffer needed)."""
    pid_k = tl.program_id(1)
    program = tl.program_id(0) * tl.num_programs(1) + pid_k
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rows, inside, x, magnitude, finite, finite_mag = _load_slab(x_ptr, tl.program_id(0) * BLOCK_M, cols, M, K,
                                                                stride_xm, BLOCK_M)
    row_max = _max(finite_mag, 1)
    if ROWS:
        tl.store(bound_ptr + pid_k * M + rows, row_max, mask=rows < M)
    else:
        tl.store(bound_ptr + program, _max(row_max, 0))
    if OVERFLOW:
        scaled = tl.abs(x * tl.load(scale_ptr))
        over = (scaled < float("inf")) & (scaled > LIMIT)
        tl.store(overflow_ptr + program, _sum(_sum(over.to(tl.int32), 1), 0))


@functools.cache
def _kernels(interpret: bool) -> tuple:
    """(quantize kernel, amax kernel) wrapped by `triton.jit` in the mode `interpret` names (the
    flag is the cache key: triton picks interpreter or compiler at wrapping time). Kernels and
    helpers run over one scope of this module's globals in which the reductions and helpers are
    those of that mode (module docstring): under the interpreter the undecorated bodies, compiled
    JIT functions otherwise."""
    names = dict(globals(), _max=tl.max.fn if interpret else tl.max, _sum=tl.sum.fn if interpret else tl.sum)
    for helper in (_fp8_codes, _scale_of, _load_slab, _column_bounds):
        rebound = with_globals(helper, names)
        names[helper.__name__] = rebound if interpret else triton.jit(rebound)
    return tuple(triton.jit(with_globals(fn, names), do_not_specialize=["M", "K"])
                 for fn in (_quantize_kernel, _amax_kernel))


def with_globals(fn: types.FunctionType, names: dict) -> types.FunctionType:
    """A copy of `fn` (same code, so the same source for triton) that resolves names in `names`,
    with fn's annotations: a launch reads them to know which parameters are `tl.constexpr`
    (without them every constexpr is passed as a runtime integer and the compile fails at the
    first `tl.arange`). The kernels of fp8/triton_gemm.py and fp8/triton_scaling.py are copied by it too."""
    copy = types.FunctionType(fn.__code__, names, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__doc__, copy.__qualname__, copy.__module__ = fn.__doc__, fn.__qualname__, fn.__module__
    copy.__annotations__ = fn.__annotations__
    return copy


def _mode(device: torch.device) -> bool:
    """Whether kernels for tensors on `device` run under the interpreter; RuntimeError for CPU
    tensors without TRITON_INTERPRET=1 (no silent fallback to the CPU quantizers)."""
    interpret = bool(triton.knobs.runtime.interpret)
    if device.type == "cpu" and not interpret:
        raise RuntimeError("Triton FP8 quantization: CPU tensors run only under Triton's interpreter and "
                           "TRITON_INTERPRET is not set to 1 in this process (the CPU tier quantizes with "
                           "fp8/quantizer.py instead)")
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"Triton FP8 quantization: tensors on {device} are not supported")
    return interpret


def _f32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


@functools.cache
def format_constants(fmt_name: str) -> dict:
    """The kernels' constexprs for an element format ('e4m3' or 'e5m2'), plain host arithmetic."""
    mbits, bias, fmax, limit = {"e4m3": (3, 7, 448.0, 464.0), "e5m2": (2, 15, 57344.0, 61440.0)}[fmt_name]
    min_normal = 2.0 ** (1 - bias)
    magic = 2.0 ** (23 + (1 - bias) - mbits)  # fp32 ulp of magic = the FP8 subnormal step
    return {"FMAX": fmax, "LIMIT": limit, "SHIFT": 23 - mbits, "HALF": (1 << (22 - mbits)) - 1,
            "EXP_SHIFT": (127 - bias) << mbits,
            "MIN_NORMAL": min_normal, "MAGIC": magic, "MAGIC_BITS": _f32_bits(magic)}


def check_input(x: torch.Tensor) -> None:
    """ValueError naming x's shape, dtype or layout when the kernels cannot read it."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.stride(1) != 1:
        raise ValueError(f"Triton FP8 quantization expects a 2-D float32/bfloat16/float16 tensor with "
                         f"unit column stride; found shape {tuple(x.shape)} {x.dtype} strides {x.stride()}")
    if x.numel() >= MAX_ELEMENTS:
        raise ValueError(f"Triton FP8 quantization: {tuple(x.shape)} holds 2**31 elements or more (32-bit offsets)")


def warps_for(slab: tuple[int, int]) -> int:
    """num_warps of a launch holding [rows, BLOCK_K] slabs: ELEMENTS_PER_THREAD elements per
    thread, 4 to 32 warps (it changes no bit of the result, only how threads share a slab)."""
    return max(4, min(32, slab[0] * slab[1] // (32 * ELEMENTS_PER_THREAD)))


def new_counters(device: torch.device) -> torch.Tensor:
    """Zeroed int64 counters (COUNTERS) on `device`."""
    return torch.zeros(len(COUNTERS), dtype=torch.int64, device=device)


def row_bounds(x: torch.Tensor) -> torch.Tensor:
    """Partial finite max |x| per row [cdiv(K, 128), M] fp32 (`.amax(0)`: each row's finite max)."""
    return _amax_pass(x, rows=True)[0]


def tensor_bounds(x: torch.Tensor, scale: torch.Tensor | None = None,
                  fmt_name: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(partial, overflow), one entry per program of the amax pass: partial, its tile's finite max
    |x| (fp32, `.amax()`: the tensor's); with `scale` (0-d fp32) overflow, the number of its
    elements whose |x * scale| is finite and above the format's rounding limit (int32, `.sum()`:
    the tensor's count), else None."""
    return _amax_pass(x, scale, fmt_name)


def _amax_pass(x, scale=None, fmt_name="e4m3", rows=False):
    """One launch of the amax kernel for `row_bounds` / `tensor_bounds`: (partial, overflow)."""
    check_input(x)
    partial, overflow, grid, args, options = amax_launch(x, scale, fmt_name, rows)
    _, kernel = _kernels(_mode(x.device))
    kernel[grid](*args, **options)
    return partial, overflow


def amax_launch(x: torch.Tensor, scale: torch.Tensor | None = None, fmt_name: str = "e4m3",
                rows: bool = False) -> tuple:
    """What `row_bounds` (rows) / `tensor_bounds` launch, without launching: (partial, overflow or
    None, grid, the amax kernel's positional and keyword arguments). Allocates only, so meta
    tensors work (bench/kernel_audit.py compiles every launch from these)."""
    (m, k), (block_m, block_k) = x.shape, TENSOR_TILE
    grid = (triton.cdiv(m, block_m), triton.cdiv(k, block_k))
    shape = (grid[1], m) if rows else (grid[0] * grid[1],)
    partial = torch.empty(shape, dtype=torch.float32, device=x.device)
    overflow = None if scale is None else torch.empty(grid[0] * grid[1], dtype=torch.int32, device=x.device)
    args = (x, partial, partial if scale is None else scale, partial if overflow is None else overflow, m, k,
            x.stride(0))
    options = dict(LIMIT=format_constants(fmt_name)["LIMIT"], OVERFLOW=overflow is not None, ROWS=rows,
                   BLOCK_M=block_m, BLOCK_K=block_k, num_warps=warps_for(TENSOR_TILE))
    return partial, overflow, grid, args, options


def quantize_codes(x: torch.Tensor, fmt, scales: str, scale: torch.Tensor | None = None, block: int = 128,
                   margin: int = 0, transposed: bool = False, colwise: bool = False, amax: bool = False,
                   counts: torch.Tensor | None = None) -> dict:
    """Quantize x [M, K] in one pass (module docstring); returns a dict of device tensors:
    'codes' [M, K] (fmt.dtype), 'scale_inv' (scales 'group': [M, cdiv(K, block)], 'block':
    [cdiv(M, block), cdiv(K, block)]; absent for given scales), 'codes_t' [K, M] with `transposed`
    or `colwise` ('scale_inv_t': [cdiv(K, block), cdiv(M, block)] for transposed blocks,
    [K, cdiv(M, block)] for colwise groups), 'amax_partial' (with `amax`: each program's max |x|
    over non-NaN elements, fp32 [programs]; `.amax()` is the tensor's, 0 for an empty x).
    scales 'tensor' / 'row' take `scale` ([] / [M] fp32). `counts`: int64 COUNTERS the
    statistics are added into (None: not counted)."""
    check_input(x)
    out, partial, grid, args, options = quantize_launch(x, fmt, scales, scale, block, margin, transposed, colwise,
                                                        amax, counts)
    if grid[0] * grid[1]:
        kernel, _ = _kernels(_mode(x.device))
        kernel[grid](*args, **options)
    if amax:
        out["amax_partial"] = partial
    return out


def quantize_launch(x: torch.Tensor, fmt, scales: str, scale: torch.Tensor | None = None, block: int = 128,
                    margin: int = 0, transposed: bool = False, colwise: bool = False, amax: bool = False,
                    counts: torch.Tensor | None = None) -> tuple:
    """What `quantize_codes` launches, without launching: (its outputs, the per-program amax
    buffer or None, grid, the quantize kernel's positional and keyword arguments; absent outputs
    get a dummy pointer). Allocates only, so meta tensors work (bench/kernel_audit.py)."""
    if scales not in SCALES or (colwise and scales != "group") or (transposed and scales not in ("tensor", "block")):
        raise ValueError(f"Triton FP8 quantization: scales {scales!r} with transposed={transposed}, "
                         f"colwise={colwise} is not a layout it writes")
    (m, k), device = x.shape, x.device
    tile = (block, block) if scales == "block" or colwise else ((32, block) if scales == "group" else TENSOR_TILE)
    grid = (triton.cdiv(m, tile[0]), triton.cdiv(k, tile[1]))
    out = {"codes": torch.empty(m, k, dtype=fmt.dtype, device=device)}
    if scales in ("group", "block"):
        out["scale_inv"] = torch.empty(grid[0] if scales == "block" else m, grid[1], dtype=torch.float32,
                                       device=device)
    if transposed or colwise:
        out["codes_t"] = torch.empty(k, m, dtype=fmt.dtype, device=device)
    if (transposed and scales == "block") or colwise:
        out["scale_inv_t"] = torch.empty(grid[1] if scales == "block" else k, grid[0], dtype=torch.float32,
                                         device=device)
    partial = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=device) if amax else None
    codes = out["codes"].view(torch.uint8)
    codes_t = out["codes_t"].view(torch.uint8) if "codes_t" in out else codes
    scale_inv, scale_inv_t = out.get("scale_inv", codes), out.get("scale_inv_t", codes)
    args = (x, codes, codes_t, scale_inv, scale_inv_t, scale if scale is not None else codes,
            partial if partial is not None else codes, counts if counts is not None else codes,
            m, k, x.stride(0), codes.stride(0), codes_t.stride(0),
            scale_inv.stride(0) if scale_inv.dim() == 2 else 0, scale_inv_t.stride(0) if scale_inv_t.dim() == 2 else 0)
    options = dict(format_constants(fmt.name), MARGIN_MUL=2.0 ** -margin, SCALES=SCALES[scales],
                   TRANSPOSED=transposed, COLWISE=colwise, AMAX=partial is not None, STATS=counts is not None,
                   BLOCK_M=tile[0], BLOCK_K=tile[1], SLAB_M=min(SLAB_ROWS, tile[0]),
                   num_warps=warps_for((min(SLAB_ROWS, tile[0]), tile[1])), num_stages=1)
    return out, partial, grid, args, options
