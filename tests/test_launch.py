"""Distributed start-up: layout checks and torchrun environment parsing name the bad numbers."""
import pytest

from megatron_fp8rl.launch import LaunchError, check_layout, read_torchrun_env


def test_layout_must_divide_world():
    assert check_layout(8, 2, 2) == 2
    with pytest.raises(LaunchError, match=r"tensor_parallel \(2\) x pipeline_parallel \(3\) = 6 .* world size 8"):
        check_layout(8, 2, 3)
    with pytest.raises(LaunchError, match="must both be >= 1"):
        check_layout(4, 0, 1)


def test_single_process_without_torchrun():
    assert read_torchrun_env({}) == (0, 1, 0)


def test_torchrun_env_parsed():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    assert read_torchrun_env(env) == (3, 4, 1)


def test_incomplete_torchrun_env_names_missing_vars():
    with pytest.raises(LaunchError, match="MASTER_ADDR, MASTER_PORT missing"):
        read_torchrun_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def test_rank_outside_world():
    env = {"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    with pytest.raises(LaunchError, match="RANK=4 is outside WORLD_SIZE=4"):
        read_torchrun_env(env)
