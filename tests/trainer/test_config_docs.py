"""docs/configuration.md is what `python -m megatron_fp8rl.trainer.config_docs` prints today, and the
generator reads field docstrings (inherited and nested ones too) and refuses an undocumented key."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megatron_fp8rl.trainer.config_docs import COMMAND, config_markdown, field_docstrings

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


@dataclass
class _Base:
    """A base section."""

    lr: float = 1e-5
    """Learning rate."""


@dataclass
class _Inner:
    """An inner section."""

    low: float = 0.2
    """Clip below 1."""


@dataclass
class _Outer(_Base):
    """An outer section."""

    steps: int = 3
    """How many steps."""
    inner: _Inner = field(default_factory=_Inner)
    """The inner part."""
    names: list[str] = field(default_factory=lambda: ["a"])
    """Some names,
    over two lines | with a pipe."""


@dataclass
class _Undocumented:
    """A section with a key nobody documented."""

    steps: int = 3
    seed: int = 1
    """Seed."""


def test_the_committed_page_is_current():
    assert PAGE.read_text() == config_markdown(), f"docs/configuration.md is stale: run `{COMMAND}`"


def test_field_docstrings_come_from_the_class_and_its_bases():
    docs = field_docstrings(_Outer)
    assert docs == {"steps": ("int", "How many steps."), "inner": ("_Inner", "The inner part."),
                    "names": ("list[str]", "Some names,\nover two lines | with a pipe."),
                    "lr": ("float", "Learning rate.")}


def test_every_key_of_every_nested_section_gets_a_row():
    page = config_markdown(_Outer)
    assert "## inner\n\nAn inner section." in page
    assert "| `inner.low` | `float` | `0.2` | Clip below 1. |" in page
    assert "| `lr` | `float` | `1e-05` | Learning rate. |" in page
    assert "| `names` | `list[str]` | `[\"a\"]` | Some names, over two lines \\| with a pipe. |" in page
    assert "| `inner` | section | | The inner part. (table below) |" in page
    assert page.count("<!-- no figures -->") == 2


def test_an_undocumented_key_is_refused_by_its_dotted_name():
    @dataclass
    class Run:
        """A run."""

        part: _Undocumented = field(default_factory=_Undocumented)
        """The part."""

    with pytest.raises(ValueError, match=r"config key part\.steps \(_Undocumented\.steps\) has no docstring"):
        config_markdown(Run)


def _keys(config: object, prefix: str = "") -> list[str]:
    """Every dotted key of a config instance, sections included (an independent walk of the tree)."""
    found = []
    for key, value in vars(config).items():
        found.append(f"{prefix}{key}")
        if dataclasses.is_dataclass(value):
            found += _keys(value, f"{prefix}{key}.")
    return found


def test_every_run_config_key_is_on_the_page():
    from megatron_fp8rl.config.loader import load_config
    from megatron_fp8rl.trainer.config import RunConfig

    keys = _keys(load_config(RunConfig, overrides=["model.hf_path=/models/any"]))
    assert len(keys) > 100
    page = PAGE.read_text()
    assert [key for key in keys if f"| `{key}` |" not in page] == []
