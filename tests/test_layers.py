"""docs/design.md's import direction: a module imports only from layers below its own, and subpackages of
one layer do not import each other. Lazy imports inside functions count too."""
import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_fp8rl"
# cli.py, launch.py, report/ and study/ are one unit: the entry-point layer.
# models/ sits below convert/, rollout/ and data/: its family files (models/families/<family>.py) are the one
# home of each model family's names, and conversion, FP8 export and the SGLang plugin derive from them.
LAYERS = {
    "fp8": 0, "rl": 0,
    "config": 1, "compat": 1,
    "models": 2,
    "convert": 3, "rollout": 3, "data": 3,
    "trainer": 4,
    "cli": 5, "launch": 5, "report": 5, "study": 5,
}
UNIT = {"launch": "cli", "report": "cli", "study": "cli"}


def _unit(name: str) -> str:
    return UNIT.get(name, name)


def _component(module_path: Path) -> str:
    rel = module_path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _imported_components(source: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "megatron_fp8rl":
                names = [f"megatron_fp8rl.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"line {node.lineno}: relative import; use absolute megatron_fp8rl imports")
        for name in names:
            parts = name.split(".")
            if parts[0] == "megatron_fp8rl" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def violations(component: str, source: str) -> list[str]:
    """Imports in `source` (a module of `component`) that break the layering."""
    if component not in LAYERS:
        return [f"component {component!r} has no layer in docs/design.md's table"]
    bad = []
    for lineno, target in _imported_components(source):
        if target not in LAYERS:
            bad.append(f"line {lineno}: imports unknown component {target!r}")
        elif _unit(target) == _unit(component):
            continue
        elif LAYERS[target] >= LAYERS[component]:
            bad.append(f"line {lineno}: {component} (L{LAYERS[component]}) imports {target} (L{LAYERS[target]})")
    return bad


# L0 (fp8/, rl/) is torch-only: besides our own lower layers, it may import only these.
L0_THIRD_PARTY = set(sys.stdlib_module_names) | {"torch", "numpy", "megatron_fp8rl"}
L0_EXTRA = {"fp8/triton_gemm.py": {"triton"}, "fp8/triton_quantize.py": {"triton"},
            "fp8/triton_scaling.py": {"triton"}}
"""The L0 modules that may import more: the Triton FP8 GEMM (fp8/gemm.py and fp8/cuda_gemm.py import
it lazily) and the Triton quantization and scaling kernels (fp8/device_quantize.py imports them lazily)."""


def _imports(source: str):
    """(import node, the module names it imports) for every import of `source`, lazy ones too;
    `from m import x` counts as m."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield node, [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node, [node.module]


def third_party_violations(source: str, allowed: set[str] = frozenset()) -> list[str]:
    """Imports of an L0 module outside the standard library, torch, numpy and `allowed` (lazy
    ones count)."""
    return [f"line {node.lineno}: imports {n}" for node, names in _imports(source) for n in names
            if n.split(".")[0] not in L0_THIRD_PARTY | allowed]


PURE_FAMILY_MODULES = ("models/__init__.py", "models/family.py", "models/registry.py") + tuple(
    str(p.relative_to(PACKAGE)) for p in sorted((PACKAGE / "models" / "families").glob("*.py")))
"""The model families' facts, which the SGLang plugin loads in SGLang's processes: standard
library and each other only (no torch, no megatron)."""


def _module_file(module: str) -> str:
    """megatron_fp8rl.models.family -> models/family.py (a package: its __init__.py)."""
    path = module.removeprefix("megatron_fp8rl.").replace(".", "/")
    return f"{path}/__init__.py" if (PACKAGE / path).is_dir() else f"{path}.py"


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: Path):
    assert violations(_component(path), path.read_text()) == []


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_has_docstring(path: Path):
    """STYLE.md: each module's top docstring says what it owns (and what it must not import)."""
    assert ast.get_docstring(ast.parse(path.read_text())), f"{path} has no module docstring"


@pytest.mark.parametrize("path", [p for p in _modules() if LAYERS.get(_component(p)) == 0],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_layer0_imports_only_torch_and_stdlib(path: Path):
    allowed = L0_EXTRA.get(str(path.relative_to(PACKAGE)), set())
    assert third_party_violations(path.read_text(), allowed) == []


def impure_family_imports(source: str) -> list[str]:
    """Imports of a family module other than the standard library and PURE_FAMILY_MODULES."""
    bad = []
    for node, names in _imports(source):
        if isinstance(node, ast.ImportFrom) and (PACKAGE / names[0].removeprefix("megatron_fp8rl.")
                                                 .replace(".", "/")).is_dir():
            names = [f"{node.module}.{alias.name}" for alias in node.names]  # from a package
        bad += [f"line {node.lineno}: imports {n}" for n in names
                if n.split(".")[0] not in sys.stdlib_module_names and _module_file(n) not in PURE_FAMILY_MODULES]
    return bad


@pytest.mark.parametrize("relative", PURE_FAMILY_MODULES)
def test_family_modules_import_only_the_standard_library(relative: str):
    assert impure_family_imports((PACKAGE / relative).read_text()) == []


def test_checker_flags_upward_and_sideways_imports():
    assert violations("fp8", "from megatron_fp8rl.compat import megatron_cpu") != []
    assert violations("models", "def f():\n    import megatron_fp8rl.convert.hf") != []
    assert violations("rl", "from megatron_fp8rl import trainer") != []
    assert violations("trainer", "from megatron_fp8rl.models.gpt import build_gpt_model") == []
    assert violations("cli", "from megatron_fp8rl.launch import init_distributed") == []
    assert third_party_violations("def f():\n    import megatron.core") != []
    assert third_party_violations("import torch, numpy as np\nimport math") == []
    assert third_party_violations("import triton") != []
    assert third_party_violations("import triton", L0_EXTRA["fp8/triton_gemm.py"]) == []
    assert impure_family_imports("from megatron_fp8rl.models.families import llama\nimport re") == []
    assert impure_family_imports("from megatron_fp8rl.models import family, families") == []
    assert impure_family_imports("from megatron_fp8rl.models import hf") != []
    assert impure_family_imports("def f():\n    import torch") != []
    assert impure_family_imports("from megatron_fp8rl.compat.versions import check_signature") != []
