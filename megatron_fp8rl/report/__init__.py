"""Plots and reports from training runs' tensorboard logs, and the FP8 stability study's reports.

Owns: reading run directories (logs.py), the PNG figures (plots.py), the markdown report
(markdown.py), and the stability study's figures, per-regime report and verdict across regimes
(study_figures.py, study_report.py, study_verdict.py; the study's runner is study/), and the
equivalence analysis with its verdict table (equivalence.py, equivalence_table.py). Entry-point
layer (one unit with cli.py): it reads files the trainer wrote; it imports no trainer code.
"""
