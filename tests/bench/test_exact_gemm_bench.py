"""Smoke test of bench/exact_gemm.py: it runs, prints its ratios, and its bit check (fp32 vs fp64
weight codes through the 'exact' GEMM) holds; a difference in bits would exit non-zero."""
import torch

from bench import exact_gemm as bench


def test_bench_runs_and_fp64_codes_give_the_same_bits(capsys):
    threads = torch.get_num_threads()
    try:
        bench.main(["--rows", "3", "--repeat", "1"])
    finally:
        torch.set_num_threads(threads)  # the bench pins one thread
    lines = capsys.readouterr().out.strip().splitlines()
    assert "fp64-codes/fp32-GEMM" in lines[0] and lines[1].split()[0] == "3" and lines[1].endswith("x")
