"""Prompts and rewards: prompt datasets (JSONL, Parquet), the built-in arithmetic task, chat
templating, resumable sampling, and reward functions with error/timeout accounting.

Must not import: models, convert, rollout, trainer, cli (layer L2 imports only L0/L1).
"""
