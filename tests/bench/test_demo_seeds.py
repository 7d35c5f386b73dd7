"""bench/demo_seeds.py: the seed table and the paired comparison of two demo arms, on seed folders
written here the way run_seed leaves them (summary.json, eval_correct.json, run.json)."""
import json
import random

import pytest

from bench import demo_seeds


def _seed(out, seed, start, end, problems=500, salt=0):
    """A finished seed folder whose first and last evals score `start` and `end` of `problems`."""
    rng = random.Random(seed * 1000 + salt)
    folder = out / f"seed{seed}"
    folder.mkdir(parents=True)
    final = [1] * round(end * problems) + [0] * (problems - round(end * problems))
    rng.shuffle(final)
    first = [1] * round(start * problems) + [0] * (problems - round(start * problems))
    (folder / "eval_correct.json").write_text(json.dumps({"0": first, "3": final}))
    (folder / "summary.json").write_text(json.dumps({"eval/accuracy_start": start, "eval/accuracy": end,
                                                     "eval/gained": 10.0, "eval/lost": 2.0, "eval/mcnemar_p": 1e-3}))
    (folder / "run.json").write_text(json.dumps({"seed": seed, "wall_s": 600.0, "load_at_start": 1.0}))


def test_the_table_names_the_held_out_size_and_refuses_mixed_sets(tmp_path):
    _seed(tmp_path, 1, 0.2, 0.5)
    _seed(tmp_path, 2, 0.2, 0.55)
    text = demo_seeds.write_table(tmp_path)
    assert "held-out accuracy (500 problems)" in text and "| 2 | 0.200 -> 0.550 |" in text
    _seed(tmp_path, 3, 0.2, 0.5, problems=100)
    with pytest.raises(SystemExit, match=r"different held-out sets \(\[100, 500\] problems\)"):
        demo_seeds.write_table(tmp_path)


@pytest.mark.parametrize("shifts, verdict", [
    ((-0.20, -0.22, -0.19), "worse"),  # a clear loss on every seed
    ((0.004, -0.002, 0.0, 0.002, -0.004, 0.002), "equivalent"),  # tight around 0 with 6 seeds
    ((0.03, -0.04), "not shown"),  # 2 seeds: the interval straddles the margin
])
def test_an_arm_against_the_plain_demo_gets_the_equivalence_verdict(tmp_path, shifts, verdict):
    reference, arm = tmp_path / "demo", tmp_path / "demo_kl"
    for seed, shift in enumerate(shifts, start=1):
        _seed(reference, seed, 0.2, 0.5)
        _seed(arm, seed, 0.2, 0.5 + shift, salt=1)
    _seed(arm, 99, 0.2, 0.9)  # a seed the reference lacks is not paired
    text = demo_seeds.write_against(arm, reference, 0.05)
    row = text.splitlines()[-1]
    assert row.startswith(f"| {', '.join(str(s) for s in range(1, len(shifts) + 1))} |"), row
    assert row.endswith(f"| {verdict} |"), row
    assert (arm / "against.md").read_text() == text
    differences = [float(d) for d in row.split("|")[2].split(",")]
    assert differences == pytest.approx([100 * s for s in shifts], abs=0.11)


def test_arms_scored_on_different_sets_are_refused(tmp_path):
    _seed(tmp_path / "a", 1, 0.2, 0.5)
    _seed(tmp_path / "b", 1, 0.2, 0.5, problems=100)
    with pytest.raises(Exception, match="not the same held-out set"):
        demo_seeds.write_against(tmp_path / "b", tmp_path / "a", 0.05)
