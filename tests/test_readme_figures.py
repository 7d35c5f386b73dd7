"""Every table in README.md says where its figures come from, and a results table's figures are found
in the committed file it cites.

A table (consecutive lines starting with '|') carries, within the 3 lines above it, either
`<!-- figures: PATH[, PATH...] -->` (committed files holding the raw output that printed its figures)
or `<!-- no figures -->` (a table of words: options, status). For a figures table, every number in
every body row (the header and the |---| line excluded) must occur as a number in one of the cited
files, so a README figure that no committed output printed, or a stale one, fails here.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TAG = re.compile(r"<!--\s*(figures:\s*(?P<paths>[^>]*?)|no figures)\s*-->")
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def readme_tables(text: str) -> list[tuple[int, list[str], str | None]]:
    """(line number of the first row, the rows, the tag text within 3 lines above or None)."""
    lines = text.splitlines()
    tables, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
        above = "\n".join(lines[max(0, start - 3):start])
        match = TAG.search(above)
        tables.append((start + 1, lines[start:i], match.group(0) if match else None))
    return tables


def numbers(text: str) -> set[str]:
    """The numbers of `text` as written, with the unicode minus read as '-' and signs dropped."""
    return {n.lstrip("+-") for n in NUMBER.findall(text.replace("\u2212", "-"))}


def missing_figures(rows: list[str], paths: list[str], root: Path) -> list[str]:
    """'row: figure' for each number of a body row that none of `paths` holds."""
    found = set()
    for path in paths:
        file = root / path
        if not file.is_file():
            return [f"cited file {path} does not exist"]
        found |= numbers(file.read_text(errors="replace"))
    body = [row for row in rows[1:] if not re.fullmatch(r"\|[\s:|-]*", row)]
    return [f"{row.strip()[:60]}...: {figure}" for row in body for figure in sorted(numbers(row) - found)]


def test_every_readme_table_cites_its_figures_or_says_it_has_none():
    untagged = [first for first, _, tag in readme_tables((ROOT / "README.md").read_text()) if tag is None]
    assert not untagged, f"README.md tables without a figures/no-figures tag, at lines {untagged}"


def test_readme_figures_are_found_in_the_files_they_cite():
    problems = []
    for first, rows, tag in readme_tables((ROOT / "README.md").read_text()):
        match = TAG.search(tag or "")
        if match and match.group("paths"):
            paths = [p.strip() for p in match.group("paths").split(",") if p.strip()]
            problems += [f"README.md:{first}: {m}" for m in missing_figures(rows, paths, ROOT)]
    assert not problems, "README figures not found in the files they cite:\n" + "\n".join(problems)


def test_a_figure_missing_from_the_cited_file_is_reported(tmp_path):
    (tmp_path / "out.md").write_text("| seed | acc |\n| 1 | 0.250 -> 0.560 |\n")
    rows = ["| seed | acc |", "|---|---|", "| 1 | 0.250 -> 0.561 |"]
    assert missing_figures(rows, ["out.md"], tmp_path) == ["| 1 | 0.250 -> 0.561 |...: 0.561"]
    assert missing_figures(rows[:2] + ["| 1 | 0.250 -> 0.560 |"], ["out.md"], tmp_path) == []
    assert missing_figures(rows, ["gone.md"], tmp_path) == ["cited file gone.md does not exist"]


@pytest.mark.parametrize("above, tagged", [("<!-- no figures -->\n\n", True),
                                           ("<!-- figures: results/x.md -->\ntext\n", True),
                                           ("no tag here\n", False)])
def test_tables_are_read_with_their_tags(above, tagged):
    (table,) = readme_tables(above + "| a |\n|---|\n| 1 |\n")
    assert (table[2] is not None) == tagged
