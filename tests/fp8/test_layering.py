"""fp8/ is layer L0: its modules import only the standard library, torch, numpy and fp8/ itself
(never megatron, transformer_engine or megatron_fp8rl.compat), lazily or not."""
import ast
import sys
from pathlib import Path

import megatron_fp8rl.fp8

FP8_DIR = Path(megatron_fp8rl.fp8.__file__).parent
ALLOWED_ROOTS = set(sys.stdlib_module_names) | {"torch", "numpy"}


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return names


def test_fp8_imports_only_torch_stdlib_and_itself():
    offenders = [
        f"{path.name}: {name}"
        for path in sorted(FP8_DIR.glob("*.py"))
        for name in imported_modules(path)
        if name.startswith(".")
        or not (name.split(".")[0] in ALLOWED_ROOTS or name.startswith("megatron_fp8rl.fp8"))
    ]
    assert not offenders, "fp8/ must stay L0 (torch only):\n" + "\n".join(offenders)
