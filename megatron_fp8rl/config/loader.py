"""YAML + dotted overrides -> a typed dataclass tree (OmegaConf structured configs underneath).

Owns: `load_config`, `save_config`, `defaults`, `ConfigError`. Must not import: anything of ours above L0.

Precedence: dataclass defaults < YAML file < overrides (`key.sub=value`, later wins). Unknown keys
and wrong types raise `ConfigError` naming the full dotted key, with the closest valid key
suggested; a ValueError from a dataclass's `__post_init__` (a value check) is reported as raised:
each section's checks name their own dotted keys. A schema may declare `renamed_keys` (a ClassVar:
old dotted key -> new one, e.g. config/renamed.py); an old key in the YAML file or an override is
refused with one line naming its new key.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

T = TypeVar("T")


class ConfigError(ValueError):
    """The configuration cannot be built; the message names the key and the problem."""


def _all_keys(schema: type, prefix: str = "") -> list[str]:
    keys = []
    for field in dataclasses.fields(schema):
        full = f"{prefix}{field.name}"
        keys.append(full)
        if dataclasses.is_dataclass(field.type) and isinstance(field.type, type):
            keys.extend(_all_keys(field.type, full + "."))
    return keys


def _resolved_fields(schema: type) -> type:
    """Resolve string annotations (from __future__ import annotations) so nested types are known."""
    import typing

    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        field.type = hints[field.name]
        if dataclasses.is_dataclass(field.type) and isinstance(field.type, type):
            _resolved_fields(field.type)
    return schema


def _suggest(key: str, schema: type) -> str:
    close = difflib.get_close_matches(key, _all_keys(schema), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _explain(exc: OmegaConfBaseException, schema: type, source: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or "<root>"
    if isinstance(exc, ConfigKeyError):
        return ConfigError(f"{source}: unknown config key {key!r}{_suggest(key, schema)}")
    if isinstance(exc, ValidationError):
        msg = str(exc).splitlines()[0]
        return ConfigError(f"{source}: bad value for {key!r}: {msg}")
    return ConfigError(f"{source}: {key!r}: {str(exc).splitlines()[0]}")


def _dotted_keys(node: Any, prefix: str = "") -> Iterable[str]:
    """Every dotted key of a nested mapping (a YAML file's), sections included."""
    if isinstance(node, dict):
        for key, value in node.items():
            full = f"{prefix}{key}"
            yield full
            yield from _dotted_keys(value, full + ".")


def _check_renamed(keys: Iterable[str], schema: type, source: str) -> None:
    """ConfigError for the first of `keys` that `schema.renamed_keys` lists as renamed."""
    renamed = getattr(schema, "renamed_keys", {})
    for key in keys:
        if key in renamed:
            raise ConfigError(f"{source}: {key!r} was renamed: use {renamed[key]!r}")


def load_config(schema: type[T], yaml_path: str | Path | None = None,
                overrides: Iterable[str] = ()) -> T:
    """Build a `schema` instance from its defaults, a YAML file and `key=value` overrides."""
    _resolved_fields(schema)
    merged = OmegaConf.structured(schema)
    if yaml_path is not None:
        path = Path(yaml_path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = OmegaConf.load(path)
            _check_renamed(_dotted_keys(OmegaConf.to_container(loaded)), schema, str(path))
            merged = OmegaConf.merge(merged, loaded)
        except OmegaConfBaseException as exc:
            raise _explain(exc, schema, str(path)) from None
    overrides = list(overrides)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
    _check_renamed((item.partition("=")[0] for item in overrides), schema, "override")
    try:
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(overrides))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _explain(exc, schema, "override" if overrides else "config") from None
    except ValueError as exc:  # a dataclass __post_init__ check
        raise ConfigError(f"invalid config: {exc}") from None


def defaults(schema: type) -> dict[str, Any]:
    """`schema`'s default values as a plain nested dict (its value checks not run)."""
    _resolved_fields(schema)
    return OmegaConf.to_container(OmegaConf.structured(schema))


def to_yaml(cfg: Any) -> str:
    """The config as YAML (paths as strings)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write the effective config as YAML atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        handle.write(to_yaml(cfg))
    os.replace(tmp, path)
    return path
