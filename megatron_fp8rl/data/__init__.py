"""Prompts and rewards: prompt datasets (JSONL, Parquet), the built-in arithmetic task, chat
templating, resumable sampling, and reward functions with error/timeout accounting.

Must not import: convert, rollout, trainer, cli (layer L3 imports only L0-L2).
"""
