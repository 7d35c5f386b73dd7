"""What the in-process SGLang engine and the SGLang server share: their configuration, the
translation of our sampling parameters into SGLang's, and of SGLang's outputs into `RolloutSample`s.

Owns: `SGLangSettings` (the run config's rollout section is one), `SGLangConfig`, `MEMORY_TAGS`,
`engine_kwargs`, `server_argv`, `sglang_sampling`, `parse_outputs`, and the rollout FP8 modes
(`ACTIVATION_SCHEMES`, `FP8_BACKENDS`, `check_aligned_backend`, `check_fp8_checkpoint`): which
SGLang quantization method serves each mode, and the check that the served checkpoint has a layout
the mode loads (the modes themselves, `RolloutFp8`/`ROLLOUT_FP8`, and their layouts are
fp8/serving.py's). trainer/config.py takes these names and checks from here.
Must not import: convert, data, trainer, cli; and not sglang itself (the server client
never imports it).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_fp8rl.fp8.serving import ROLLOUT_FP8, RolloutFp8, served_layouts
from megatron_fp8rl.rollout.engine import RolloutEngineError, RolloutSample, SamplingParams

# SGLang returns logprobs of logits / temperature unless this is set in its scheduler's environment
# (docs/design.md, integration hazard 1); RL needs the temperature-1 policy's logprobs.
ENGINE_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""SGLang's memory kinds that `release_memory_occupation` frees (its GPU_MEMORY_ALL_TYPES)."""
OUR_FP8_METHOD = "fp8rl"
"""SGLang quantization method name of rollout/sglang_fp8.py (registered by its plugin)."""
"""none: serve the checkpoint's dtype; blockwise: 128x128 weight blocks with 1x128 activation
groups; per_tensor: per-tensor weights, activations per `activation_scheme`; aligned: the trainer's
own FP8 quantization (a per-tensor static checkpoint whose weight syncs carry the trainer's
scales, or, for the groupwise trainer recipe, a 1x128 block checkpoint with dynamic groups)."""
ACTIVATION_SCHEMES = ("dynamic", "static")
"""How per_tensor rollouts scale activations: dynamic (per token) or static (the checkpoint's
input_scale)."""
FP8_BACKENDS = ("ours", "sglang")
"""ours: megatron_fp8rl's method (our fp8/ arithmetic, runs on CPU; the only one that makes
aligned rollouts bit-identical to the trainer); sglang: SGLang's native `fp8` kernels (GPU, or
CPU with AMX): faster, same checkpoint format, not bit-aligned with the trainer."""


CPU_WATCHDOG_TIMEOUT_S = 3600.0
"""SGLang's scheduler watchdog on the CPU tier: the longest one forward batch may take."""


SGLANG_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Dtypes SGLang serves in."""


@dataclass
class SGLangSettings:
    """How to start SGLang, whatever it serves: the user's settings (the run config's rollout
    section is one: trainer/config.py). Errors name the field ("fp8: ..."); SGLangConfig and the
    run config prefix them."""

    dtype: str = "auto"
    """Weight/activation dtype SGLang serves in (one of SGLANG_DTYPES)."""
    device: str | None = None
    """"cpu" or "cuda"; None picks cuda when available."""
    attention_backend: str | None = None
    """None picks "torch_native" on CPU and SGLang's default on GPU."""
    max_total_tokens: int | None = None
    """Cap on KV-cache tokens; set it on CPU, where SGLang otherwise sizes the cache from host RAM."""
    mem_fraction_static: float | None = None
    """Fraction of device memory for weights + KV cache; None keeps SGLang's default."""
    deterministic: bool = False
    """SGLang's deterministic inference (needed for per-sample seeds to take effect)."""
    log_level: str = "error"
    """SGLang's log level."""
    fp8: str = "none"
    """Rollout FP8 mode (ROLLOUT_FP8): none (serve `dtype`); blockwise (128x128 weight blocks,
    1x128 activation groups: SGLang's native FP8 format); per_tensor (per-tensor weights,
    activations per `activation_scheme`); aligned (the trainer's own FP8 weights and bounds, so
    trainer and rollout quantize bit-identically). Anything but none needs an FP8 checkpoint of
    that layout (megatron_fp8rl.convert.fp8_export writes them)."""
    activation_scheme: str = "dynamic"
    """per_tensor activations: dynamic (per-token scales) or static (the checkpoint's input_scale).
    aligned is always static; blockwise always dynamic."""
    fp8_backend: str = "ours"
    """Which SGLang quantization method serves FP8 (FP8_BACKENDS): ours (megatron_fp8rl's, the
    trainer's FP8 arithmetic; runs on CPU; required by aligned) or sglang (SGLang's native fp8
    kernels: GPU, or CPU with AMX; faster, not bit-aligned with the trainer)."""
    memory_saver: bool | None = None
    """In-process engine: let `release_memory` free device memory (SGLang's enable_memory_saver,
    torch_memory_saver). None: on for CUDA. GPU only (it hooks CUDA allocations); True is refused
    on the CPU."""
    extra: dict = field(default_factory=dict)
    """Further SGLang ServerArgs, passed through unchanged (and last: they win)."""

    def __post_init__(self):
        if self.dtype not in SGLANG_DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {SGLANG_DTYPES}")
        if self.memory_saver and self.resolved_device() == "cpu":
            raise ValueError("memory_saver: torch_memory_saver frees CUDA memory only; "
                             "on the CPU release_memory runs SGLang's protocol without it")
        if self.fp8 not in ROLLOUT_FP8:
            raise ValueError(f"fp8: {self.fp8!r} is not one of {ROLLOUT_FP8}")
        if self.activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"activation_scheme: {self.activation_scheme!r} is not one of {ACTIVATION_SCHEMES}")
        if self.fp8_backend not in FP8_BACKENDS:
            raise ValueError(f"fp8_backend: {self.fp8_backend!r} is not one of {FP8_BACKENDS}")
        try:
            check_aligned_backend(self.fp8_mode, self.fp8_backend)
        except ValueError as error:
            raise ValueError(f"fp8_backend: {error}") from None

    def resolved_device(self) -> str:
        return self.device or ("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def fp8_mode(self) -> RolloutFp8:
        """`fp8` as the typed rollout FP8 mode (fp8/serving.py)."""
        return RolloutFp8(self.fp8)


@dataclass
class SGLangConfig(SGLangSettings):
    """How to start SGLang for rollouts: the settings, and what this engine or server serves."""

    model_path: str = field(kw_only=True)
    """Hugging Face checkpoint folder (config.json + *.safetensors)."""
    random_seed: int = 0
    """SGLang's global seed."""
    skip_tokenizer_init: bool = True
    """Prompts and outputs are token ids; SGLang loads no tokenizer."""
    initial_weight_version: int = 0
    """The version reported for the checkpoint's own weights."""

    def __post_init__(self):
        try:
            super().__post_init__()
        except ValueError as error:
            raise ValueError(f"SGLangConfig.{error}") from None

    @classmethod
    def serving(cls, settings: SGLangSettings, model_path: str, **launch) -> "SGLangConfig":
        """`settings` (every SGLangSettings field, whatever subclass holds them) serving
        `model_path`; `launch`: random_seed, skip_tokenizer_init, initial_weight_version."""
        own = {f.name: getattr(settings, f.name) for f in dataclasses.fields(SGLangSettings)}
        return cls(**own, model_path=str(model_path), **launch)

    def fp8_layouts(self) -> tuple[tuple[str, str], ...]:
        """The (scheme 'block'|'tensor', activation scheme) layouts the served checkpoint may
        have; () when the rollout is not FP8. aligned: per-tensor static (a shared-scale trainer
        recipe) or block dynamic (a row-group recipe's 1x128 weight groups): fp8/serving.py."""
        return served_layouts(self.fp8_mode, self.activation_scheme)


def check_aligned_backend(mode: RolloutFp8, fp8_backend: str) -> None:
    """fp8=aligned is served by our method only; ValueError otherwise (SGLangConfig's check and
    RunConfig's rollout.fp8_backend check)."""
    if mode is RolloutFp8.ALIGNED and fp8_backend != "ours":
        raise ValueError(f"fp8=aligned needs fp8_backend='ours', found {fp8_backend!r} (SGLang's native "
                         "kernels do not compute the trainer's FP8 arithmetic)")


def check_model_dir(model_path: str) -> Path:
    """Fail early, naming the path, when `model_path` is not a loadable HF checkpoint folder."""
    path = Path(model_path)
    if not path.is_dir():
        raise RolloutEngineError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise RolloutEngineError(f"model directory {path} has no config.json: not a Hugging Face checkpoint")
    if not any(path.glob("*.safetensors")):
        raise RolloutEngineError(f"model directory {path} has no *.safetensors weights")
    return path


def check_fp8_checkpoint(config: SGLangConfig) -> None:
    """The served checkpoint's `quantization_config` must fit `config.fp8` (an FP8 mode on a
    high-precision checkpoint, or the reverse, is refused naming what was found)."""
    path = check_model_dir(config.model_path)
    quant = json.loads((path / "config.json").read_text()).get("quantization_config")
    layouts = config.fp8_layouts()
    if not layouts:
        if quant:
            raise RolloutEngineError(f"{path}/config.json has a quantization_config ({quant.get('quant_method')}) "
                                     "but the rollout fp8 mode is none; set fp8 to the checkpoint's layout")
        return
    if not quant or quant.get("quant_method") not in ("fp8", OUR_FP8_METHOD):
        raise RolloutEngineError(f"rollout fp8={config.fp8} needs an FP8 checkpoint; {path}/config.json has "
                                 f"quantization_config {quant!r} (export one with megatron-fp8rl convert export-fp8)")
    found = ("block" if quant.get("weight_block_size") else "tensor", quant.get("activation_scheme", "dynamic"))
    if found not in layouts:
        expected = " or ".join(f"{scheme}/{activations}" for scheme, activations in layouts)
        raise RolloutEngineError(f"rollout fp8={config.fp8} (activation_scheme={config.activation_scheme}) "
                                 f"expects a {expected} FP8 checkpoint; {path} is {found[0]}/{found[1]}")


def engine_kwargs(config: SGLangConfig) -> dict:
    """SGLang ServerArgs for `config`, with the CPU tier's settings when the device is CPU."""
    kwargs = dict(
        model_path=str(config.model_path),
        dtype=config.dtype,
        device=config.resolved_device(),
        random_seed=config.random_seed,
        skip_tokenizer_init=config.skip_tokenizer_init,
        log_level=config.log_level,
        weight_version=str(config.initial_weight_version),
    )
    if config.resolved_device() == "cpu":
        # sleep_on_idle: an idle scheduler otherwise busy-polls its sockets on a whole core, which
        # in colocated mode halved the trainer's CPU while it trained (measured: the scheduler at
        # ~1 core through the whole train phase of the demo).
        # watchdog_timeout: SGLang kills its scheduler when one forward batch takes longer (300 s
        # by default). On a loaded 2-core box the demo's first eval batch (92 prompts, groupwise
        # FP8) passed 300 s and the run died; a CPU forward that slow is load, not a hang.
        kwargs.update(attention_backend="torch_native", disable_cuda_graph=True, sleep_on_idle=True,
                      watchdog_timeout=CPU_WATCHDOG_TIMEOUT_S)
    if config.attention_backend is not None:
        kwargs["attention_backend"] = config.attention_backend
    if config.max_total_tokens is not None:
        kwargs["max_total_tokens"] = config.max_total_tokens
    if config.mem_fraction_static is not None:
        kwargs["mem_fraction_static"] = config.mem_fraction_static
    if config.deterministic:
        kwargs["enable_deterministic_inference"] = True
    if config.memory_saver or (config.memory_saver is None and config.resolved_device() == "cuda"):
        kwargs["enable_memory_saver"] = True
    if config.fp8_mode is not RolloutFp8.NONE:
        kwargs["quantization"] = OUR_FP8_METHOD if config.fp8_backend == "ours" else "fp8"
    kwargs.update(config.extra)
    return kwargs


def server_argv(config: SGLangConfig, host: str, port: int) -> list[str]:
    """`python -m sglang.launch_server` arguments for `config`."""
    argv = []
    for key, value in {**engine_kwargs(config), "host": host, "port": port}.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    return argv


def sglang_sampling(sampling: SamplingParams, num_samples: int) -> list[dict]:
    """One SGLang sampling-params dict per sample; sample j gets seed + j when a seed is set."""
    base = dict(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_new_tokens=sampling.max_new_tokens,
    )
    if sampling.stop_token_ids:
        base["stop_token_ids"] = list(sampling.stop_token_ids)
    out = []
    for j in range(num_samples):
        params = dict(base)
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed + j
        out.append(params)
    return out


def expand_prompts(prompt_token_ids: list[list[int]], n: int) -> list[list[int]]:
    """Prompt-major repetition: [p0]*n + [p1]*n + ...; checks the prompts are non-empty int lists."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    for i, prompt in enumerate(prompt_token_ids):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
    return [list(map(int, prompt)) for prompt in prompt_token_ids for _ in range(n)]


def parse_outputs(outputs: list[dict], prompts: list[list[int]], n: int, initial_version: int) -> list[RolloutSample]:
    """SGLang's generate outputs (one dict per expanded prompt) -> `RolloutSample`s."""
    if len(outputs) != len(prompts) * n:
        raise RolloutEngineError(f"SGLang returned {len(outputs)} outputs, expected {len(prompts) * n}")
    samples = []
    for j, out in enumerate(outputs):
        meta = out["meta_info"]
        token_logprobs = meta["output_token_logprobs"]
        token_ids = [int(t) for t in out["output_ids"]]
        if [int(t) for _, t, _ in token_logprobs] != token_ids:
            raise RolloutEngineError(f"sample {j}: SGLang's logprob tokens do not match its output tokens")
        spans = meta.get("weight_versions") or [{"version": meta["weight_version"]}]
        samples.append(
            RolloutSample(
                prompt_index=j // n,
                prompt_token_ids=prompts[j // n],
                token_ids=token_ids,
                logprobs=[float(lp) for lp, _, _ in token_logprobs],
                finish_reason=meta["finish_reason"]["type"] if meta.get("finish_reason") else "abort",
                # With several spans (weights changed mid-sample) report the oldest: it bounds how
                # off-policy the sample is.
                weight_version=min(_version(s["version"], initial_version) for s in spans),
                meta={"weight_versions": spans},
            )
        )
    return samples


def _version(label: str, initial_version: int) -> int:
    return initial_version if label == "default" else int(label)
