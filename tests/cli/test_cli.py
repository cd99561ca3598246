"""The command line: help, clear errors for bad input (never a traceback), overrides."""

import re
import subprocess
import sys

import pytest

from collab_kit.config import SettingProblem, parse_overrides


def run_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "collab_kit.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_the_commands():
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("demo", "join", "monitor", "model-info"):
        assert command in result.stdout


@pytest.mark.parametrize(
    "address, message",
    [
        ("/ip4/1.2.3/tcp/5", "is not a valid multiaddr"),
        ("localhost:31337", "is not a valid multiaddr"),
        ("/ip4/127.0.0.1/tcp/31337", "has no /p2p/<peer id> part"),
    ],
)
def test_a_malformed_initial_peer_is_a_clear_error_not_a_traceback(address, message):
    result = run_cli("join", "--preset", "tiny", "--initial-peers", address)
    assert result.returncode == 2
    assert message in result.stderr and "A peer address looks like /ip4/" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unreachable_peer_and_bad_settings_are_clear_errors(tmp_path):
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWBmwXN3rsVfnLsZKbXeBrSLfczHxZHwVjPrbKwpLfYm3t"
    result = run_cli("join", "--preset", "tiny", "--initial-peers", nobody, "--data", str(tmp_path))
    assert result.returncode == 2 and "could not reach any initial peer" in result.stderr
    assert "Traceback" not in result.stderr

    result = run_cli("join", "--preset", "tiny", "--set", "optimizer.learning_rate=-1")
    assert result.returncode == 2 and "optimizer.learning_rate=-1" in result.stderr
    assert "Traceback" not in result.stderr

    result = run_cli("join", "--preset", "tiny", "--host", "127.0.0.1", "--data", str(tmp_path / "missing"))
    assert result.returncode == 2 and "no parquet shards found" in result.stderr
    assert "Traceback" not in result.stderr

    # a GPU asked for on this machine (none, or a CPU-only torch): one sentence, before anything starts
    result = run_cli("join", "--preset", "tiny", "--host", "127.0.0.1", "--device", "cuda", "--data", str(tmp_path))
    assert result.returncode == 2 and "--device cuda: " in result.stderr and "use --device cpu" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr

    # a share of the machine that is none or more than all of it: one sentence, before anything starts
    for share in ("0", "1.5"):
        result = run_cli(
            "join", "--preset", "tiny", "--host", "127.0.0.1", "--max-load", share, "--data", str(tmp_path)
        )
        assert result.returncode == 2 and f"--max-load {share}: " in result.stderr and "at most 1" in result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_overrides_parse_values_and_reject_bad_syntax():
    assert parse_overrides(["optimizer.target_batch_size=64", "swarm.run_id=abc", "optimizer.betas=(0.9, 0.95)"]) == {
        "optimizer": {"target_batch_size": 64, "betas": (0.9, 0.95)},
        "swarm": {"run_id": "abc"},
    }
    with pytest.raises(SettingProblem, match="SECTION.FIELD=VALUE"):
        parse_overrides(["target_batch_size=64"])


def test_model_info_counts_the_paper_model_without_building_it():
    result = run_cli("model-info", "--preset", "paper")
    assert result.returncode == 0, result.stderr
    counts = re.search(r"^params: unique=(\d+) compute=(\d+)$", result.stdout, re.MULTILINE)
    unique, compute = int(counts.group(1)), int(counts.group(2))
    # the paper: about 1.1B parameters of compute, about 8x fewer stored
    assert 1.0e9 <= compute <= 1.2e9 and compute / unique >= 7
    assert "layers: 64" in result.stdout and "blocks: 5 stored" in result.stdout
    # without sharing, every parameter is stored
    unshared = run_cli("model-info", "--preset", "paper", "--set", "model.share_layer_groups=False")
    assert f"params: unique={compute} compute={compute}" in unshared.stdout
    bad = run_cli("model-info", "--preset", "tiny", "--set", "model.attention_pattern=row,diagonal")
    assert bad.returncode == 2 and "model.attention_pattern" in bad.stderr and "Traceback" not in bad.stderr
