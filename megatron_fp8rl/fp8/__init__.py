"""FP8 numerics (layer L0): formats, saturating quantize/dequantize, TE-style delayed scaling,
calibration criteria, recipe specs, per-quantizer statistics and our FP8 linear layer.

Owns: everything that decides how a high-precision tensor becomes FP8 on either runtime tier,
and the FP8 serving contract between trainer and rollout (recipe.py's promises, serving.py's plan).
Must not import: megatron, transformer_engine, megatron_fp8rl.compat or anything above L0
(torch and the standard library only; fp8/triton_gemm.py also triton, imported at first use of
the triton_invariant GEMM). TE and Megatron adapters live in megatron_fp8rl/compat/.
"""
from megatron_fp8rl.fp8.calibration import CRITERIA, calibrate_bound
from megatron_fp8rl.fp8.formats import E4M3, E5M2, Fp8Format, get_format, recipe_formats
from megatron_fp8rl.fp8.linear import Fp8Linear, fp8_linear
from megatron_fp8rl.fp8.quantize import (
    Fp8Tensor,
    dequantize,
    dequantize_blockwise,
    quantize,
    quantize_blockwise,
    quantize_per_row,
    quantize_per_tensor,
    scale_from_bound,
)
from megatron_fp8rl.fp8.quantizer import Fp8Quantizers, make_quantizers
from megatron_fp8rl.fp8.recipe import (
    BlockwiseScaling,
    CalibratedDelayedScaling,
    CurrentScaling,
    DelayedScaling,
    megatron_default_delayed,
    recipe_by_name,
    te_default_delayed,
)
from megatron_fp8rl.fp8.stats import QuantStats

__all__ = [
    "CRITERIA", "calibrate_bound", "E4M3", "E5M2", "Fp8Format", "get_format", "recipe_formats",
    "Fp8Linear", "fp8_linear", "Fp8Tensor", "dequantize", "dequantize_blockwise", "quantize",
    "quantize_blockwise", "quantize_per_row", "quantize_per_tensor", "scale_from_bound",
    "Fp8Quantizers", "make_quantizers", "BlockwiseScaling", "CalibratedDelayedScaling",
    "CurrentScaling", "DelayedScaling", "megatron_default_delayed", "recipe_by_name",
    "te_default_delayed", "QuantStats",
]
