"""One small Triton kernel per quantization for its per-tensor scale and scaling-state update.

Owns: `_scaling_kernel` (one program) and its host launchers `current_scale`, `calibrated_scale`,
`calibrated_weight_hit` and `delayed_update`. fp8/device_quantize.py calls them around the
quantize pass of fp8/triton_quantize.py, so a per-tensor quantization is at most three launches
(amax pass, this kernel, quantize pass; delayed scaling: counters, quantize pass, this kernel)
instead of the ~10-30 scalar torch ops the same arithmetic takes eagerly. No host synchronization.
Must not import: megatron, megatron_fp8rl.compat or anything above layer L0 (torch and triton
only; only the device path imports this module).

Arithmetic, bit for bit what the CPU quantizers compute (fp8/quantizer.py, fp8/scaling.py,
fp8/quantize.py `scale_from_bound`; tests/fp8/test_triton_scaling.py):
- scale_from_bound(c, old) = fp8_max * (1 / c) * 2**-margin (correctly rounded division, `div_rn`),
  old where c <= 0, NaN or inf, FP32_MAX where the product overflows;
- record(a): history[0] = a if a is NaN, else max(history[0], a) (NaN in history[0] stays);
- bound from history: max over the window ('max', NaN anywhere gives NaN) or row 0 ('most_recent');
- roll: history moves by -1 (row 0 to the end) and row 0 becomes 0.
Modes (the `MODE` constexpr): CURRENT (bound = the amax pass's maximum, old scale 1); CALIBRATED
(activations: the overflow fraction under the predicted scale and whether a bound exists decide
between the fresh and the predicted scale; then record, update, roll); CALIBRATED_WEIGHT (scale
from the weight's bound, the old scale kept where it is not positive and finite; record, the state's
scale becomes it, roll); WEIGHT_HIT (a cached weight: record its bound again, roll); DELAYED (after
the quantize pass: record the pass's amax, NaN when x held one; the new scale from the history;
roll). Modes that compute a scale before the quantize pass also zero its statistics counters.
With an amax-reduction group of more than one rank, the values the CPU path all-reduces (the
decision vector, a weight's bound, a delayed history's row 0) are written by a PRE launch, reduced
by the caller, and read by a POST launch; with one rank both phases run in one launch.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from megatron_fp8rl.fp8.triton_quantize import with_globals

MODES = {"current": 0, "calibrated": 1, "calibrated_weight": 2, "weight_hit": 3, "delayed": 4}
"""What `_scaling_kernel` computes (module docstring)."""
CURRENT, CALIBRATED, CALIBRATED_WEIGHT, WEIGHT_HIT, DELAYED = (tl.constexpr(MODES[name]) for name in MODES)
"""The MODES values as the kernel compares them."""


def _scale_from_bound(bound, old, FMAX: tl.constexpr, MARGIN_MUL: tl.constexpr):
    """fp8/quantize.py `scale_from_bound(bound, fp8_max, margin, old)` for 0-d fp32 values."""
    scale = FMAX * tl.math.div_rn(1.0, bound) * MARGIN_MUL
    scale = tl.where((bound > 0.0) & (bound < float("inf")), scale, old)
    return tl.where(scale == float("inf"), 3.4028234663852886e38, scale)


def _nan_max(values, mask):
    """max over the masked values, NaN when one of them is NaN (torch.max / amax semantics)."""
    nan = mask & (values != values)
    top = _max(tl.where(mask & (values == values), values, -float("inf")), 0)
    return tl.where(_sum(nan.to(tl.int32), 0) > 0, float("nan"), top)


def _chunked(ptr, n, BLOCK: tl.constexpr, SUM: tl.constexpr):
    """The maximum (SUM: the sum) of ptr[0:n] >= 0, BLOCK elements at a time (0 when n == 0)."""
    acc = tl.full((BLOCK,), 0, ptr.dtype.element_ty)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        chunk = tl.load(ptr + offs, mask=offs < n, other=0)
        if SUM:
            acc = acc + chunk
        else:
            acc = tl.maximum(acc, chunk)
    if SUM:
        return _sum(acc, 0)
    return _max(acc, 0)


def _record(row0, value):
    """fp8/scaling.py `DelayedScalingState.record`: NaN wins, else the larger one."""
    larger = tl.where(row0 != row0, row0, tl.maximum(row0, value))
    return tl.where(value != value, value, larger)


def _scaling_kernel(partial_ptr, P, overflow_ptr, P_OVER, numel, history_ptr, L, state_scale_ptr, vec_ptr,
                    counts_ptr, scale_ptr, scale_inv_ptr, new_state_scale_ptr, flag_ptr,
                    FMAX: tl.constexpr, MARGIN_MUL: tl.constexpr, TOLERANCE: tl.constexpr, MODE: tl.constexpr,
                    MOST_RECENT: tl.constexpr, PRE: tl.constexpr, POST: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr):
    """The module docstring's modes in one program. partial [P]: maxima to reduce (the amax pass's
    per-program finite maxima, or the quantize pass's per-program amax); overflow [P_OVER]: the amax
    pass's per-program overflow counts; history [L] in place; vec [3]: what a group all-reduces
    between PRE and POST; counts [5]: the quantize pass's counters (zeroed, or, DELAYED, read for
    NaN); outputs: scale, scale_inv (of the scale this quantization uses), the state's new scale,
    the recalibrated flag (bool). Absent pointers are dummies their mode never touches."""
    offs_l = tl.arange(0, BLOCK_L)
    in_history = offs_l < L
    old_scale = tl.load(state_scale_ptr)
    if PRE:
        bound = _chunked(partial_ptr, P, BLOCK_P, False)
        if MODE == CALIBRATED:
            overflow = _chunked(overflow_ptr, P_OVER, BLOCK_P, True)
            history = tl.load(history_ptr + offs_l, mask=in_history, other=0.0)
            no_bound = (_nan_max(history, in_history) <= 0.0) & (old_scale == 1.0)
            tl.store(vec_ptr + 1, tl.math.div_rn(overflow.to(tl.float32), numel.to(tl.float32)))
            tl.store(vec_ptr + 2, no_bound.to(tl.float32))
        if MODE == DELAYED:
            nan = tl.load(counts_ptr + 4) > 0
            tl.store(history_ptr, _record(tl.load(history_ptr), tl.where(nan, float("nan"), bound)))
        else:
            tl.store(vec_ptr, bound)
    tl.debug_barrier()
    if POST:
        if MODE == CURRENT:
            scale = _scale_from_bound(tl.load(vec_ptr), 1.0, FMAX, MARGIN_MUL)
        if MODE == CALIBRATED:
            bound = tl.load(vec_ptr)
            recalibrate = (tl.load(vec_ptr + 2) > 0.0) | (tl.load(vec_ptr + 1) > TOLERANCE)
            scale = tl.where(recalibrate, _scale_from_bound(bound, old_scale, FMAX, MARGIN_MUL), old_scale)
            tl.store(flag_ptr, recalibrate)
        if MODE == CALIBRATED_WEIGHT:
            scale = _scale_from_bound(tl.load(vec_ptr), old_scale, FMAX, MARGIN_MUL)
        if MODE == DELAYED:
            scale = old_scale
        if MODE != CURRENT:
            _update_history(history_ptr, L, tl.load(vec_ptr), offs_l, in_history, old_scale, new_state_scale_ptr,
                            FMAX, MARGIN_MUL, MODE, MOST_RECENT)
        if MODE != WEIGHT_HIT:
            tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))
        if MODE != WEIGHT_HIT and MODE != DELAYED:
            tl.store(scale_ptr, scale)
            tl.store(counts_ptr + tl.arange(0, 8), tl.full((8,), 0, tl.int64), mask=tl.arange(0, 8) < 5)


def _update_history(history_ptr, L, bound, offs_l, in_history, old_scale, new_state_scale_ptr,
                    FMAX: tl.constexpr, MARGIN_MUL: tl.constexpr, MODE: tl.constexpr, MOST_RECENT: tl.constexpr):
    """Record `bound` (not DELAYED: its PRE recorded the amax), the state's next scale from the
    window (CALIBRATED, DELAYED), then roll the history (module docstring)."""
    row0 = tl.load(history_ptr)
    if MODE != DELAYED:
        row0 = _record(row0, bound)
    history = tl.where(offs_l == 0, row0, tl.load(history_ptr + offs_l, mask=in_history, other=0.0))
    if MODE == CALIBRATED or MODE == DELAYED:
        window = row0 if MOST_RECENT else _nan_max(history, in_history)
        tl.store(new_state_scale_ptr, _scale_from_bound(window, old_scale, FMAX, MARGIN_MUL))
    rolled = tl.load(history_ptr + offs_l + 1, mask=offs_l + 1 < L, other=0.0)
    rolled = tl.where(offs_l == L - 1, row0, rolled)
    tl.debug_barrier()  # every program-wide load of the old history happens before the stores
    tl.store(history_ptr + offs_l, tl.where(offs_l == 0, 0.0, rolled), mask=in_history)


@functools.cache
def _kernel(interpret: bool):
    """`_scaling_kernel` wrapped by `triton.jit` in the mode `interpret` names: the interpreter
    runs the undecorated bodies of tl.max / tl.sum and of the helpers, compiled kernels JIT ones
    (fp8/triton_quantize.py's module docstring explains why)."""
    helpers = (_scale_from_bound, _nan_max, _chunked, _record, _update_history)
    if interpret:
        names = {"_max": tl.max.fn, "_sum": tl.sum.fn, **{fn.__name__: fn for fn in helpers}}
    else:
        names = {"_max": tl.max, "_sum": tl.sum}
    names = dict(globals(), **names)
    rebound = {fn.__name__: with_globals(fn, names) for fn in helpers}
    if not interpret:
        rebound = {name: triton.jit(fn) for name, fn in rebound.items()}
    names.update(rebound)
    return triton.jit(with_globals(_scaling_kernel, names), do_not_specialize=["P", "P_OVER", "numel", "L"])


def _new(device, dtype=torch.float32, shape=()) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _launch(mode: str, fmt, vec: torch.Tensor, partial=None, overflow=None, numel: int = 1, state=None,
            counts=None, margin: int = 0, tolerance: float = 0.0, most_recent: bool = False,
            reduce=None) -> dict:
    """Run `_scaling_kernel` in `mode`; `reduce`: None (no collective) or a function that
    all-reduces (MAX) a tensor in place, run between a PRE and a POST launch on what the group
    shares (the vector `vec`, DELAYED: the history's row 0). Returns its fresh outputs: 'scale',
    'scale_inv', 'state_scale', 'recalibrated'."""
    device = vec.device
    out = {"scale": _new(device), "scale_inv": _new(device), "state_scale": _new(device),
           "recalibrated": _new(device, torch.bool)}
    history = vec if state is None else state.amax_history
    shared = {"delayed": history[0:1], "calibrated_weight": vec[0:1]}.get(mode, vec)
    phases = [(True, True)] if reduce is None else [(True, False), (False, True)]
    if mode == "weight_hit":
        phases = [(False, True)]  # nothing to reduce: the bound was reduced when it was computed
    kernel = _kernel(_interpret(device))
    for pre, post in phases:
        if not pre and reduce is not None:
            reduce(shared)
        args, options = scaling_launch(mode, fmt, vec, out, partial, overflow, numel, history,
                                       None if state is None else state.scale, counts, margin, tolerance,
                                       most_recent, pre, post)
        kernel[(1,)](*args, **options)
    return out


def scaling_launch(mode: str, fmt, vec, out: dict, partial=None, overflow=None, numel: int = 1, history=None,
                   state_scale=None, counts=None, margin: int = 0, tolerance: float = 0.0,
                   most_recent: bool = False, pre: bool = True, post: bool = True) -> tuple:
    """What one `_scaling_kernel` launch of `_launch` passes, without launching: (positional,
    keyword arguments; absent inputs get `vec` as a dummy pointer). Allocates nothing, so meta
    tensors work (bench/kernel_audit.py compiles every mode from it)."""
    history = vec if history is None else history
    args = (vec if partial is None else partial, 0 if partial is None else partial.numel(),
            vec if overflow is None else overflow, 0 if overflow is None else overflow.numel(),
            max(numel, 1), history, history.numel(), vec if state_scale is None else state_scale, vec,
            vec if counts is None else counts, out["scale"], out["scale_inv"], out["state_scale"], out["recalibrated"])
    options = dict(FMAX=fmt.max, MARGIN_MUL=2.0 ** -margin, TOLERANCE=float(np.float32(tolerance)),
                   MODE=MODES[mode], MOST_RECENT=most_recent, PRE=pre, POST=post, BLOCK_P=1024,
                   BLOCK_L=triton.next_power_of_2(history.numel()))
    return args, options


def _interpret(device: torch.device) -> bool:
    """Whether the kernel runs under the interpreter; RuntimeError for CPU tensors without it."""
    interpret = bool(triton.knobs.runtime.interpret)
    if device.type == "cpu" and not interpret:
        raise RuntimeError("Triton FP8 scaling: CPU tensors run only under Triton's interpreter and "
                           "TRITON_INTERPRET is not set to 1 in this process")
    return interpret


def current_scale(partial: torch.Tensor, fmt, margin: int, counts: torch.Tensor) -> dict:
    """Tensorwise current scaling from the amax pass's finite maxima `partial`: 'scale' and
    'scale_inv'; zeroes the quantize pass's `counts`."""
    return _launch("current", fmt, _new(partial.device, shape=(3,)), partial, counts=counts, margin=margin)


def calibrated_scale(partial, overflow, numel: int, state, fmt, spec, counts, reduce=None) -> dict:
    """The calibrated recipe's activation scale (module docstring, CALIBRATED): 'scale',
    'scale_inv', 'recalibrated'; records the bound and rolls `state.amax_history` in place and
    sets `state.scale` to the predicted next scale; zeroes `counts`."""
    out = _launch("calibrated", fmt, _new(partial.device, shape=(3,)), partial, overflow, numel, state, counts,
                  spec.margin, spec.overflow_tolerance, reduce=reduce)
    state.scale = out["state_scale"]
    return out


def calibrated_weight_scale(partial, state, fmt, margin: int, counts, reduce=None) -> dict:
    """A calibrated weight's scale from its bound (module docstring, CALIBRATED_WEIGHT): 'scale',
    'scale_inv', 'bound' (1 element, for `calibrated_weight_hit`); records, rolls, and sets
    `state.scale` to the scale; zeroes `counts`."""
    vec = _new(partial.device, shape=(3,))
    out = _launch("calibrated_weight", fmt, vec, partial, state=state, counts=counts, margin=margin, reduce=reduce)
    state.scale = out["scale"]
    return dict(out, bound=vec[0:1])


def calibrated_weight_hit(state, bound: torch.Tensor, scale: torch.Tensor, fmt) -> None:
    """A cached calibrated weight's state update: record `bound` again, roll, `state.scale` = scale."""
    _launch("weight_hit", fmt, bound, state=state)
    state.scale = scale


def delayed_update(amax_partial, counts, state, fmt, margin: int, most_recent: bool, reduce=None) -> dict:
    """TE's delayed-scaling update after a quantize pass (module docstring, DELAYED): 'scale_inv'
    of the scale the pass used; records its amax (NaN when `counts` saw one), sets `state.scale`
    to the next scale and rolls the history."""
    out = _launch("delayed", fmt, _new(counts.device, shape=(3,)), amax_partial, state=state, counts=counts,
                  margin=margin, most_recent=most_recent, reduce=reduce)
    state.scale = out["state_scale"]
    return out
