"""Fixtures that give tests Transformer Engine's real pure-Python code without installing TE
(tests/models/conftest.py registers them for the model tests).

TE cannot be imported on the CPU tier (no CUDA libraries), and a broken TE install breaks
`import megatron.core.models.gpt`. TE's recipe module (`transformer_engine/common/recipe`) is
pure Python, and the delayed-scaling update (`pytorch/quantization.py`) is plain torch code, so:
- `te_wheel` is the 1.2 MB py3-none-any wheel that scripts/env.sh downloads into <venv>/wheels/
  (`pip download --no-deps`); tests never touch the network, and FAIL (never skip) without it;
- `te_recipe_module` extracts the recipe module into a temporary folder and imports it as
  `transformer_engine.common.recipe` under empty stand-in parent packages, for the test only
  (megatron is imported first so its HAVE_TE probe never sees the stand-ins, and they are removed
  afterwards);
- `te_scaling_functions` compiles TE's delayed-scaling functions out of quantization.py (without
  its C-extension imports; `jit_fuser` is the identity, TE's own NVTE_TORCH_COMPILE=0 behaviour).
Where a real TE is importable (GPU tier), the real modules are used instead.
"""
from __future__ import annotations

import ast
import importlib.util
import sys
import types
import zipfile
from pathlib import Path

import pytest

TE_VERSION = "2.20.2"
WHEEL_NAME = f"transformer_engine-{TE_VERSION}-py3-none-any.whl"
WHEEL_DIR = Path(sys.prefix) / "wheels"
RECIPE_PATH = "transformer_engine/common/recipe/__init__.py"
QUANTIZATION_PATH = "transformer_engine/pytorch/quantization.py"
SCALING_FUNCTIONS = (
    "_update_amax_history",
    "_default_get_amax_and_update_history",
    "_default_sf_compute",
    "_compute_amax_and_update_history",
    "_compute_scaling_factor",
    "_amax_and_scale_update",
)
STAND_INS = ("transformer_engine", "transformer_engine.common", "transformer_engine.common.recipe")


def _real_te_available() -> bool:
    return importlib.util.find_spec("transformer_engine_torch") is not None


@pytest.fixture(scope="session")
def te_wheel() -> Path:
    """Path of TE's meta wheel in the virtualenv's wheels folder (put there by scripts/env.sh)."""
    wheel = WHEEL_DIR / WHEEL_NAME
    if not wheel.is_file():
        pytest.fail(
            f"{wheel} is missing: the TE recipe tests read TE's sources from it. Run "
            f"scripts/env.sh, or on an offline machine copy {WHEEL_NAME} there by hand "
            f"(pip download --no-deps transformer-engine=={TE_VERSION} -d {WHEEL_DIR}).",
            pytrace=False,
        )
    return wheel


def _extract(wheel: Path, member: str, folder: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        return Path(archive.extract(member, folder))


@pytest.fixture
def te_recipe_module(te_wheel, tmp_path):
    """TE's real `transformer_engine.common.recipe` module, imported from the wheel."""
    if _real_te_available():
        from transformer_engine.common import recipe

        yield recipe
        return
    import megatron.core.fp8_utils  # noqa: F401  (decide megatron's HAVE_TE before the stand-ins)
    import megatron.core.models.gpt  # noqa: F401

    path = _extract(te_wheel, RECIPE_PATH, tmp_path)
    saved = {name: sys.modules.get(name) for name in STAND_INS}
    for name in STAND_INS[:2]:
        package = types.ModuleType(name)
        package.__path__ = []
        sys.modules[name] = package
    spec = importlib.util.spec_from_file_location(STAND_INS[2], path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[STAND_INS[2]] = module
    try:
        spec.loader.exec_module(module)
        sys.modules["transformer_engine.common"].recipe = module
        yield module
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous


@pytest.fixture
def te_scaling_functions(te_wheel, te_recipe_module, tmp_path):
    """TE's delayed-scaling update functions from quantization.py, by name."""
    if _real_te_available():
        from transformer_engine.pytorch import quantization

        return {name: getattr(quantization, name) for name in SCALING_FUNCTIONS}
    source = _extract(te_wheel, QUANTIZATION_PATH, tmp_path).read_text()
    wanted = [node for node in ast.parse(source).body
              if isinstance(node, ast.FunctionDef) and node.name in SCALING_FUNCTIONS]
    missing = set(SCALING_FUNCTIONS) - {node.name for node in wanted}
    assert not missing, f"TE {TE_VERSION} quantization.py lacks {sorted(missing)}"
    module = ast.Module(body=wanted, type_ignores=[])
    import __future__
    import torch
    from typing import Callable, Tuple, Union

    namespace = {"torch": torch, "Callable": Callable, "Tuple": Tuple, "Union": Union,
                 "DelayedScaling": te_recipe_module.DelayedScaling, "jit_fuser": lambda f: f}
    code = compile(module, QUANTIZATION_PATH, "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, namespace)  # noqa: S102  (TE's own source, from the pinned wheel)
    return {name: namespace[name] for name in SCALING_FUNCTIONS}
