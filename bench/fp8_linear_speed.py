"""FP8 linear speed on CPU: each FP8 recipe vs float32, as ratios measured in the same run.

Times (CPU seconds of this process, `time.process_time`, median of --reps after one warm-up: the
box is shared, and CPU time moves less with its load than wall time):
- linears: SmolLM2-135M shapes (hidden 576, ffn 1536, kv 192: qkv 576->960, proj 576->576,
  fc1 576->3072 (gated), fc2 1536->576) on --tokens tokens, `Fp8Linear` with each recipe of
  --recipes vs `torch.nn.functional.linear`, forward (no grad) and forward+backward;
- model: a whole Megatron SmolLM2 built by `build_model_from_hf(hf_config,
  fp8_recipe=recipe_by_name(recipe))` vs `fp8_recipe=None` (random weights; speed does not
  depend on them), forward (no grad, as the old-logprob recompute) and forward+backward of the
  summed logits (as the train phase), on --batch x --seq tokens.
`--recipes a,b` names fp8/recipe.py RECIPE_NAMES (default calibrated,groupwise: the per-tensor
recipe and the demo's 1x128 groups); `--gemms a,b` repeats the linears with each FP8 GEMM ('auto'
is 'exact' on CPU).
Prints one line per case: float32 seconds, FP8 seconds and the ratio FP8/float32.
`--profile` also prints torch.profiler's top operators of one FP8 model forward and one
forward+backward per recipe.

Run: .venv/bin/python bench/fp8_linear_speed.py [--reps 5] [--recipes calibrated,groupwise]
     [--gemms auto] [--no-model] [--profile]
To compare two trees, run it with PYTHONPATH pointing at each (same load, same flags).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

LINEARS = {"qkv": (576, 960), "proj": (576, 576), "fc1": (576, 3072), "fc2": (1536, 576)}


def _time(fn, reps: int) -> float:
    fn()  # warm-up (first calibration, allocator)
    times = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def _row(name: str, base: float, fp8: float) -> None:
    print(f"{name:46s} fp32 {base * 1e3:9.2f} ms   fp8 {fp8 * 1e3:9.2f} ms   ratio {fp8 / base:6.2f}x",
          flush=True)


def bench_linears(tokens: int, reps: int, recipe_name: str, gemm: str) -> None:
    from megatron_fp8rl.fp8.linear import Fp8Linear
    from megatron_fp8rl.fp8.recipe import recipe_by_name

    torch.manual_seed(0)
    for name, (k, n) in LINEARS.items():
        layer = Fp8Linear(k, n, bias=False, recipe=recipe_by_name(recipe_name), gemm=gemm)
        weight = layer.weight
        x = torch.randn(tokens, k)
        dy = torch.randn(tokens, n)

        def fp32_fwd():
            with torch.no_grad():
                torch.nn.functional.linear(x, weight)

        def fp8_fwd():
            with torch.no_grad():
                layer(x)

        def fp32_train():
            xg = x.detach().requires_grad_()
            torch.nn.functional.linear(xg, weight).backward(dy)
            weight.grad = None

        def fp8_train():
            xg = x.detach().requires_grad_()
            layer(xg).backward(dy)
            weight.grad = None

        label = f"linear {name} {recipe_name} {gemm}"
        _row(f"{label} fwd", _time(fp32_fwd, reps), _time(fp8_fwd, reps))
        _row(f"{label} fwd+bwd", _time(fp32_train, reps), _time(fp8_train, reps))


def _model(hf_config, recipe):
    from megatron_fp8rl.models.hf import build_model_from_hf

    torch.manual_seed(0)
    return build_model_from_hf(hf_config, fp8_recipe=recipe)


def _profile(label: str, fn) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    print(f"profile: {label}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def bench_model(model_dir: str, batch: int, seq: int, reps: int, recipes: list[str], profile: bool) -> None:
    from transformers import AutoConfig

    from megatron_fp8rl.fp8.recipe import recipe_by_name

    hf_config = AutoConfig.from_pretrained(model_dir)
    tokens = torch.randint(0, hf_config.vocab_size, (batch, seq))
    positions = torch.arange(seq).expand(batch, seq)

    def forward(model):
        def run():
            with torch.no_grad():
                model(tokens, positions, None)
        return run

    def train(model):
        def run():
            model(tokens, positions, None).float().mean().backward()
            model.zero_grad(set_to_none=True)
        return run

    base = _model(hf_config, None)
    base_times = {"fwd": _time(forward(base), reps), "fwd+bwd": _time(train(base), reps)}
    del base
    for name in recipes:
        model = _model(hf_config, recipe_by_name(name))
        _row(f"model {name} fwd {batch}x{seq}", base_times["fwd"], _time(forward(model), reps))
        _row(f"model {name} fwd+bwd {batch}x{seq}", base_times["fwd+bwd"], _time(train(model), reps))
        if profile:
            _profile(f"{name} model fwd {batch}x{seq}", forward(model))
            _profile(f"{name} model fwd+bwd {batch}x{seq}", train(model))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=".cache/smollm2")
    parser.add_argument("--tokens", type=int, default=16 * 60)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=60)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--recipes", default="calibrated,groupwise",
                        help="comma list of FP8 recipes (fp8/recipe.py RECIPE_NAMES)")
    parser.add_argument("--gemms", default="auto",
                        help="comma list of FP8 GEMMs for the linears (fp8/gemm.py GEMMS), e.g. "
                             "fp32_accumulate,exact to see what batch-invariance costs")
    parser.add_argument("--no-model", action="store_true", help="linears only")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    recipes = args.recipes.split(",")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads (CPU time of this process; "
          "compare ratios measured in one run)", flush=True)
    for recipe in recipes:
        for gemm in args.gemms.split(","):
            bench_linears(args.tokens, args.reps, recipe, gemm)
    if not args.no_model:
        from megatron_fp8rl.launch import init_distributed, shutdown_distributed

        init_distributed(tensor_parallel=1, pipeline_parallel=1, seed=3)
        try:
            bench_model(args.model, args.batch, args.seq, args.reps, recipes, args.profile)
        finally:
            shutdown_distributed()


if __name__ == "__main__":
    main()
