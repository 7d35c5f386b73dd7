"""docs/configuration.md, generated from the run config's field docstrings.

Owns: `field_docstrings` (a dataclass's field docstrings, read from its source and its bases'),
`config_markdown` (one table per config section, every key with its type, default and docstring)
and the command that writes the page:

    python -m megatron_fp8rl.trainer.config_docs > docs/configuration.md

A field without a docstring is an error naming its dotted key: every key a user can set is
documented, or the page is not written. tests/trainer/test_config_docs.py fails when the committed
page differs from what this prints.
Must not import: cli.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import sys
import textwrap
import typing

from megatron_fp8rl.fp8.recipe import Fp8Recipe, RecipeOverrides
from megatron_fp8rl.trainer.config import RunConfig

GENERATED_FROM = {RecipeOverrides: typing.get_args(Fp8Recipe)}
"""Dataclasses made with `dataclasses.make_dataclass` (no source to read) -> the classes whose field
docstrings document their fields: model.fp8_recipe overlays every recipe's fields."""
COMMAND = "python -m megatron_fp8rl.trainer.config_docs > docs/configuration.md"
"""The one command that regenerates the page."""


def _docstrings_in_source(cls: type) -> dict[str, str]:
    """{field: docstring} of the annotated assignments in `cls`'s own class body that a string
    literal follows."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    found = {}
    for statement, after in zip(body, body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            found[statement.target.id] = inspect.cleandoc(after.value.value)
    return found


def _annotations_in_source(cls: type) -> dict[str, str]:
    """{field: its annotation as written} in `cls`'s own class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {statement.target.id: ast.unparse(statement.annotation) for statement in tree.body[0].body
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)}


def _documenting_classes(cls: type) -> list[type]:
    """The classes whose sources document `cls`'s fields, most derived first."""
    if cls in GENERATED_FROM:
        return list(GENERATED_FROM[cls])
    return [base for base in cls.__mro__ if dataclasses.is_dataclass(base)]


def field_docstrings(cls: type) -> dict[str, tuple[str, str]]:
    """{field: (annotation as written, docstring)} for every field of dataclass `cls`; a field
    documented in several classes takes the most derived one's docstring."""
    found: dict[str, tuple[str, str]] = {}
    for source in _documenting_classes(cls):
        annotations, docs = _annotations_in_source(source), _docstrings_in_source(source)
        for name, doc in docs.items():
            found.setdefault(name, (annotations[name], doc))
    return found


def _default(field: dataclasses.Field) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _cell(text: str) -> str:
    """`text` on one line, safe inside a markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def _default_text(value: object) -> str:
    if value is dataclasses.MISSING:
        return "(required)"
    if value is None:
        return "null"
    return f"`{json.dumps(value)}`"


def _sections(cls: type, prefix: str) -> list[tuple[str, type]]:
    """(dotted prefix, dataclass) of `cls` and of every dataclass nested in it, depth first."""
    hints = typing.get_type_hints(cls)
    found = [(prefix, cls)]
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            found += _sections(hints[field.name], f"{prefix}{field.name}.")
    return found


def _section_table(cls: type, prefix: str) -> list[str]:
    """The markdown table of `cls`'s own keys (nested sections get their own tables)."""
    hints, docs = typing.get_type_hints(cls), field_docstrings(cls)
    rows = ["<!-- no figures -->", "| key | type | default | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        key = f"{prefix}{field.name}"
        if field.name not in docs:
            raise ValueError(f"config key {key} ({cls.__name__}.{field.name}) has no docstring: "
                             "document it on the line after the field")
        annotation, doc = docs[field.name]
        if dataclasses.is_dataclass(hints[field.name]):
            rows.append(f"| `{key}` | section | | {_cell(doc)} (table below) |")
        elif cls in GENERATED_FROM:
            rows.append(f"| `{key}` | `{_cell(annotation)}` | null (the recipe's own) | {_cell(doc)} |")
        else:
            rows.append(f"| `{key}` | `{_cell(annotation)}` | {_default_text(_default(field))} | {_cell(doc)} |")
    return rows


def config_markdown(schema: type = RunConfig) -> str:
    """The configuration page of `schema`: a header, then per section its docstring and its table."""
    lines = ["# Configuration", "",
             f"Every key of `megatron-fp8rl train`'s config, generated from the field docstrings of "
             f"`megatron_fp8rl/trainer/config.py` and the sections it nests (`algorithm`: `megatron_fp8rl/trainer/algorithm_config.py`). Do not edit by hand; "
             f"regenerate with `{COMMAND}`.", "",
             "Set a key in the YAML file (`examples/cpu_demo.yaml`) or as a dotted override after it "
             "(`train.steps=20`); later overrides win. An unknown key, a wrong type or a bad value is "
             "an error naming the dotted key."]
    for prefix, cls in _sections(schema, ""):
        title = prefix.rstrip(".") or "top level"
        lines += ["", f"## {title}", "", _cell(inspect.cleandoc(cls.__doc__ or "")), ""]
        lines += _section_table(cls, prefix)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(config_markdown())
