"""Smoke test of bench/exact_gemm.py: it runs, prints a row per layout with its ratios, and its
checks hold ('exact' gives the same bits from fp32 and fp64 weight codes; 'tiled' gives a row the
same bits alone as among the others); a failed check would exit non-zero."""
import torch

from bench import exact_gemm as bench


def test_bench_runs_and_its_bit_checks_hold(capsys):
    threads = torch.get_num_threads()
    try:
        bench.main(["--rows", "3", "--repeat", "1"])
    finally:
        torch.set_num_threads(threads)  # the bench pins one thread
    lines = capsys.readouterr().out.strip().splitlines()
    assert "tiled/exact64" in lines[0] and len(lines) == 3
    assert [line.split()[:2] for line in lines[1:]] == [["tensor", "3"], ["1x32", "3"]]
    assert all(line.endswith("x") for line in lines[1:])
