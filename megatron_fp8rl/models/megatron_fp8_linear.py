"""Megatron-Core local-spec linear layers whose GEMMs run through our FP8 linear (the CPU tier).

Owns: `Fp8ColumnParallelLinear` / `Fp8RowParallelLinear` (drop-ins for the
`ColumnParallelLinear` / `RowParallelLinear` that `get_gpt_layer_local_spec()` uses),
`fp8_local_layer_spec(recipe)` (that spec with them swapped in), `fp8_layer_stats(model)`, and
the per-decoder-layer view the rollout alignment needs: `fp8_decoder_linears(model)` (global layer
number, path, module), `shared_fp8_scales(model)` (the scales a rollout engine must use to
compute what the next forward computes) and `frozen_fp8_scales(model, scales)` (a pass whose weight and input
quantizers use given dequant multipliers, e.g. those the rollout engine served),
`held_fp8_weight_scales(model)` (every FP8 linear's weight scales held at the current weights'
while the weights move: a step's mini-batches at θ_old's scales) and
`high_precision_fp8_linears(model)` (a pass with every FP8 linear in high precision: the shadow).
Must not import: anything above layer L2 (convert, rollout, data, trainer, cli).

What changes against Megatron's layers: only `_forward_impl`, the matmul (megatron-core 0.16.1's
`linear_with_grad_accumulation_and_async_allreduce`), which becomes
`megatron_fp8rl.fp8.linear.fp8_linear`. Importing this module asserts that override's signature
against Megatron's (compat/versions.check_signature): a new Megatron argument raises, never
vanishes into **kwargs. Tensor parallelism keeps Megatron's semantics: a column
layer's input gradient is all-reduced over the TP group (`copy_to_tensor_model_parallel_region`
around the FP8 function does exactly the backward all-reduce Megatron's fused function does);
row layers reduce their output in Megatron's own `forward`. Sequence parallelism (not supported by
the local spec on CPU either), gradient-accumulation fusion (a fused CUDA wgrad kernel) and
deferred embedding wgrads are rejected with a ValueError.
Scales: amaxes are all-reduced (MAX) over Megatron's amax-reduction group (TP x DP x CP, as TE's
`get_fp8_context` uses), so every TP shard of a layer shares one per-tensor scale and a TP
reshard keeps scales valid. The scaling state travels in `_extra_state` (as TE's does): plain
`state_dict()` carries it, and Megatron's `sharded_state_dict` wraps it in a replicated
ShardedObject for dist_checkpointing (bf16 conversion of the module leaves it fp32).
The vocabulary projection (GPTModel.output_layer) is built by GPTModel itself, not by the layer
spec, so it stays in high precision.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_fp8rl.compat.versions import check_signature
from megatron_fp8rl.fp8.gemm import check_recipe_gemm, resolve_gemm
from megatron_fp8rl.fp8.linear import fp8_linear, load_quantizers_extra_state, quantizers_extra_state
from megatron_fp8rl.fp8.quantizer import frozen_quantizers, held_weight_scales, make_quantizers, next_scale
from megatron_fp8rl.fp8.recipe import CalibratedDelayedScaling, Fp8Recipe


def _amax_reduction_group():
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_amax_reduction_group(with_context_parallel=True)


def _check_supported(name: str, sequence_parallel: bool, gradient_accumulation_fusion: bool,
                     grad_output_buffer) -> None:
    unsupported = {
        "sequence_parallel": sequence_parallel,
        "gradient_accumulation_fusion": gradient_accumulation_fusion,
        "defer_embedding_wgrad_compute": grad_output_buffer is not None,
    }
    found = [key for key, value in unsupported.items() if value]
    if found:
        raise ValueError(f"{name}: the FP8 local linear does not support {', '.join(found)}; "
                         "set them False in the TransformerConfig")


class _Fp8LinearMixin:
    """FP8 matmul and FP8 scaling state for a Megatron parallel linear layer."""

    def _init_fp8(self, fp8_recipe: Fp8Recipe | None, fp8_gemm: str) -> None:
        resolve_gemm(fp8_gemm, torch.device("cpu"))  # reject an unknown name at build time
        self.fp8_recipe = CalibratedDelayedScaling() if fp8_recipe is None else fp8_recipe
        # the device the layer computes on: Megatron's GPU tier puts it on CUDA when there is one
        check_recipe_gemm(self.fp8_recipe, fp8_gemm, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        self.fp8_gemm = fp8_gemm
        self.fp8_quantizers = make_quantizers(self.fp8_recipe, _amax_reduction_group())
        self.fp8_high_precision = False
        """True inside `high_precision_fp8_linears`: Megatron's own matmul, no quantizer touched."""

    def _forward_impl(self, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                      sequence_parallel, grad_output_buffer=None, wgrad_deferral_limit=0,
                      async_grad_allreduce=None, tp_group=None):
        """Megatron's `linear_with_grad_accumulation_and_async_allreduce`, parameter for parameter
        (checked at import), computed by our FP8 linear."""
        if self.fp8_high_precision:
            return super()._forward_impl(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                                         sequence_parallel, grad_output_buffer, wgrad_deferral_limit,
                                         async_grad_allreduce, tp_group)
        _check_supported(type(self).__name__, sequence_parallel, gradient_accumulation_fusion,
                         grad_output_buffer)
        if async_grad_allreduce is not None:  # Megatron's deprecated alias
            allreduce_dgrad = async_grad_allreduce
        if allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        return fp8_linear(input, weight, bias, self.fp8_quantizers, self.fp8_gemm)

    def get_extra_state(self) -> dict:
        """FP8 scaling state (amax histories and scales) for checkpoints."""
        return quantizers_extra_state(self.fp8_recipe, self.fp8_quantizers)

    def set_extra_state(self, state) -> None:
        """Restore the FP8 scaling state; None (no FP8 state saved) keeps the current one."""
        load_quantizers_extra_state(self.fp8_quantizers, state, type(self).__name__)

    def fp8_stats(self) -> dict:
        """{role: QuantStats of the last quantization} of this layer."""
        return self.fp8_quantizers.stats()


def _megatron_forward_impl(self, input, weight, *args, **kwargs):
    """The `_forward_impl` of Megatron's parallel linears we override: it passes everything on to
    linear_with_grad_accumulation_and_async_allreduce."""


check_signature(_Fp8LinearMixin._forward_impl, linear_with_grad_accumulation_and_async_allreduce,
                "Fp8*ParallelLinear._forward_impl vs megatron linear_with_grad_accumulation_and_async_allreduce")
for _layer in (ColumnParallelLinear, RowParallelLinear):
    check_signature(_layer._forward_impl, _megatron_forward_impl, f"{_layer.__name__}._forward_impl",
                    skip_first=False)


class Fp8ColumnParallelLinear(_Fp8LinearMixin, ColumnParallelLinear):
    """ColumnParallelLinear with FP8 GEMMs (module docstring); keywords `fp8_recipe` and
    `fp8_gemm` (megatron_fp8rl.fp8.gemm.GEMMS)."""

    def __init__(self, *args, fp8_recipe: Fp8Recipe | None = None, fp8_gemm: str = "auto",
                 **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fp8(fp8_recipe, fp8_gemm)


class Fp8RowParallelLinear(_Fp8LinearMixin, RowParallelLinear):
    """RowParallelLinear with FP8 GEMMs (module docstring); keywords `fp8_recipe` and
    `fp8_gemm` (megatron_fp8rl.fp8.gemm.GEMMS)."""

    def __init__(self, *args, fp8_recipe: Fp8Recipe | None = None, fp8_gemm: str = "auto",
                 **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fp8(fp8_recipe, fp8_gemm)


def _swap_linears(spec, replacements: dict):
    """A copy of the spec tree with each class in `replacements` replaced by its ModuleSpec."""
    if isinstance(spec, type) and spec in replacements:
        return replacements[spec]
    if isinstance(spec, ModuleSpec):
        if spec.module in replacements:
            new = replacements[spec.module]
            return dataclasses.replace(new, params={**spec.params, **new.params})
        return dataclasses.replace(spec, submodules=_swap_linears(spec.submodules, replacements))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _swap_linears(getattr(spec, f.name), replacements)
                   for f in dataclasses.fields(spec) if f.init}
        return dataclasses.replace(spec, **changes)
    return spec


def fp8_local_layer_spec(recipe: Fp8Recipe | None = None, gemm: str = "auto",
                         **local_spec_kwargs):
    """`get_gpt_layer_local_spec(**local_spec_kwargs)` with every Column/RowParallelLinear
    (attention qkv and projection, MLP fc1 and fc2) replaced by its FP8 drop-in using `recipe`
    (default CalibratedDelayedScaling()) and FP8 GEMM `gemm` (fp8/gemm.py GEMMS)."""
    recipe = CalibratedDelayedScaling() if recipe is None else recipe
    replacements = {
        layer: ModuleSpec(module=fp8_layer, params={"fp8_recipe": recipe, "fp8_gemm": gemm})
        for layer, fp8_layer in ((ColumnParallelLinear, Fp8ColumnParallelLinear),
                                 (RowParallelLinear, Fp8RowParallelLinear))
    }
    return _swap_linears(get_gpt_layer_local_spec(**local_spec_kwargs), replacements)


def fp8_layer_stats(model: torch.nn.Module) -> dict[str, dict[str, float]]:
    """{'<module name>.<role>': QuantStats as floats} for every FP8 linear in `model`, for a
    per-step logger."""
    stats = {}
    for name, module in model.named_modules():
        if isinstance(module, _Fp8LinearMixin):
            for role, role_stats in module.fp8_stats().items():
                stats[f"{name}.{role}"] = role_stats.as_floats()
    return stats


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """This rank's TransformerLayers of a GPTModel, through DDP / Float16Module wrappers (their
    `layer_number` counts from the first pipeline stage, from 1)."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return list(model.decoder.layers)


def fp8_decoder_linears(model: torch.nn.Module) -> list[tuple[int, str, torch.nn.Module]]:
    """(global 0-based layer number, path inside the TransformerLayer, module) of every FP8 linear
    of this rank's pipeline stage (the layer number counts from the first stage, as HF names do).
    The paths are the layers' own ("self_attention.linear_qkv", ...): which HF linears each one
    stands for is the model family's fact (models/families/<family>.py `DecoderLinear.megatron`)."""
    return [(layer.layer_number - 1, path, module)
            for layer in decoder_layers(model)
            for path, module in layer.named_modules() if isinstance(module, _Fp8LinearMixin)]


def shared_fp8_scales(model: torch.nn.Module) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """{(global layer, path): (weight_scale_inv, input_scale_inv)} of this rank's FP8 linears, fp32
    scalars on CPU: what their next forward would use (fp8.quantizer.next_scale; a calibrated
    weight's scale is all-reduced over the amax group, so all its ranks call this together)."""
    scales = {}
    for layer, path, module in fp8_decoder_linears(model):
        quantizers = module.fp8_quantizers
        weight = next_scale(quantizers.weight, module.weight.detach())
        scales[(layer, path)] = (weight.reciprocal().cpu(), next_scale(quantizers.input).reciprocal().cpu())
    return scales


@contextmanager
def frozen_fp8_scales(model: torch.nn.Module, scales: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                      observe: bool = False):
    """Within the block every FP8 linear of `model` quantizes its weight and input per tensor with
    the given dequant multipliers `scales[(layer, path)] = (weight_scale_inv, input_scale_inv)`
    (fp8.quantize.quantize_with_scale_inv). observe=False: no scaling state changes, no
    collectives (logprob passes); observe=True: the live quantizers still advance as if they had
    served the pass (fp8.quantizer.frozen_quantizers; training forwards). KeyError naming a layer
    without scales."""
    linears = fp8_decoder_linears(model)
    missing = [f"{layer}.{path}" for layer, path, _ in linears if (layer, path) not in scales]
    if missing:
        raise KeyError(f"frozen FP8 scales missing for decoder layers {missing[:4]}")
    saved = [(module, module.fp8_quantizers) for _, _, module in linears]
    try:
        for layer, path, module in linears:
            module.fp8_quantizers = frozen_quantizers(module.fp8_quantizers, *scales[(layer, path)],
                                                       observe=observe)
        yield
    finally:
        for module, quantizers in saved:
            module.fp8_quantizers = quantizers


@contextmanager
def held_fp8_weight_scales(model: torch.nn.Module):
    """Within the block every FP8 linear of `model` quantizes its weight with the scales its live
    quantizer gives the weight as it is on entry (fp8.quantizer.HeldScaleWeightQuantizer), however
    the weight moves inside; on exit the live quantizers return. For a step's update
    (model.fp8_step_weight_scales=frozen): entered at θ_old, the first mini-batch quantizes as the
    recompute did and the later ones keep θ_old's block scales. ValueError naming a layer whose
    recipe has no current-scaling weight quantizer, or whose weight is not on the CPU (the device
    path has no kernel for held scales)."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, _Fp8LinearMixin)]
    saved = [(module, module.fp8_quantizers) for _, module in linears]
    try:
        for name, module in linears:
            if module.weight.device.type != "cpu":
                raise ValueError(f"{name}: held FP8 weight scales (model.fp8_step_weight_scales=frozen) run on "
                                 f"the CPU tier only; the weight is on {module.weight.device}")
            try:
                module.fp8_quantizers = held_weight_scales(module.fp8_quantizers, module.weight)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
        yield
    finally:
        for module, quantizers in saved:
            module.fp8_quantizers = quantizers


def has_fp8_linears(model: torch.nn.Module) -> bool:
    """Whether any of `model`'s modules is one of our FP8 linears."""
    return any(isinstance(m, _Fp8LinearMixin) for m in model.modules())


@contextmanager
def high_precision_fp8_linears(model: torch.nn.Module):
    """Within the block every FP8 linear of `model` computes its GEMM in the weights' own dtype
    through Megatron's unmodified linear (the high-precision shadow of Calibrated Clipping): no
    quantizer runs, so no amax history, scale, cache or statistic changes. ValueError when
    `model` has no FP8 linear (nothing would differ from its normal forward)."""
    linears = [m for m in model.modules() if isinstance(m, _Fp8LinearMixin)]
    if not linears:
        raise ValueError("high_precision_fp8_linears: the model has no FP8 linear layers")
    try:
        for module in linears:
            module.fp8_high_precision = True
        yield
    finally:
        for module in linears:
            module.fp8_high_precision = False
