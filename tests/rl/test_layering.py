"""rl/ is layer L0: its modules import only the standard library, torch, numpy and rl/ itself."""
import ast
import sys
from pathlib import Path

import megatron_fp8rl.rl

RL_DIR = Path(megatron_fp8rl.rl.__file__).parent
ALLOWED_ROOTS = set(sys.stdlib_module_names) | {"torch", "numpy"}


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return names


def test_rl_imports_only_torch_stdlib_and_itself():
    offenders = []
    for path in sorted(RL_DIR.glob("*.py")):
        for name in imported_modules(path):
            allowed = name.split(".")[0] in ALLOWED_ROOTS or name.startswith("megatron_fp8rl.rl")
            if not allowed or name.startswith("."):
                offenders.append(f"{path.name}: {name}")
    assert not offenders, "rl/ must stay L0 (torch only):\n" + "\n".join(offenders)
