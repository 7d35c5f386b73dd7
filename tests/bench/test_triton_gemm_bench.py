"""Smoke test of bench/triton_gemm.py's CPU path: Qwen3-8B-like rows at tiny sizes under Triton's
interpreter, with its checks (bound against the exact GEMM, rows alone vs in the batch)."""
import pytest

from bench import triton_gemm as bench


@pytest.mark.triton
def test_bench_runs_under_the_interpreter_with_its_checks(capsys):
    rows = bench.run("cpu", bench.TINY, [3, 17], reps=1)
    assert [(r["linear"], r["tokens"]) for r in rows] == [("qkv", 3), ("qkv", 17), ("down", 3), ("down", 17)]
    checked = [r for r in rows if "bound_ratio" in r]
    assert len(checked) == 2 and all(r["bound_ratio"] <= 1 and r["rows_invariant"] for r in checked)
    assert all(r["triton_ms"] > 0 and r["ratio"] > 0 for r in rows)
    assert "ratio" in capsys.readouterr().out
