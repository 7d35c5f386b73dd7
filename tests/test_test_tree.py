"""The test tree's sharing rule: what test modules share lives in tests/helpers/ and is imported
from there; no file under tests/ imports a conftest.py or a test module (pytest owns those)."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imported_tests_modules(path: Path):
    """Dotted names under `tests` that `path` imports (`from tests.a import b` gives `tests.a.b`)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name.startswith("tests."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "tests" or node.module.startswith("tests."):
                yield from (f"{node.module}.{alias.name}" for alias in node.names)


def outside_helpers(path: Path) -> list[str]:
    return [name for name in _imported_tests_modules(path) if not name.startswith("tests.helpers")]


def test_shared_code_comes_from_tests_helpers_only():
    offenders = {str(p.relative_to(TESTS)): outside_helpers(p) for p in sorted(TESTS.rglob("*.py"))}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_check_sees_each_import_form(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text("import tests.trainer.conftest\nfrom tests.rollout import conftest\n"
                   "from tests.models.test_logits import x\nfrom tests.helpers.train import run_train\n")
    assert outside_helpers(bad) == ["tests.trainer.conftest", "tests.rollout.conftest",
                                    "tests.models.test_logits.x"]
