"""README.md stays a newcomer's page: at most 300 lines, exactly the two set-up commands CI also runs,
and none of what belongs in docs/ or the history (issue numbers, commit hashes, policy notation)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAX_LINES = 300
COMMANDS = ("bash scripts/demo.sh", "bash scripts/test.sh")
"""The two set-up commands: the demo and the test suite."""


def authors_notes(text: str) -> list[str]:
    """What a newcomer's page should not carry: issue references, commit hashes, π/θ notation."""
    patterns = {"issue reference": r"\bissues?\s+#?\d+|(?<![\w/])#\d+\b",
                "commit hash": r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b",
                "policy notation": r"[πθ]"}
    return [f"{name}: {match.group(0)!r}" for name, pattern in patterns.items()
            for match in re.finditer(pattern, text)]


def test_the_readme_is_short():
    assert len(README.splitlines()) <= MAX_LINES


def test_the_two_commands_open_the_readme_and_ci_runs_the_test_command():
    section = README[README.index("## Two commands"):]
    block = section[section.index("```bash") + len("```bash"):section.index("```", section.index("```bash") + 3)]
    assert [line.split("#")[0].strip() for line in block.strip().splitlines()] == list(COMMANDS)
    assert COMMANDS[1] in (ROOT / ".ci" / "run").read_text()


def test_the_readme_carries_no_authors_notes():
    assert authors_notes(README) == []


def test_authors_notes_are_found():
    text = "Fixed in a195390 (issue 44, see #23); the ratio π_θ/π_old; sha 70eb3db."
    assert authors_notes(text) == ["issue reference: 'issue 44'", "issue reference: '#23'",
                                   "commit hash: 'a195390'", "commit hash: '70eb3db'",
                                   "policy notation: 'π'", "policy notation: 'θ'", "policy notation: 'π'"]
    assert authors_notes("runs on 2026-12-05 with groupwise32, 1x128 groups, step 1234") == []
