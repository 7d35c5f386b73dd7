"""The FP8 stability study (v2: issue 23; v3: issue 44; equivalence: issue 61): the same RL job under
several precision arms and seeds, in one of four regimes, then the report. Same as `megatron-fp8rl stability`; the
study itself lives in megatron_fp8rl/study/runner.py (so the installed CLI has it too).

    python bench/stability.py --regime moderate2 --hours 2.8    # what fits in 2.8 hours; repeat to go on
    python bench/stability.py --regime moderate4 --hours 2.8
    python bench/stability.py --hours 2.8                       # harsh (v2's job; its finished runs kept)
    python bench/stability.py --settings bf16,groupwise32 --seeds 1
    python bench/stability.py --quick --model DIR               # smoke: 2 tiny steps per run
    python bench/stability.py --add mine:algorithm.correction=mis --set train.lr=5e-5
    python bench/stability.py --regime moderate2 --report-only  # the report of the finished runs
    python bench/stability.py --verdict                         # every regime's report, results/stability_v3/verdict.md
    python bench/stability.py --regime equivalence --hours 2.8  # issue 61's study (6 seeds; 500 fixed problems)
    python bench/stability.py --equivalence                     # the equivalence tables from the committed logs:
                                                                #   results/equivalence/equivalence.md (issue 61's),
                                                                #   results/stability_v3/equivalence.md (v3 re-analysed)

Regimes: harsh (v2's: 2 prompts x 8 samples, lr 3e-5, 30 steps; results/stability), moderate2 and
moderate4 (8 x 8 at temperature 1, lr 1e-5, 12 steps, 2 or 4 mini-batches;
results/stability_v3/<regime>). Arms: bf16 (reference), groupwise32 (the default: 1x32 groups,
aligned rollouts), tensorwise, blockwise (unified FP8, the diagnostic measured by
algorithm.calibration.mode=monitor), the same with Calibrated Clipping (_cc), and
remedies: groupwise32_gate (the clip decided on the shadow's ratio), groupwise32_bf16 (the default FP8
recipe on a bf16 trainer) and, in the moderate regimes, groupwise32_cc_noise (CC with the noise rule);
in harsh also v2's bf16_fp8block_tis, aligned, aligned_cc, tensorwise_noise, the probes,
groupwise32_bf16_gate and groupwise32_bf16_tis. Seeds: 3 for bf16, float32 and the groupwise32 arms
but the bf16-trainer ones (groupwise32_bf16: 3 in harsh, 2 in moderate; its gate and TIS arms 2), 2 for
the others, 1 for v2's extra arms; each report's preamble lists them. Regime equivalence (issue 61,
results/equivalence/moderate4): moderate4 with 500 held-out problems the same for every seed, float32,
groupwise32, groupwise32_gate, groupwise32_wide_low and the remedy groupwise32_gate_every9 (the gate on
one step in 9: 4.9% extra compute) (6 seeds), bf16_tis, groupwise32_bf16_tis and
groupwise32_bf16_tis_gate_every9 (3);
its margin (±5 points) and primary comparisons are in study/arms.py, its verdict table in
results/equivalence/equivalence.md (written by every invocation of the regime and by --equivalence).
Output: <study-dir>/<arm>/seed<k>/ (a run directory each, train.log), <study-dir>/timings.json,
<study-dir>/report/report.md with curves.png and accuracy.png, and <study-dir>/report/runs/ (per-run
plots of each arm's first seed). A run that finished earlier with the same settings (its
config.yaml) is kept (--rerun trains it again); an unfinished one, or one finished with other
settings, starts over.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fp8rl.study.runner import main  # noqa: E402  (after the checkout is on sys.path)

if __name__ == "__main__":
    sys.exit(main())
