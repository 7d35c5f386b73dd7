"""models/registry.py finds every family file in a package, and refuses a file that defines no
family or a family name another file took."""
import importlib

import pytest

from megatron_fp8rl.models.registry import FAMILIES, discover

GOOD = "from megatron_fp8rl.models.families.llama import FAMILY as LLAMA\nimport dataclasses\n" \
       "FAMILY = dataclasses.replace(LLAMA, name='{name}', architectures=('{name}ForCausalLM',))\n"


def _package(tmp_path, monkeypatch, name: str, files: dict[str, str]):
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    for module, source in files.items():
        (tmp_path / name / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


def test_every_family_file_is_found_and_bad_ones_are_named(tmp_path, monkeypatch):
    assert list(FAMILIES) == ["llama", "qwen2", "qwen3"]
    found = discover(_package(tmp_path, monkeypatch, "two_families", {"b": GOOD.format(name="b"),
                                                                      "a": GOOD.format(name="a")}))
    assert list(found) == ["a", "b"]
    with pytest.raises(TypeError, match=r"no_family\.notes: a family file must define FAMILY"):
        discover(_package(tmp_path, monkeypatch, "no_family", {"notes": "FAMILIES = []\n"}))
    with pytest.raises(ValueError, match=r"taken_name\.second: family name 'x' is taken"):
        discover(_package(tmp_path, monkeypatch, "taken_name", {"first": GOOD.format(name="x"),
                                                               "second": GOOD.format(name="x")}))
