"""The FP8 stability study v2 (issue 23): the same RL job under several precision arms and seeds,
then the report. Same as `megatron-fp8rl stability`; the study itself lives in
megatron_fp8rl/report/study.py (so the installed CLI has it too).

    python bench/stability.py                                   # every arm, seeds 1,2 on the key arms
    python bench/stability.py --settings bf16,tensorwise,tensorwise_cc --seeds 1
    python bench/stability.py --quick --model DIR               # smoke: 2 tiny steps per run
    python bench/stability.py --add mine:algorithm.correction=mis --set train.lr=5e-5
    python bench/stability.py --hours 3                         # what fits in 3 hours; repeat to go on
    python bench/stability.py --report-only                     # the report of the finished runs

Arms: bf16 (reference), bf16_fp8block_tis, tensorwise / blockwise / aligned (unified FP8, the
diagnostic measured by algorithm.calibration.mode=monitor), the same with Calibrated Clipping (_cc), and
tensorwise_noise (noise-aware clipping). Output: <study-dir>/<arm>/seed<k>/ (a run directory each,
train.log), <study-dir>/timings.json, <study-dir>/report/report.md with curves.png and
accuracy.png, and <study-dir>/report/runs/ (per-run plots of each arm's first seed). A run that
finished earlier with the same settings (its config.yaml) is kept (--rerun trains it again); an
unfinished one, or one finished with other settings, starts over.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fp8rl.report.study import main  # noqa: E402  (after the checkout is on sys.path)

if __name__ == "__main__":
    sys.exit(main())
