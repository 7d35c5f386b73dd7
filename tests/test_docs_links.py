"""Every relative link and every repository path named in README.md and docs/*.md exists.

Links: `[text](target)` whose target is not a URL or an anchor, resolved against the document's
folder (an `#anchor` after the path is not checked). Paths: a code span that names a file or folder
of the repository, `bench/stability.py` or `trainer/loop.py:train` (a path whose first part is a
package folder of `megatron_fp8rl/` is read relative to it, as the docs write them); the function
or class after `:` must be defined in that file (`Class.method`: both; test names after `::` are
not checked). Code spans whose first part is neither a repository entry
nor a package entry (`runs/cpu_demo`) name what a run writes and are not checked, nor are bare
names without a folder (`config.yaml`) or spans with placeholders (`<run_dir>`, `*`, `$`).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_fp8rl"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
PATHLIKE = re.compile(r"^(?:\./)?(?:[\w.-]+/)*[\w.-]+(?:\.\w+|/)$")
PLACEHOLDER = re.compile(r"[<>*${}]")


def dead_links(text: str, folder: Path) -> list[str]:
    """The relative link targets of `text` that do not exist next to `folder`."""
    dead = []
    for target in LINK.findall(text):
        if re.match(r"^(?:[a-z]+:|#)", target):
            continue
        if not (folder / target.split("#")[0]).exists():
            dead.append(target)
    return dead


def _repository_path(span: str, root: Path, package: Path) -> Path | None:
    """The file a code span names, or None when it names no repository entry."""
    path = span.split("::")[0].split(":")[0]
    if PLACEHOLDER.search(path) or not PATHLIKE.match(path) or "/" not in path.rstrip("/"):
        return None
    first = path.removeprefix("./").split("/")[0]
    if (root / first).exists():
        return root / path
    if (package / first).exists():
        return package / path
    return None


def _defines(path: Path, name: str) -> bool:
    """Whether Python file `path` defines `name` (a function, a class or a module-level name)."""
    return re.search(rf"^(?:\s*(?:async\s+)?def|\s*class)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]",
                     path.read_text(), re.MULTILINE) is not None


def missing_paths(text: str, root: Path, package: Path) -> list[str]:
    """The code spans of `text` that name a repository path that does not exist, or a function or
    class (`file.py:name`, `file.py:Class.method`) that the file does not define."""
    missing = []
    for span in CODE.findall(text):
        path = _repository_path(span, root, package)
        if path is not None and not path.exists():
            missing.append(span)
        elif path is not None and path.suffix == ".py" and ":" in span.split("::")[0]:
            names = span.split("::")[0].split(":", 1)[1].split(".")
            if not all(_defines(path, name) for name in names):
                missing.append(span)
    return missing


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_relative_link_resolves(document):
    assert dead_links(document.read_text(), document.parent) == []


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_named_repository_path_exists(document):
    assert missing_paths(document.read_text(), ROOT, PACKAGE) == []


def test_a_dead_link_and_a_missing_path_are_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "fp8.md").write_text("")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "rollout.py").write_text("")
    (tmp_path / "pkg" / "trainer").mkdir(parents=True)
    (tmp_path / "pkg" / "trainer" / "loop.py").write_text("class Actor:\n    def update(self):\n        pass\n"
                                                          "def train(cfg):\n    pass\n")
    text = ("See [fp8](docs/fp8.md#recipes), [gone](docs/gone.md), [web](https://example.org), [top](#top).\n"
            "Run `bench/rollout.py`, `bench/rollout_v2.py`, `trainer/loop.py:train`, `trainer/lop.py:train`,\n"
            "`runs/cpu_demo/summary.json`, `<run_dir>/hf`, `model.fp8=groupwise32`, `trainer/loop.py:Actor.update`,\n"
            "`trainer/loop.py:evaluate`, `trainer/loop.py:Actor.step`.\n")
    assert dead_links(text, tmp_path) == ["docs/gone.md"]
    assert missing_paths(text, tmp_path, tmp_path / "pkg") == [
        "bench/rollout_v2.py", "trainer/lop.py:train", "trainer/loop.py:evaluate", "trainer/loop.py:Actor.step"]
