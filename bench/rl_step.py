"""The project's RL step against a plain transformers GRPO step, per phase, in one process.

Owns: the step-cost benchmark of issue 19. Both sides run on SmolLM2-135M-Instruct with the same
prompts (the same seeded sampler over the built-in arithmetic task), group size, response cap,
learning rate and micro-batch size, in float32, one optimizer step per RL step, and take turns
step by step so that both see the same machine load:
- project: `trainer.rl_step.rl_step` on the context `megatron-fp8rl train` builds
  (`trainer.start.start_run`: Megatron-Core actor, colocated SGLang engine), plain GRPO
  (`algorithm.name=grpo`, no dynamic sampling, one mini-batch); phases as it times them.
- plain: written here, as a minimal GRPO loop would be: `generate` (left-padded, sampled), the
  reward function called in-process, group advantages, one policy-gradient step (AdamW, token-mean
  loss over micro-batches, gradient clip 1.0). Its old logprobs are the training forward's own
  (detached; θ = θ_old), and the generating model is the trained one: no recompute, no sync.
Rows: `fp32` (model.dtype and rollout.dtype float32, no FP8), `fp8_aligned`
(model.fp8=calibrated, rollout.fp8=aligned, algorithm.old_policy=bypass) and `fp32_kl` (fp32 with
a KL penalty, algorithm.kl.coef=0.001: a float32 reference model and its forward pass each step),
each against the same plain float32 step. A row with a reference model also prints the reference
pass against the same step without it (its total less the reference pass, same steps, same load)
and against the step's recompute pass when one runs (`--project-overrides train.mini_batches=2`). Ratios are project / plain seconds per phase (rollout includes scoring);
the first step of each side is a warm-up and is not averaged. The box is shared: read the ratios
(measured in the same run), with the load average printed beside them.

    python bench/rl_step.py [--rows fp32,fp8_aligned] [--steps 3] [--prompts 8] [--samples 8]
        [--new-tokens 24] [--micro-batch 16] [--project-overrides KEY=VALUE ...] [--profile FILE]
`--profile FILE` writes a cProfile of the project's measured steps (rank 0's process; SGLang's
scheduler runs in its own process and shows up as waiting).
Memory: one row holds two models with their optimizers and an SGLang engine (~6 GB at 8 x 8); the
second row ran at ~9.5 GB RSS after the first in the same process (Megatron's global state keeps
the first actor alive), so on a small or shared box run one row per invocation (`--rows fp32`).
"""
from __future__ import annotations

import argparse
import cProfile
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# torch and the project are imported inside functions: the reward workers (forkserver children)
# re-import this __main__ module, and a heavy import there would be timed as reward cost.

ROWS = {"fp32": [],
        "fp8_aligned": ["model.fp8=calibrated", "rollout.fp8=aligned", "algorithm.old_policy=bypass",
                        "algorithm.correction=none"],
        "fp32_kl": ["algorithm.kl.coef=0.001"]}
PHASES = ("rollout", "recompute", "reference", "train", "sync", "total")


def _config(args, model: Path, run_dir: Path, extra: list[str]):
    from megatron_fp8rl.config.loader import load_config
    from megatron_fp8rl.trainer.config import RunConfig

    overrides = [f"model.hf_path={model}", f"run_dir={run_dir}", "model.dtype=float32",
                 "rollout.dtype=float32", "algorithm.name=grpo", "algorithm.clip.high=0.2",
                 "algorithm.dynamic_sampling=false", "data.arithmetic_ops=[mul,mul2]", "data.train_size=1000",
                 f"data.prompts_per_step={args.prompts}", f"rollout.n_samples={args.samples}",
                 f"rollout.max_new_tokens={args.new_tokens}", "train.mini_batches=1",
                 f"train.micro_batch_size={args.micro_batch}", f"train.lr={args.lr}",
                 "train.eval_every=0", "checkpoint.every=0", *extra, *args.project_overrides]
    return load_config(RunConfig, None, overrides)


class PlainGRPO:
    """A minimal transformers GRPO step (generate, score, one policy-gradient update)."""

    def __init__(self, model: Path, tokenizer, cfg):
        import torch
        from transformers import AutoModelForCausalLM

        from megatron_fp8rl.data.rewards import load_reward_fn

        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.train.lr, weight_decay=0.0)
        self.tokenizer, self.cfg, self.reward_fn = tokenizer, cfg, load_reward_fn(cfg.data.reward)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def step(self, prompts: list[list[int]], answers: list[str]) -> dict[str, float]:
        import torch

        from megatron_fp8rl.rl.advantages import grpo_advantages

        start = time.perf_counter()
        sequences, attention, response_mask = self._generate(prompts)
        lengths = response_mask.sum(1)
        texts = self.tokenizer.batch_decode([row[mask.bool()] for row, mask in zip(sequences, response_mask)],
                                            skip_special_tokens=True)
        n = self.cfg.rollout.n_samples
        rewards = torch.tensor([float(self.reward_fn(text, answers[i // n])) for i, text in enumerate(texts)])
        advantages = grpo_advantages(rewards.view(len(prompts), n)).flatten()
        rolled = time.perf_counter()
        self._update(sequences, attention, response_mask, advantages)
        done = time.perf_counter()
        return {"rollout": rolled - start, "recompute": 0.0, "reference": 0.0, "train": done - rolled, "sync": 0.0,
                "total": done - start, "tokens": float(lengths.sum())}

    def _generate(self, prompts: list[list[int]]):
        """[B·n, L] left-padded prompt + response ids, their attention mask and response mask
        (generated tokens up to and including the first EOS)."""
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        rollout = self.cfg.rollout
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                      temperature=rollout.temperature, top_p=1.0, top_k=0,
                                      max_new_tokens=rollout.max_new_tokens,
                                      num_return_sequences=rollout.n_samples, pad_token_id=self.pad)
        generated = out[:, width:]
        is_eos = generated == self.tokenizer.eos_token_id
        after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0
        response_mask = torch.cat([torch.zeros_like(ids.repeat_interleave(rollout.n_samples, 0)),
                                   (~after_eos).long()], dim=1)
        attention = torch.cat([mask.repeat_interleave(rollout.n_samples, 0), (~after_eos).long()], dim=1)
        return out, attention, response_mask

    def _update(self, sequences, attention, response_mask, advantages) -> None:
        """Token-mean policy gradient at θ = θ_old (ratio exp(logp - logp.detach()) = 1)."""
        import torch

        self.model.train()
        positions = (attention.cumsum(1) - 1).clamp(min=0)
        targets, target_mask = sequences[:, 1:], response_mask[:, 1:].float()
        total = target_mask.sum()
        size = self.cfg.train.micro_batch_size
        for rows in torch.arange(len(sequences)).split(size):
            logits = self.model(input_ids=sequences[rows], attention_mask=attention[rows],
                                position_ids=positions[rows]).logits[:, :-1]
            logprobs = torch.log_softmax(logits.float(), -1).gather(-1, targets[rows, :, None]).squeeze(-1)
            ratio = torch.exp(logprobs - logprobs.detach())
            loss = -(ratio * advantages[rows, None] * target_mask[rows]).sum() / total
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _project_step(ctx, prompts, answers, step: int, profiler) -> dict[str, float]:
    from megatron_fp8rl.trainer.rl_step import rl_step

    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    metrics = rl_step(ctx, itertools.repeat((prompts, answers)), step)
    if profiler is not None:
        profiler.disable()
    total = time.perf_counter() - start
    timed = {phase: metrics.get(f"time/{phase}_s", 0.0) for phase in PHASES[:-1]}
    timed["rollout"] += metrics.get("time/advantages_s", 0.0)
    tokens = metrics["response/length_mean"] * len(prompts) * ctx.cfg.rollout.n_samples
    return {**timed, "total": total, "tokens": tokens}


def _run_row(name: str, args, model: Path, work: Path) -> tuple[list[dict], list[dict]]:
    from transformers import AutoTokenizer

    from megatron_fp8rl.data.records import prompt_token_ids
    from megatron_fp8rl.data.sampler import PromptSampler
    from megatron_fp8rl.trainer.start import check_inputs, start_run, training_records

    cfg = _config(args, model, work / name, ROWS[name])
    check_inputs(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    records = training_records(cfg)
    sampler = PromptSampler(records, cfg.data.prompts_per_step, seed=cfg.train.seed)
    ctx = start_run(cfg, 0, tokenizer, records)
    plain = PlainGRPO(model, tokenizer, cfg)
    profiler = cProfile.Profile() if args.profile else None
    project_rows, plain_rows = [], []
    try:
        for step in range(1, args.steps + 1):
            batch = sampler.next_batch()
            prompts, answers = [prompt_token_ids(r, tokenizer) for r in batch], [r.answer for r in batch]
            measured = profiler if step > 1 else None
            project_rows.append(_project_step(ctx, prompts, answers, step, measured))
            plain_rows.append(plain.step(prompts, answers))
            print(f"[bench] {name} step {step}: project " + _fmt(project_rows[-1]) + " | plain "
                  + _fmt(plain_rows[-1]) + f" | load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        ctx.engine.shutdown()
    if profiler is not None:
        profiler.dump_stats(f"{args.profile}.{name}")
    return project_rows, plain_rows


def _fmt(row: dict[str, float]) -> str:
    return " ".join(f"{phase} {row[phase]:.1f}s" for phase in PHASES) + f" ({row['tokens']:.0f} tokens)"


def _mean(rows: list[dict], key: str) -> float:
    measured = rows[1:] or rows
    return sum(r[key] for r in measured) / len(measured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "smollm2")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--project-overrides", nargs="*", default=[])
    parser.add_argument("--profile", default="")
    parser.add_argument("--work", type=Path, default=None, help="run directories (default: a temporary folder)")
    args = parser.parse_args()
    from megatron_fp8rl.launch import init_distributed
    from megatron_fp8rl.study.runner import _model_path

    model = _model_path(args.model)
    init_distributed(1, 1)
    print(f"[bench] load average at start {os.getloadavg()}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="rl_step_bench_") as tmp:
        work = args.work or Path(tmp)
        for name in args.rows.split(","):
            results[name] = _run_row(name, args, model, work)
    print(f"[bench] load average at end {os.getloadavg()}")
    print(f"\n{args.prompts} prompts x {args.samples} samples, <= {args.new_tokens} new tokens, micro-batch "
          f"{args.micro_batch}; mean of steps 2..{args.steps} (seconds: project / plain)")
    print("| row | " + " | ".join(PHASES) + " | response tokens |")
    print("|---|" + "---|" * (len(PHASES) + 1))
    for name, (project, plain) in results.items():
        cells = []
        for phase in PHASES:
            ours, theirs = _mean(project, phase), _mean(plain, phase)
            ratio = f"{ours / theirs:.2f}x" if theirs > 0 else "n/a"
            cells.append(f"{ratio} ({ours:.1f} / {theirs:.1f})")
        tokens = f"{_mean(project, 'tokens'):.0f} / {_mean(plain, 'tokens'):.0f}"
        print(f"| {name} | " + " | ".join(cells) + f" | {tokens} |")
    _print_reference_cost(results)


def _print_reference_cost(results: dict[str, tuple[list[dict], list[dict]]]) -> None:
    """Rows with a reference model: the step against the same step without the reference pass."""
    rows = {name: project for name, (project, _) in results.items() if _mean(project, "reference") > 0}
    if not rows:
        return
    print("\n| row | reference pass | step without it | step with / without | reference / recompute |")
    print("|---|---|---|---|---|")
    for name, project in rows.items():
        reference, total, recompute = (_mean(project, key) for key in ("reference", "total", "recompute"))
        versus_recompute = f"{reference / recompute:.2f}x" if recompute > 0 else "no recompute ran"
        print(f"| {name} | {reference:.2f}s | {total - reference:.2f}s | {total / (total - reference):.3f}x "
              f"| {versus_recompute} |")


if __name__ == "__main__":
    main()
