"""The equivalence verdict table (report/equivalence_table.py): one row per comparison with the
difference in points, the Holm-adjusted p-values, the verdict, the extra compute and the projected GPU
step; rows without runs or with one seed pair say so."""
import pytest

from megatron_fp8rl.report.equivalence import Comparison, SeedInterval
from megatron_fp8rl.report.equivalence_table import ArmCost, legend, table_lines
from megatron_fp8rl.rl.step_cost import StepShape, step_passes


def _comparison(arm, seeds, differences, interval=None, verdict="not shown"):
    return Comparison("float32", arm, seeds, differences, interval, None if not seeds else (-0.01, 0.02),
                      0.01, 0.5, 0.03, 1.0, verdict)


def test_rows_show_the_interval_the_verdict_and_the_cost():
    gate = ArmCost(step_passes(StepShape(2, "gate", 1, True, "fp8")), "fp8")
    float32 = ArmCost(step_passes(StepShape(2, "none", 1, True, "float32")), "float32")
    rows = table_lines([_comparison("gate", ("1", "2"), (0.01, -0.01), SeedInterval(-0.0001, -0.0123, 0.0121, 0.01, 1),
                                    "equivalent"),
                        _comparison("one", ("1",), (-0.034,)), _comparison("none", (), ())],
                       {"gate": gate, "one": float32, "none": float32})
    assert rows[2] == ("| gate | float32 | 2 | +0.0 [-1.2, +1.2] | [-1.0, +2.0] | 0.03 | 1 | equivalent "
                       "| +1.50 fwd, +0.00 bwd (+37.5%) | 1.14 / 1.04 / 0.90 |")
    assert rows[3].startswith("| one | float32 | 1 | -3.4 (1 seed pair, no interval) | [-1.0, +2.0] | — | — |")
    assert rows[3].endswith("| — |")  # a float32 trainer: no GPU projection
    assert rows[4].startswith("| none | float32 | 0 | no runs yet | — | — | — | not shown | +0.00 fwd")
    with pytest.raises(KeyError, match=r"no step cost for \['gate'\]"):
        table_lines([_comparison("gate", (), ())], {})


def test_the_legend_says_whether_the_seeds_share_their_problems():
    assert "every seed scored on the same held-out problems" in legend(0.05, 0.05, True, 4)
    different = legend(0.05, 0.05, False, 9)
    assert "scored on different held-out problems" in different and "Holm over the 9 comparisons" in different
