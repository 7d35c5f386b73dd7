"""Every patch of another library's internals goes through compat/versions (`patch`, `expect`,
`restore`), which checks the library's version, that the attribute is there and, where a callable is
replaced, its signature: a source scan finds any patch made another way, and the real patch sites
refuse a drifted library by name (issue 45 item 3)."""
import ast
import inspect
from pathlib import Path

import pytest

from megatron_fp8rl.compat import versions
from megatron_fp8rl.compat.versions import UntestedVersionError
from tests.helpers.processes import REPO

FOREIGN = {"torch", "megatron", "sglang", "transformer_engine", "transformers", "triton", "safetensors",
           "zmq", "numpy", "ml_dtypes"}
OWN_SETATTR = {
    ("megatron_fp8rl/data/rewards.py", "setattr(stats, field, getattr(stats, field) + 1)"),
}
"""setattr calls on our own objects (file, source): a counter of our own dataclass."""
OWN_PRIVATE = {
    ("megatron_fp8rl/fp8/device_quantize.py", "q._device_bound_scale"),
    ("megatron_fp8rl/fp8/device_quantize.py", "q._device_scales"),
    ("megatron_fp8rl/fp8/device_quantize.py", "quantizer._device_weight_cache"),
}
"""Private attributes set on our own objects from outside their class (file, target): the device
caches the GPU path keeps on fp8/quantizer.py's quantizers."""
MUTATORS = {"append", "extend", "insert", "update", "setdefault", "add", "pop", "remove", "clear"}


def _foreign_names(tree: ast.AST) -> set[str]:
    """Names a module binds to another library's modules or objects (any import in it)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in FOREIGN}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FOREIGN:
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _reaches_a_class(target: ast.AST) -> bool:
    """Whether an attribute target sits on a class reached through an attribute chain, whatever
    the chain's root: `x.__class__.attr`, `type(x).attr`, `module.Class.attr` (a capitalized step)."""
    if not isinstance(target, ast.Attribute):
        return False
    node = target.value
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute) and (node.attr == "__class__" or node.attr[:1].isupper()):
            return True
        node = node.value
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type"


def _replaces_a_private_attribute(target: ast.AST) -> bool:
    """`obj._name = ...` on an object other than self or cls: another object's private attribute
    (`layer._forward_impl = f` replaced a Megatron method on one instance)."""
    return (isinstance(target, ast.Attribute) and target.attr.startswith("_") and not target.attr.endswith("__")
            and not (isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")))


def unguarded_patches(path: Path, source: str) -> list[str]:
    """`file:line: code` of each place `source` changes another library's state without
    compat/versions: a setattr (outside OWN_SETATTR), an attribute or item assigned on an imported
    name or on a class reached through an attribute chain, a private attribute assigned on another
    object, a mutating method called on an imported name's attribute."""
    tree = ast.parse(source)
    foreign = _foreign_names(tree)
    rel = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.as_posix()
    found = []

    def flag(node, code):
        found.append(f"{rel}:{node.lineno}: {code}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if (rel, ast.unparse(node)) not in OWN_SETATTR:
                flag(node, ast.unparse(node))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                base = _root(target)
                private = _replaces_a_private_attribute(target) and (rel, ast.unparse(target)) not in OWN_PRIVATE
                if ((target is not base and isinstance(base, ast.Name) and base.id in foreign)
                        or _reaches_a_class(target) or private):
                    flag(node, ast.unparse(target))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
              and isinstance(node.func.value, (ast.Attribute, ast.Subscript))):
            base = _root(node.func.value)
            if isinstance(base, ast.Name) and base.id in foreign:
                flag(node, ast.unparse(node))
    return found


def test_no_package_module_patches_another_library_past_the_guard():
    package = REPO / "megatron_fp8rl"
    found = [hit for path in sorted(package.rglob("*.py")) if path.name != "versions.py" or path.parent.name != "compat"
             for hit in unguarded_patches(path, path.read_text())]
    assert found == [], "patch another library only through compat/versions.patch/expect/restore:\n" + "\n".join(found)


@pytest.mark.parametrize("code", [
    "import torch\ntorch.cuda.synchronize = lambda: None",
    "from sglang.srt.layers import quantization\nquantization.QUANTIZATION_METHODS['x'] = 1",
    "from sglang.srt.arg_groups import choices\nchoices.QUANTIZATION_CHOICES.append('x')",
    "from megatron.core import fp8_utils\nsetattr(fp8_utils, 'get_fp8_recipe', None)",
    "from torch.distributed.checkpoint import FileSystemReader\nFileSystemReader.read_metadata = None",
    "def f():\n    from megatron.core import fp8_utils\n    del fp8_utils.get_fp8_recipe",
    "def f(model, impl):\n    model.output_layer.__class__.forward = impl",
    "def f(x):\n    type(x).forward = None",
    "import megatron_fp8rl.models.gpt as gpt\ngpt.layers.ColumnParallelLinear.forward = None",
    "def f(model, impl):\n    layer = getattr(model, 'output_layer')\n    layer._forward_impl = impl",
])
def test_the_scan_finds_each_kind_of_unguarded_patch(code):
    assert len(unguarded_patches(Path("m.py"), code)) == 1


def test_the_scan_finds_the_output_layer_patch_as_it_was_made(tmp_path):
    """megatron_attention.py replaced ColumnParallelLinear._forward_impl on the output layer with a
    plain assignment; the scan, which followed only imported names, did not see it."""
    source = (REPO / "megatron_fp8rl/models/megatron_attention.py").read_text()
    guarded = ('    original = patch(layer, "_forward_impl", forward_impl, dist="megatron-core", '
               'params=OUTPUT_LAYER_FORWARD_PARAMS)\n')
    assert guarded in source
    planted = tmp_path / "megatron_attention.py"
    planted.write_text(source.replace(guarded, "    original = layer._forward_impl\n    layer._forward_impl = forward_impl\n"))
    assert [hit.split(": ", 1)[1] for hit in unguarded_patches(planted, planted.read_text())] == ["layer._forward_impl"]


def test_the_output_layer_patch_refuses_a_drifted_forward_impl():
    from types import SimpleNamespace

    from megatron_fp8rl.models.megatron_attention import serve_output_layer_in_tiles

    def drifted(input, weight, bias):
        return None

    layer = SimpleNamespace(_forward_impl=drifted)
    with pytest.raises(UntestedVersionError, match=r"SimpleNamespace instance._forward_impl: its parameters are "
                                                   r"\('input', 'weight', 'bias'\)"):
        serve_output_layer_in_tiles(SimpleNamespace(output_layer=layer))
    assert layer._forward_impl is drifted


def test_the_scan_leaves_our_own_objects_and_guarded_patches_alone():
    code = ("import torch\nfrom megatron_fp8rl.compat.versions import patch\n"
            "def f(x):\n    x.y = 1\n    f.marker = True\n    patch(torch.cuda, 'synchronize', None, dist='torch')\n"
            "class C:\n    def g(self):\n        self._cache = 1\n        self.inner.value = 2\n        f.__doc__ = ''\n")
    assert unguarded_patches(Path("m.py"), code) == []


class _Owner:
    @staticmethod
    def method(a, b=1):
        return a + b


def test_patch_checks_version_existence_and_signature_and_restore_undoes_it(monkeypatch):
    original = _Owner.method
    assert versions.patch(_Owner, "method", lambda a, b=1: 0, dist="torch", params=("a", "b")) is original
    assert _Owner.method(1) == 0
    versions.restore(_Owner, "method", original)
    assert _Owner.method(1) == 2
    with pytest.raises(UntestedVersionError, match=r"test_patch_guards._Owner.gone is gone \(torch 2.13.0\)"):
        versions.patch(_Owner, "gone", None, dist="torch")
    with pytest.raises(UntestedVersionError, match=r"_Owner.method: its parameters are \('a', 'b'\), the patch "
                                                   r"was written against \('a', 'c'\)"):
        versions.patch(_Owner, "method", None, dist="torch", params=("a", "c"))

    def mirror(a, b=2):
        pass

    with pytest.raises(UntestedVersionError, match="_Owner.method: the library's signature changed"):
        versions.patch(_Owner, "method", mirror, dist="torch", like=mirror)
    real = versions.metadata.version
    monkeypatch.setattr(versions.metadata, "version", lambda name: "9.9.9" if name == "torch" else real(name))
    monkeypatch.setattr(versions, "_allowed", frozenset())
    with pytest.raises(UntestedVersionError, match="torch 9.9.9 is installed"):
        versions.patch(_Owner, "method", None, dist="torch", params=("a", "b"))
    assert _Owner.method is original  # nothing was replaced by a refused patch


def test_sglang_patch_sites_refuse_an_untested_sglang(monkeypatch):
    from megatron_fp8rl.compat import sglang_cpu

    sglang_cpu.install()  # SGLang's CPU stand-ins (it checks the version too), before the drift
    from megatron_fp8rl.compat.bf16_gemm import patch_sglang_bf16_gemms
    from megatron_fp8rl.models.served_arithmetic import align_torch_native_attention, tile_cpu_lm_head

    real = versions.metadata.version
    monkeypatch.setattr(versions.metadata, "version", lambda name: "9.9.9" if name == "sglang" else real(name))
    monkeypatch.setattr(versions, "_allowed", frozenset())

    for site in (align_torch_native_attention, tile_cpu_lm_head, patch_sglang_bf16_gemms):
        with pytest.raises(UntestedVersionError, match="sglang 9.9.9 is installed"):
            site()


def test_megatron_recipe_selection_refuses_a_drifted_get_fp8_recipe(monkeypatch):
    from megatron.core import fp8_utils

    from megatron_fp8rl.fp8.recipe import CalibratedDelayedScaling
    from megatron_fp8rl.models.te_recipe import install_megatron_recipe

    monkeypatch.setattr(fp8_utils, "get_fp8_recipe", lambda config, is_init=False: None)
    with pytest.raises(UntestedVersionError, match=r"megatron.core.fp8_utils.get_fp8_recipe: its parameters are "
                                                   r"\('config', 'is_init'\)"):
        install_megatron_recipe(CalibratedDelayedScaling())


def test_safe_dcp_refuses_a_drifted_load_bytes(monkeypatch):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from megatron_fp8rl.compat import safe_dcp

    def load_bytes(self, read_item, value, strict=True):
        """torch.load( of a future torch"""
        return None

    monkeypatch.setattr(safe_dcp, "_installed", {})
    monkeypatch.setattr(safe_dcp, "_check_replaced", lambda method, must_contain: None)
    monkeypatch.setattr(DefaultLoadPlanner, "load_bytes", load_bytes)
    with pytest.raises(UntestedVersionError, match="DefaultLoadPlanner.load_bytes: the library's signature changed"):
        safe_dcp.install()
    assert DefaultLoadPlanner.load_bytes is load_bytes and safe_dcp._installed == {}


def test_the_weight_update_group_checks_torchs_private_helper(monkeypatch):
    from torch.distributed import distributed_c10d

    from megatron_fp8rl.rollout.weight_update_group import init_weight_update_group

    params = tuple(inspect.signature(distributed_c10d._new_process_group_helper).parameters)
    assert "group_desc" in params  # what the guard was written against
    monkeypatch.setattr(distributed_c10d, "_new_process_group_helper", lambda group_size, group_rank: None)
    with pytest.raises(UntestedVersionError, match="_new_process_group_helper: its parameters are"):
        init_weight_update_group("gloo", "127.0.0.1", 1, 0, 1, "g", timeout_s=1.0)
