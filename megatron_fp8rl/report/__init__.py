"""Plots and reports from training runs' tensorboard logs, and the FP8 stability study.

Owns: reading run directories (logs.py), the PNG figures (plots.py), the markdown report
(markdown.py) and the study runner that trains one job under several precision settings
(study.py). Entry-point layer (L4, one unit with cli.py): it reads files the trainer wrote and
starts `megatron-fp8rl train` as a subprocess; it imports no trainer code.
"""
