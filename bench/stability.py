"""The FP8 stability study (issue 8): the same RL job under several precision settings, then the
report of plots and final figures. Same as `megatron-fp8rl stability`; the study itself lives in
megatron_fp8rl/report/study.py (so the installed CLI has it too).

    python bench/stability.py                               # all 8 settings, SmolLM2-135M, 6 steps (~60 min, 2 quiet CPU cores)
    python bench/stability.py --settings bf16_bf16_none,calibrated_aligned_tis --steps 4
    python bench/stability.py --quick --model DIR           # smoke: 2 tiny steps per setting
    python bench/stability.py --add noisy:algorithm.correction=mis --set train.lr=2e-5

Settings are `<trainer>_<rollout>_<correction>`: bf16_bf16, bf16_fp8block, tedelayed_fp8block,
calibrated_aligned, each with correction none and tis. "bf16" is the high-precision dtype:
bfloat16 on GPU, float32 on the CPU tier. Output: <study-dir>/<setting>/ (a run directory each,
train.log), <study-dir>/timings.json and <study-dir>/report/report.md with its PNGs. A setting
whose run finished earlier is kept (rerun with --rerun). Prints each setting's wall time and its
ratio to the first setting's.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fp8rl.report.study import main  # noqa: E402  (after the checkout is on sys.path)

if __name__ == "__main__":
    sys.exit(main())
