"""`collab-kit demo`: the whole local run, and its one summary line."""
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SUMMARY = re.compile(r"^demo: peers=(\d+) epochs=(\d+) loss_first=([\d.]+) loss_last=([\d.]+) averaged_rounds=(\d+)$")


def test_demo_trains_together_and_prints_one_summary_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "collab_kit.cli", "demo", "--preset", "tiny", "--peers", "2", "--epochs", "3",
         "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summaries = [line for line in result.stdout.splitlines() if SUMMARY.match(line)]
    assert len(summaries) == 1, result.stdout
    peers, epochs, loss_first, loss_last, rounds = SUMMARY.match(summaries[0]).groups()
    assert (int(peers), int(epochs)) == (2, 3)
    assert int(rounds) >= 1 and float(loss_last) < float(loss_first)
    # live progress: one line per global epoch before the summary
    assert len([line for line in result.stdout.splitlines() if line.startswith("demo: epoch ")]) == 3
    # the peers' logs stay in the workdir
    assert (tmp_path / "volunteer_1.log").exists() and (tmp_path / "first_peer.log").exists()


def test_demo_that_cannot_start_fails_with_a_message(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "collab_kit.cli", "demo", "--preset", "tiny", "--peers", "0"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "at least one volunteer" in result.stderr
