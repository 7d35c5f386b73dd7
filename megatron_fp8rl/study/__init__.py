"""The FP8 stability study (issues 23, 44, 61): one RL job trained under several precision arms and
seeds, in three regimes and issue 61's equivalence study, the verdict across v3's regimes and the
equivalence tables (equivalence.py).

Owns: what the study runs (arms.py: the regimes, their arms and seed counts, run sizes) and running it
(runner.py: every arm x seed not finished yet as a `megatron-fp8rl train` subprocess, then the reports
and the verdict that report/ writes from the run logs; `megatron-fp8rl stability`, bench/stability.py)
and the equivalence tables of the committed runs (equivalence.py, `stability --equivalence`).
Entry-point layer (one unit with cli.py and report/): it imports no trainer code.
"""
