"""The version gate: which versions of the libraries we patch or call into were tested, and the
checks that make a drift loud.

Owns: `TESTED_VERSIONS`, `gate` / `check_versions` (called by every entry point: cli.main,
launch.init_distributed, rollout.sglang_launch, tools/*), `require` (the shims' own guard),
`check_signature` (an override asserts, at import, the signature of what it overrides) and
`patch` / `expect` / `restore`: the one way this package replaces or relies on another library's
internals (every site checks the version and the attribute's existence and, where it replaces a
callable, its signature; tests/compat/test_patch_guards.py finds any other).
Must not import: anything of ours above L0; it reads no environment itself (entry points pass the
override, `allowed_from_env`).

Override: `MEGATRON_FP8RL_ALLOW_UNTESTED=<dist>[,<dist>...]` (or `all`) in the environment of
the entry point runs with those distributions at untested versions, at the user's risk: the
signature checks still run and still raise on a drift they can see. `<dist>==<version>` allows
exactly that version (the GPU image names the torch and TE of its base image this way, so another
version is still refused). The SGLang plugin's `register()` runs the same gate in every SGLang
process, with that process's environment.
"""
from __future__ import annotations

import inspect
import types
from importlib import metadata
from typing import Any, Callable, Collection, Mapping, Sequence

ALLOW_ENV = "MEGATRON_FP8RL_ALLOW_UNTESTED"
TESTED_VERSIONS = {
    "torch": ("2.13.0",),
    "megatron-core": ("0.16.1",),
    "sglang": ("0.5.23",),
    "transformer-engine": ("2.20.2",),
}
"""Distribution -> versions the test suite ran against (torch without its +cpu/+cuXXX tag).
torch 2.13.0 and TE 2.20.2 are the CPU tier's (TE: its Python recipe sources); the GPU image's
torch and TE come from its base image and were not run here."""
REQUIRED = ("torch", "megatron-core")
"""Distributions every entry point needs; the others are checked when installed."""
_allowed: frozenset[str] = frozenset()


class UntestedVersionError(RuntimeError):
    """A library is at a version (or has a signature) megatron_fp8rl was not tested against."""


def allowed_from_env(env: Mapping[str, str]) -> frozenset[str]:
    """The distributions `ALLOW_ENV` lets run untested; ValueError naming an unknown one."""
    names = frozenset(name.strip() for name in env.get(ALLOW_ENV, "").split(",") if name.strip())
    unknown = sorted(n for n in names if n.split("==")[0].strip() not in {*TESTED_VERSIONS, "all"})
    if unknown:
        raise ValueError(f"{ALLOW_ENV}: unknown distributions {unknown}; known: "
                         f"{', '.join(TESTED_VERSIONS)} or all")
    return names


def installed_version(dist: str) -> str | None:
    """The installed version of `dist` (local tag such as +cpu dropped), None when absent."""
    try:
        return metadata.version(dist).split("+")[0]
    except metadata.PackageNotFoundError:
        return None


def require(dist: str) -> str:
    """`dist`'s installed version; UntestedVersionError unless tested or allowed."""
    version = installed_version(dist)
    if version is None:
        raise UntestedVersionError(f"{dist} is not installed (tested: {', '.join(TESTED_VERSIONS[dist])})")
    if version not in TESTED_VERSIONS[dist] and not {dist, "all", f"{dist}=={version}"} & _allowed:
        raise UntestedVersionError(
            f"{dist} {version} is installed, but megatron_fp8rl was tested with {dist} "
            f"{', '.join(TESTED_VERSIONS[dist])} only (megatron_fp8rl/compat/versions.py). Install a "
            f"tested version, or set {ALLOW_ENV}={dist}=={version} (this version) or {ALLOW_ENV}={dist} "
            "(any) to run anyway at your own risk.")
    return version


def check_versions(allow: Collection[str] = ()) -> dict[str, str]:
    """Check every pinned library that is installed (REQUIRED ones must be); `allow` names
    distributions allowed at untested versions (remembered for `require`). Returns the versions."""
    global _allowed
    _allowed = frozenset(allow)
    return {dist: require(dist) for dist in TESTED_VERSIONS
            if dist in REQUIRED or installed_version(dist) is not None}


def gate(env: Mapping[str, str]) -> dict[str, str]:
    """What an entry point calls first: `check_versions` with the override `env` (its process
    environment) sets through ALLOW_ENV."""
    return check_versions(allowed_from_env(env))


def check_signature(ours: Callable, theirs: Callable, what: str, skip_first: bool = True) -> None:
    """UntestedVersionError unless `ours` takes the parameters `theirs` takes (names, kinds and
    defaults; with `skip_first` the first of `ours`, self, is not compared)."""
    mine = list(inspect.signature(ours).parameters.values())[1 if skip_first else 0:]
    upstream = list(inspect.signature(theirs).parameters.values())
    describe = lambda params: [(p.name, p.kind.name, p.default) for p in params]  # noqa: E731
    if describe(mine) != describe(upstream):
        raise UntestedVersionError(
            f"{what}: the library's signature changed; ours {inspect.signature(ours)}, theirs "
            f"{inspect.signature(theirs)}. Re-check the override before widening TESTED_VERSIONS.")


def expect(owner: Any, name: str, *, dist: str, params: Sequence[str] | None = None,
           like: Callable | None = None) -> Any:
    """`owner.<name>`, another library's internal that a patch is about to replace or an override
    relies on, once that is safe: `dist` is at a tested (or allowed) version (`require`), `owner`
    has `name`, and a callable there still takes what the patch was written against: exactly the
    parameter names `params` (in order), or the signature of `like` (`check_signature`, first
    parameter included). UntestedVersionError naming `owner.name` otherwise."""
    require(dist)
    where = f"{_describe(owner)}.{name}"
    if not hasattr(owner, name):
        raise UntestedVersionError(f"{where} is gone ({dist} {installed_version(dist)}): megatron_fp8rl "
                                   f"patches or overrides it; re-check the patch before widening TESTED_VERSIONS.")
    original = getattr(owner, name)
    if like is not None:
        check_signature(like, original, where, skip_first=False)
    if params is not None:
        found = tuple(inspect.signature(original).parameters)
        if found != tuple(params):
            raise UntestedVersionError(
                f"{where}: its parameters are {found}, the patch was written against {tuple(params)} "
                f"({dist} {installed_version(dist)}). Re-check the patch before widening TESTED_VERSIONS.")
    return original


def _describe(owner: Any) -> str:
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return f"{type(owner).__module__}.{type(owner).__qualname__} instance"


def patch(owner: Any, name: str, value: Any, *, dist: str, params: Sequence[str] | None = None,
          like: Callable | None = None) -> Any:
    """Replace `owner.<name>` with `value` after `expect`'s checks; returns what was there (for
    `restore`)."""
    original = expect(owner, name, dist=dist, params=params, like=like)
    setattr(owner, name, value)
    return original


def restore(owner: Any, name: str, original: Any) -> None:
    """Put back what `patch` returned."""
    setattr(owner, name, original)
