"""Our FP8 quantization method inside SGLang: FP8 rollouts computed with megatron_fp8rl.fp8.

Owns: `Fp8RLConfig` (SGLang `QuantizationConfig`, method name `OUR_FP8_METHOD`), its linear method
`Fp8RLLinearMethod`, and `register()`, the `sglang.srt.plugins` entry point (setup.py) that SGLang's
`load_plugins()` runs in its main process, scheduler and detokenizer; it also pins SGLang's
torch_native attention calls to one thread (models/served_arithmetic.py), as the trainer runs them,
and on the CPU engine runs the high-precision linears' and lm_head's bf16 GEMMs as the trainer's
CPU shims do (compat/bf16_gemm.py: fp32 GEMM of the bf16 values, rounded once).
Which layers are decoder linears, how SGLang fuses them and the shard ids its loaders pass are the
model family's (models/families/<family>.py, looked up from the `hf_config` SGLang hands
`from_config`): a model whose family is unknown, or a linear its family does not list, is refused.
Must not import: convert, data, trainer, cli; of models only the pure-data family modules
(models.family, models.registry). Imports sglang: load it only where SGLang runs.

Checkpoint layouts served (what convert/fp8_export.py writes; `quant_method: fp8`):
- per tensor: weight E4M3 [N, K] + `weight_scale` (dequant multiplier, one per fused shard) and,
  with `activation_scheme: static`, `input_scale` (one per shard; the max is used, as SGLang's own
  fp8 does). Dynamic activations are quantized per token (row-wise), which no batch neighbour can
  change (DESIGN hazard 2).
- block: weight E4M3 + `weight_scale_inv` [ceil(n/bn), ceil(K/bk)] per fused shard for the
  config's `weight_block_size` [bn, bk] (128x128, or 1x128 / 1x32 for the groupwise /
  groupwise32 recipe's aligned rollouts), activations in 1 x bk groups per token.
Arithmetic (DESIGN hazard 3): static per-tensor activations with a uniform weight scale (the
aligned rollout) run exactly the trainer's FP8 linear: `quantize_with_scale_inv` then the
trainer's own `fp8_matmul_nt` (fp8/gemm.py) with the config's GEMM, by default
'batch_invariant' ('tiled' on CPU, the Triton kernel 'triton_invariant' on CUDA: a row's bits do
not depend on the batch, so decode steps and the trainer's whole-sequence recompute agree), bias
added in fp32, cast to the activation dtype. Block weights run `fp8_matmul_nt` with 1 x bk
activation groups, the trainer's groupwise arithmetic ('tiled' on CPU: fp32 GEMMs in fixed tiles;
the Triton kernel on CUDA): one call for the fused weight when its shards tile the block grid
(always so for 1 x bk groups), else one call per shard (128x128 blocks over q/k/v shards of 576/192/192
rows), outputs side by side. Dynamic per-token activations with a per-tensor or per-row weight
dequantize the same FP8 values and run one fp32 matmul (not an aligned layout). A config naming
'triton_invariant' raises for every layout the kernel has no code for.
SGLang 0.5.23 facts this relies on: the config's `weight_block_size` attribute must be square or
None (SGLang's CPU padding asserts it; 1x128 groups are kept as `block` only); fused qkv/gate_up layers load one scale per shard through the
parameter's own `weight_loader(param, tensor, shard_id)`; the class name must be in
`layers.linear.WEIGHT_LOADER_V2_SUPPORTED` so the FP8 weight loads through the v2 loader; Llama's
loader renames `weight_scale_inv` to `weight_scale` (Qwen's does not), so block scales answer to
both names; `end_weight_update()` re-runs `process_weights_after_loading`, which therefore only
checks and derives plain attributes, never replacing a Parameter.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.parameter import ModelWeightParameter
from sglang.srt.layers.quantization.base_config import LinearMethodBase, QuantizationConfig
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

from megatron_fp8rl.compat import versions
from megatron_fp8rl.compat.bf16_gemm import patch_sglang_bf16_gemms
from megatron_fp8rl.fp8.formats import E4M3
from megatron_fp8rl.fp8.gemm import fp8_matmul_nt, resolve_gemm
from megatron_fp8rl.fp8.quantize import (
    Fp8Tensor,
    dequantize_blockwise,
    quantize_blockwise,
    quantize_per_row,
    quantize_with_scale_inv,
    transposed_codes,
)
from megatron_fp8rl.models.served_arithmetic import align_torch_native_attention, tile_cpu_lm_head
from megatron_fp8rl.models.family import DecoderLinear, ModelFamily
from megatron_fp8rl.models.registry import family_for
from megatron_fp8rl.rollout.sglang_common import OUR_FP8_METHOD


def _native_fp8_unusable() -> bool:
    """SGLang's own fp8 linear needs CUDA, or Intel AMX on CPU (docs/design.md)."""
    from sglang.srt.utils import cpu_has_amx_support, is_cpu

    return is_cpu() and not cpu_has_amx_support()


def _is_skipped(prefix: str, ignored: list[str], family: ModelFamily) -> bool:
    """Whether the layer `prefix` (maybe fused from several HF linears) stays high precision."""
    layer, linear = family.sglang_linear(prefix)
    names = {f"layers.{layer}.{module}" for module in linear.hf}
    skipped = [any(name == i or name.startswith(i + ".") for i in ignored) for name in names]
    if any(skipped) and not all(skipped):
        raise ValueError(f"{OUR_FP8_METHOD}: fused layer {prefix} has some shards quantized and some not")
    return all(skipped)


class Fp8RLConfig(QuantizationConfig):
    """FP8 checkpoints (per-tensor or 128x128 block weights) served by megatron_fp8rl's FP8 math."""

    def __init__(self, family: ModelFamily, weight_block_size: list[int] | None, activation_scheme: str,
                 ignored_layers: list[str], gemm: str = "batch_invariant"):
        super().__init__()
        self.family = family
        """The served model's family: its decoder linears and SGLang's fused names for them."""
        resolve_gemm(gemm, torch.device("cpu"))  # reject an unknown name now
        self.gemm = gemm
        """The FP8 GEMM of fp8/gemm.py GEMMS; the trainer's aligned recompute must use the same."""
        if activation_scheme not in ("dynamic", "static"):
            raise ValueError(f"{OUR_FP8_METHOD}: activation_scheme must be dynamic or static, not {activation_scheme!r}")
        if weight_block_size is not None:
            if len(weight_block_size) != 2 or activation_scheme != "dynamic":
                raise ValueError(f"{OUR_FP8_METHOD}: block scales need a 2-D weight_block_size and dynamic "
                                 f"activations; found {weight_block_size}, {activation_scheme}")
            weight_block_size = [int(b) for b in weight_block_size]
        self.block = tuple(weight_block_size) if weight_block_size is not None else None
        """The weight block (rows, columns) of a block checkpoint; None per tensor."""
        # SGLang reads `weight_block_size` to pad heads and MLP widths for CPU tensor parallelism
        # and asserts it is square (configs/update_config.py); 1xN groups split anywhere, so they
        # need no padding and are not shown to it.
        square = self.block is not None and self.block[0] == self.block[1]
        self.weight_block_size = weight_block_size if square else None
        self.activation_scheme = activation_scheme
        self.ignored_layers = [name.removeprefix("model.") for name in ignored_layers]

    def get_name(self) -> str:
        return OUR_FP8_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Fp8RLConfig":
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"{OUR_FP8_METHOD}: only E4M3 checkpoints are served, found fmt={fmt!r}")
        if config.get("hf_config") is None:
            raise ValueError(f"{OUR_FP8_METHOD}: SGLang passed no hf_config with the quantization config; "
                             "the model family (its decoder linears) is unknown")
        family = family_for(config["hf_config"].to_dict())
        ignored = cls.get_from_keys_or(config, ["ignored_layers", "modules_to_not_convert"], None) or []
        return cls(family, cls.get_from_keys_or(config, ["weight_block_size"], None),
                   cls.get_from_keys_or(config, ["activation_scheme"], "dynamic"), list(ignored))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant) -> str | None:
        """Claim standard `quant_method: fp8` checkpoints when asked for by name, or when nothing
        was asked and SGLang's own fp8 cannot run here (a CPU without AMX)."""
        if not hf_quant_cfg or hf_quant_cfg.get("quant_method") not in ("fp8", OUR_FP8_METHOD):
            return None
        if user_quant == OUR_FP8_METHOD or (user_quant is None and _native_fp8_unusable()):
            return OUR_FP8_METHOD
        return None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        """Our linear method for quantized decoder linears; plain linears for the ones left in
        high precision; None (unquantized) for embeddings, lm_head and everything else. A linear
        layer the family does not list raises UnsupportedModelError naming it."""
        if not isinstance(layer, LinearBase):
            return None
        if _is_skipped(prefix, self.ignored_layers, self.family):
            return UnquantizedLinearMethod()
        return Fp8RLLinearMethod(self, prefix)

    def get_scaled_act_names(self) -> list[str]:
        return []


def _shard_index(shard_id, linear: DecoderLinear, prefix: str) -> int:
    """The position of SGLang's `shard_id` among the linear's HF parts (None: unfused)."""
    ids = linear.sglang_shards or (None,)
    if shard_id not in ids:
        raise ValueError(f"{prefix}: unknown shard {shard_id!r} of a layer with shards {ids}")
    return ids.index(shard_id)


class Fp8RLLinearMethod(LinearMethodBase):
    """y = x @ W^T + b for one (maybe fused) linear layer whose W is stored in FP8."""

    def __init__(self, config: Fp8RLConfig, prefix: str):
        self.config, self.prefix = config, prefix
        self.linear = config.family.sglang_linear(prefix)[1]
        self.block = config.block

    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra):
        shards = list(output_partition_sizes)
        if len(shards) != len(self.linear.hf):
            raise ValueError(f"{self.prefix}: SGLang fuses {len(shards)} shards, the {self.config.family.name} family's "
                             f"{self.linear.megatron} has {len(self.linear.hf)}: {', '.join(self.linear.hf)}")
        weight = ModelWeightParameter(
            data=torch.empty(sum(shards), input_size_per_partition, dtype=E4M3.dtype),
            input_dim=1, output_dim=0, weight_loader=extra.get("weight_loader"))
        layer.register_parameter("weight", weight)
        layer.fp8rl_shards = shards
        if self.block is not None:
            self._create_block_scales(layer, shards, input_size_per_partition)
            return
        self._register_scale(layer, "weight_scale", torch.full((len(shards),), math.nan))
        if self.config.activation_scheme == "static":
            self._register_scale(layer, "input_scale", torch.full((len(shards),), math.nan))
        else:
            layer.register_parameter("input_scale", None)

    def _create_block_scales(self, layer, shards: list[int], in_features: int) -> None:
        if getattr(layer, "tp_size", 1) > 1:
            raise NotImplementedError(f"{self.prefix}: {OUR_FP8_METHOD} block scales with tensor "
                                      "parallelism are not implemented; use fp8_backend='sglang'")
        bn, bk = self.block
        rows = [math.ceil(n / bn) for n in shards]
        layer.fp8rl_scale_rows = rows
        scale = self._register_scale(layer, "weight_scale_inv",
                                     torch.full((sum(rows), math.ceil(in_features / bk)), math.nan))
        # Llama's load_weights renames weight_scale_inv -> weight_scale; Qwen's keeps it. A second
        # Parameter over the same storage (named_parameters drops a repeated Parameter object).
        alias = torch.nn.Parameter(scale.data, requires_grad=False)
        alias.weight_loader = scale.weight_loader
        layer.register_parameter("weight_scale", alias)

    def _register_scale(self, layer, name: str, data: torch.Tensor) -> torch.nn.Parameter:
        param = torch.nn.Parameter(data.float(), requires_grad=False)
        method = self

        def load(param, loaded: torch.Tensor, shard_id=None):
            method._load_scale(layer, name, param, loaded, shard_id)
        param.weight_loader = load
        layer.register_parameter(name, param)
        return param

    def _load_scale(self, layer, name: str, param, loaded: torch.Tensor, shard_id) -> None:
        index = _shard_index(shard_id, self.linear, self.prefix)
        if self.block is None:
            if loaded.numel() != 1:
                raise ValueError(f"{self.prefix}.{name}: expected one per-tensor scale, found shape {tuple(loaded.shape)}")
            param.data[index] = loaded.float().reshape(())
            return
        rows = layer.fp8rl_scale_rows
        start = sum(rows[:index])
        want = (rows[index], param.shape[1])
        if tuple(loaded.shape) != want:
            raise ValueError(f"{self.prefix}.{name} shard {shard_id!r}: expected block scales of shape {want}, "
                             f"found {tuple(loaded.shape)}")
        param.data[start:start + rows[index]] = loaded.float()

    def process_weights_after_loading(self, layer) -> None:
        """Check every scale was loaded and derive the per-output-row weight multipliers; runs
        after the first load and after every weight update (idempotent, Parameters untouched)."""
        names = ["weight_scale_inv"] if self.block else ["weight_scale"]
        if getattr(layer, "input_scale", None) is not None:
            names.append("input_scale")
        for name in names:
            if torch.isnan(getattr(layer, name)).any():
                raise ValueError(f"{self.prefix}.{name} was not loaded (check the FP8 checkpoint names)")
        if self.block is None:
            scales = layer.weight_scale.detach()
            layer.fp8rl_uniform_weight_scale = bool((scales == scales[0]).all())
            widths = torch.tensor(layer.fp8rl_shards, device=scales.device)
            layer.fp8rl_row_scale_inv = scales.repeat_interleave(widths)[:, None].clone()
        layer.fp8rl_pieces = self._pieces(layer)

    def _pieces(self, layer) -> list[Fp8Tensor]:
        """The served weight as the FP8 operands of its GEMMs, derived once per load (every weight
        update re-derives them): one for the fused weight, or, for block weights whose fused shards
        do not tile the block grid (SmolLM2's q/k/v: 576/192/192 rows in 128-row blocks), one per
        shard, whose outputs `apply` places side by side."""
        gemm = resolve_gemm(self.config.gemm, layer.weight.device)
        if self.block is None:
            if layer.fp8rl_uniform_weight_scale:
                return [self._operand(layer.weight, layer.weight_scale[0], "tensor", gemm)]
            return [self._operand(layer.weight, layer.fp8rl_row_scale_inv, "row", gemm)]
        if self._tiles_block_grid(layer):
            return [self._operand(layer.weight, layer.weight_scale_inv, "block", gemm)]
        pieces, row, scale_row = [], 0, 0
        for width, rows in zip(layer.fp8rl_shards, layer.fp8rl_scale_rows):
            pieces.append(self._operand(layer.weight[row:row + width],
                                        layer.weight_scale_inv[scale_row:scale_row + rows], "block", gemm))
            row, scale_row = row + width, scale_row + rows
        return pieces

    def _operand(self, data: torch.Tensor, scale_inv: torch.Tensor, granularity: str, gemm: str) -> Fp8Tensor:
        """One GEMM operand with the widened copy its CPU GEMM reads, kept so that decode steps do
        not widen the weight again each call: 'exact': the codes in fp64 (per tensor or row [N, K]
        `dense`, block [K, N] `dense_t`); 'tiled': per tensor or row the codes in fp32 (`dense`),
        block the dequantized values in fp32 [N, K] (`values`). `python bench/exact_gemm.py`
        (SmolLM2's four linears of a layer, 16 decode rows, one thread, quiet box, 2026-12-03):
        per tensor 'exact' 7.53 ms, 'tiled' 3.40, an fp32 GEMM 3.04; 1x32 groups 11.46 / 3.38 / 2.46."""
        data, scale_inv = data.detach(), scale_inv.detach()
        block = self.block if granularity == "block" else None
        kept = {}
        if gemm == "exact":
            kept = {"dense_t": transposed_codes(data).double()} if block else {"dense": data.double()}
        elif gemm == "tiled":
            kept = {"values": dequantize_blockwise(data, scale_inv, block)} if block else {"dense": data.float()}
        return Fp8Tensor(data, scale_inv, granularity, block, **kept)

    def _tiles_block_grid(self, layer) -> bool:
        """Whether the fused shards' scale rows are the fused weight's own block grid."""
        return all(width % self.block[0] == 0 for width in layer.fp8rl_shards[:-1])

    def _input(self, layer, x2d: torch.Tensor):
        if self.block is not None:
            # 1 x bk groups of a token, bk the weight blocks' K width (128x128 or 1x128: 1x128;
            # a 1x32 weight-group checkpoint: 1x32, as the groupwise32 trainer quantizes)
            return quantize_blockwise(x2d, E4M3, (1, self.block[1]))
        if layer.input_scale is not None:
            return quantize_with_scale_inv(x2d, layer.input_scale.max(), E4M3)
        return quantize_per_row(x2d, E4M3)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        x_q, pieces = self._input(layer, x2d), layer.fp8rl_pieces
        if self.config.gemm == "triton_invariant" or x_q.granularity == pieces[0].granularity:
            gemm = resolve_gemm(self.config.gemm, x.device)  # tensor x tensor or block x block
            y = torch.cat([fp8_matmul_nt(x_q, w_q, gemm) for w_q in pieces], dim=1)
        else:  # per-token activations x a per-tensor or per-row weight: not the aligned layout
            y = x_q.dequantize() @ pieces[0].dequantize().t()
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], layer.weight.shape[0])


def register() -> None:
    """The `sglang.srt.plugins` entry point: make `OUR_FP8_METHOD` a quantization method SGLang
    knows in this process (idempotent). Registering only in a parent process is not enough: the
    scheduler is spawned and runs `load_plugins()` itself (docs/design.md hazard 5).

    It runs in every SGLang process of the environment, where our entry points' version gate never
    ran: so it runs that gate first (compat/versions.py, with this process's override
    MEGATRON_FP8RL_ALLOW_UNTESTED) and stops the process with a one-line reason before patching
    anything of an untested version."""
    try:
        versions.gate(os.environ)
    except (versions.UntestedVersionError, ValueError) as error:
        raise SystemExit(f"megatron_fp8rl SGLang plugin: {error}") from None
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers import linear, quantization

    align_torch_native_attention()  # one query row a call, one thread: the trainer repeats them
    tile_cpu_lm_head()  # float32 lm_head in 16-row tiles, as the trainer's served-layout output layer
    patch_sglang_bf16_gemms()  # bf16 rollouts on CPU: the GPU's GEMM arithmetic, ~fp32 speed

    # SGLang's registries (module-level dicts and lists, not a plugin API): checked to exist first
    for registry in ("QUANTIZATION_METHODS", "CPU_QUANTIZATION_METHODS"):
        versions.expect(quantization, registry, dist="sglang")[OUR_FP8_METHOD] = Fp8RLConfig
    for owner, registry, name in ((linear, "WEIGHT_LOADER_V2_SUPPORTED", Fp8RLLinearMethod.__name__),
                                  (choices, "QUANTIZATION_CHOICES", OUR_FP8_METHOD)):
        names = versions.expect(owner, registry, dist="sglang")
        if name not in names:
            names.append(name)
