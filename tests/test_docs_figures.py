"""Every measured figure in README.md and docs/*.md is checked at the place its marker names.

A marker is an HTML comment on the line just above the block it covers (a table, or a paragraph:
the lines up to the next blank line):

    <!-- figures: PATH -->                 a table: each body row's figures must all sit in one row of
                                           PATH's tables whose first cell equals the row's first cell
    <!-- figures: PATH row "TEXT" ... -->  the block's figures must sit in the one line of PATH that
                                           contains TEXT (several `row "..."` name several lines)
    <!-- figures: PATH key a.b.0.c -->     the block's figures must sit in the JSON value at that key
    <!-- no figures -->                    a table of words (options, status, settings)

A figure is a number as written outside code spans, link targets and comments, its sign dropped (a
unicode minus reads as '-'); a table row's first cell is its key, not a figure. Every table carries
a marker. So a figure that no committed output printed, a stale one, or one copied from another row
fails here, naming the document, its line and the figure.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*(?:figures:\s*(?P<path>\S+)(?P<places>.*?)|(?P<none>no figures))\s*-->$")
PLACE = re.compile(r'\s*(?:row\s+"(?P<row>[^"]+)"|key\s+(?P<key>\S+))')
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
NOT_FIGURES = re.compile(r"`[^`]*`|\]\([^)]*\)|<!--.*?-->")


@dataclass
class Block:
    """A marked or unmarked block of a document: its first line number, its lines, its marker."""

    line: int
    lines: list[str]
    marker: re.Match | None

    @property
    def is_table(self) -> bool:
        return self.lines[0].startswith("|")


def figures(text: str) -> list[str]:
    """The figures of `text` in order, signs dropped."""
    text = NOT_FIGURES.sub(" ", text.replace("\u2212", "-"))
    return [number.lstrip("+-") for number in NUMBER.findall(text)]


def cells(row: str) -> list[str]:
    """A markdown table row's cells, stripped."""
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def row_key(cell: str) -> str:
    """A first cell as a key: emphasis, backticks and spaces do not matter."""
    return " ".join(cell.replace("*", "").replace("`", "").split())


def blocks(text: str) -> list[Block]:
    """The tables and the marked paragraphs of a markdown text (fenced code left out)."""
    lines, found, i, fenced = text.splitlines(), [], 0, False
    while i < len(lines):
        fenced ^= lines[i].startswith("```")
        marker = None if fenced else MARKER.match(lines[i].strip())
        if fenced or not (marker or lines[i].startswith("|")):
            i += 1
            continue
        start = i + 1 if marker else i
        end = start
        while end < len(lines) and lines[end].strip() and (
                lines[end].startswith("|") == lines[start].startswith("|")):
            end += 1
        found.append(Block(start + 1, lines[start:end], marker))
        i = max(end, start)
    return found


def _source_line(text: str, row: str, path: str) -> str:
    hits = [line for line in text.splitlines() if row in line]
    if len(hits) != 1:
        raise LookupError(f'row "{row}" is in {len(hits)} lines of {path}, not exactly one')
    return hits[0]


def _json_value(text: str, key: str, path: str) -> str:
    value = json.loads(text)
    for part in key.split("."):
        try:
            value = value[int(part)] if isinstance(value, list) else value[part]
        except (KeyError, IndexError, ValueError):
            raise LookupError(f"key {key} is not in {path} (at {part!r})") from None
    return json.dumps(value)


def _table_problems(block: Block, source: str, path: str) -> list[str]:
    rows = {}
    for line in source.splitlines():
        if line.startswith("|"):
            rows.setdefault(row_key(cells(line)[0]), []).append(line)
    problems = []
    for offset, line in enumerate(block.lines[2:], start=2):
        key, *rest = cells(line)
        wanted = figures(" | ".join(rest))
        candidates = rows.get(row_key(key), [])
        if not candidates:
            problems.append(f"{block.line + offset}: no row {row_key(key)!r} in {path}")
        elif not any(set(wanted) <= set(figures(candidate)) for candidate in candidates):
            best = candidates[0]
            problems += [f"{block.line + offset}: {figure} is not in {path}'s row {row_key(key)!r}"
                         for figure in wanted if figure not in figures(best)] or [
                f"{block.line + offset}: figures of the row {row_key(key)!r} are spread over several rows of {path}"]
    return problems


def check_block(block: Block, root: Path) -> list[str]:
    """'line: problem' for each figure of a marked block not found where its marker points."""
    if block.marker is None:
        return [f"{block.line}: table without a figures/no-figures marker on the line above"] if block.is_table else []
    if block.marker.group("none"):
        return []
    path = block.marker.group("path")
    file = root / path
    if not file.is_file():
        return [f"{block.line}: marker names {path}, which does not exist"]
    source = file.read_text(errors="replace")
    places = [match for match in PLACE.finditer(block.marker.group("places")) if match.group(0).strip()]
    if not places:
        if not block.is_table:
            return [f"{block.line}: a paragraph's marker must name a row or key of {path}"]
        return _table_problems(block, source, path)
    try:
        where = " ".join(_source_line(source, m.group("row"), path) if m.group("row")
                         else _json_value(source, m.group("key"), path) for m in places)
    except LookupError as error:
        return [f"{block.line}: {error}"]
    text = "\n".join(block.lines[2:] if block.is_table else block.lines)
    return [f"{block.line}: {figure} is not in the named place of {path}"
            for figure in figures(text) if figure not in figures(where)]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_figure_sits_where_its_marker_points(document):
    problems = [f"{document.name}:{p}" for block in blocks(document.read_text()) for p in check_block(block, ROOT)]
    assert not problems, "figures not found where their markers point:\n" + "\n".join(problems)


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    (tmp_path / "seeds.md").write_text("| seed | acc | p |\n|---|---|---|\n| 1 | 0.240 -> 0.560 | 6.7e-08 |\n"
                                       "| 2 | 0.270 -> 0.490 | 0.00031 |\n")
    (tmp_path / "gate.txt").write_text("groupwise32 step 1.16x train 1.25x\nblockwise step 1.40x\n")
    (tmp_path / "run.json").write_text('{"eval": {"accuracy": [0.25, 0.56]}, "steps": 3}')
    return tmp_path


def _problems(text: str, root: Path) -> list[str]:
    return [problem for block in blocks(text) for problem in check_block(block, root)]


def test_a_current_table_passes_and_a_stale_figure_fails(sources):
    table = "<!-- figures: seeds.md -->\n| seed | accuracy | p |\n|---|---|---|\n| 1 | 0.240 -> 0.560 | 6.7e-08 |\n"
    assert _problems(table, sources) == []
    assert _problems(table.replace("0.560", "0.570"), sources) == ["4: 0.570 is not in seeds.md's row '1'"]


def test_a_figure_from_another_row_fails(sources):
    table = "<!-- figures: seeds.md -->\n| seed | accuracy | p |\n|---|---|---|\n| 1 | 0.270 -> 0.560 | 6.7e-08 |\n"
    assert _problems(table, sources) == ["4: 0.270 is not in seeds.md's row '1'"]
    assert _problems(table.replace("| 1 |", "| 7 |"), sources) == ["4: no row '7' in seeds.md"]


def test_a_paragraph_is_checked_in_the_named_line_only(sources):
    text = 'Intro.\n\n<!-- figures: gate.txt row "groupwise32" -->\nA gate step costs 1.16x, its train phase 1.25x.\n'
    assert _problems(text, sources) == []
    assert _problems(text.replace("1.16x", "1.40x"), sources) == ["4: 1.40 is not in the named place of gate.txt"]
    assert _problems(text.replace('"groupwise32"', '"step"'), sources) == [
        '4: row "step" is in 2 lines of gate.txt, not exactly one']


def test_a_json_key_is_followed(sources):
    text = '<!-- figures: run.json key eval.accuracy -->\nAccuracy went 0.25 -> 0.56 (`step 3`).\n'
    assert _problems(text, sources) == []
    assert _problems(text.replace("0.56", "0.57"), sources) == ["2: 0.57 is not in the named place of run.json"]
    assert _problems(text.replace("eval.accuracy", "eval.reward"), sources) == [
        "2: key eval.reward is not in run.json (at 'reward')"]


def test_unmarked_tables_and_missing_sources_fail(sources):
    assert _problems("| a | b |\n|---|---|\n| x | 1 |\n", sources) == [
        "1: table without a figures/no-figures marker on the line above"]
    assert _problems("<!-- no figures -->\n| a | b |\n|---|---|\n| x | 1 |\n", sources) == []
    assert _problems("<!-- figures: gone.md -->\n| a |\n|---|\n| 1 |\n", sources) == [
        "2: marker names gone.md, which does not exist"]
    assert _problems("<!-- figures: gate.txt -->\nText 1.16x.\n", sources) == [
        "2: a paragraph's marker must name a row or key of gate.txt"]


def test_code_links_and_table_keys_are_not_figures():
    assert figures("`groupwise32` 1.5x [a](results/v3/x.md) <!-- 9 --> \u22120.02") == ["1.5", "0.02"]
    assert figures("+68/\u221215, p = 3.2e-09") == ["68", "15", "3.2e-09"]
