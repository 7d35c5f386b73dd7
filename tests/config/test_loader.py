"""Config loading: defaults < YAML < overrides; errors name the key and suggest the closest."""
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megatron_fp8rl.config.loader import ConfigError, load_config, save_config


@dataclass
class Optim:
    lr: float = 1e-5
    """learning rate"""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam betas"""

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")


@dataclass
class Run:
    name: str = "demo"
    """run name"""
    steps: int = 10
    """optimizer steps"""
    run_dir: Path = Path("runs/x")
    """output directory"""
    optim: Optim = field(default_factory=Optim)
    """optimizer"""


def test_precedence_defaults_yaml_overrides(tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("steps: 20\noptim:\n  lr: 0.001\n")
    cfg = load_config(Run, yaml, ["optim.lr=0.5", "name=x"])
    assert isinstance(cfg, Run) and isinstance(cfg.optim, Optim)
    assert (cfg.steps, cfg.optim.lr, cfg.name, cfg.optim.betas) == (20, 0.5, "x", [0.9, 0.999])
    assert isinstance(cfg.run_dir, Path)


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.lrr'.*did you mean 'optim.lr'"):
        load_config(Run, None, ["optim.lrr=1"])


def test_unknown_key_in_yaml_names_file(tmp_path):
    yaml = tmp_path / "bad.yaml"
    yaml.write_text("stepz: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown config key 'stepz'.*'steps'"):
        load_config(Run, yaml)


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"bad value for 'steps'"):
        load_config(Run, None, ["steps=many"])


def test_post_init_check_reaches_user():
    with pytest.raises(ConfigError, match="optim.lr must be > 0"):
        load_config(Run, None, ["optim.lr=-1"])


def test_missing_file_and_malformed_override(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Run, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(Run, None, ["steps"])


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(Run, None, ["steps=7", "optim.lr=0.25"])
    path = save_config(cfg, tmp_path / "out" / "config.yaml")
    assert load_config(Run, path) == cfg
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]
