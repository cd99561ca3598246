"""Every way a pasted join line can fail before training: exit code 2 and one sentence on stderr that says what to do.

Two real runs on 127.0.0.1 (a synchronous one that names no data, and one in the local-update mode that names its
shards); each volunteer is the real ``collab-kit join``, started with the run's printed line or a changed one. The
Hub is the stand-in of hub_server.py (or none at all), reached by the real client.
"""

import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

NOBODY = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWBmwXN3rsVfnLsZKbXeBrSLfczHxZHwVjPrbKwpLfYm3t"


def printed_line(monitor) -> list:
    with open(monitor.log_path) as f:
        [line] = [text for text in f.read().splitlines() if "To join this swarm: " in text][-1:]
    return shlex.split(line.split("To join this swarm: ", 1)[1])[1:]  # the words after `collab-kit`


def join(words, env=None, timeout=120):
    """``collab-kit WORDS`` with a one-step limit; returns (exit code, stderr)."""
    environment = dict(os.environ, **(env or {}))
    result = subprocess.run(
        [sys.executable, "-m", "collab_kit.cli", *words, "--max-steps", "1", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
    )
    return result.returncode, result.stderr


def one_sentence(stderr: str) -> str:
    """The one error line of ``collab-kit join`` (anything else on stderr fails the test: no traceback)."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("collab-kit join: error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_pasted_line_that_cannot_train_says_why_in_one_sentence(start_peer, tiny_shards, tmp_path, hub_server):
    common = [
        "--preset",
        "tiny",
        "--host",
        "127.0.0.1",
        "--events",
        "--poll-every",
        "2",
        "--checkpoint-every",
        "0",
        "--db",
        "",
    ]
    sync = start_peer("sync-monitor", "monitor", "--run-id", "sync_run", *common)
    local = start_peer(
        "local-monitor",
        "monitor",
        "--run-id",
        "local_run",
        "--data",
        tiny_shards,
        "--set",
        "optimizer.local_steps=2",
        *common,
    )
    for monitor in (sync, local):
        monitor.wait_for(lambda e: e["type"] == "ready", timeout=90, what="its address")
    sync_line, local_line, mode = printed_line(sync), printed_line(local), "optimizer.local_steps=2"
    assert "--data" not in sync_line and "--data" in local_line and mode in local_line, local_line
    peers = sync_line[sync_line.index("--initial-peers") :]
    hub_server.add_repo("someone/private-codes", tiny_shards, repo_type="dataset", private=True)
    online = dict(HF_HUB_OFFLINE="0", HF_DATASETS_OFFLINE="0", HF_ENDPOINT=hub_server.endpoint)
    with_data = [*sync_line, "--data", tiny_shards]
    cases = {
        "no data": (sync_line, None, ["run 'sync_run' names no data", "pass --data"]),
        "hub offline": (
            [*sync_line, "--data", "someone/codes"],
            None,
            ["offline mode is on (HF_HUB_OFFLINE=1)", "local copy"],
        ),
        "hub missing": (
            [*sync_line, "--data", "someone/no-such-codes"],
            online,
            ["'someone/no-such-codes' does not exist, or it is private", "hf auth login"],
        ),
        "hub private": (
            [*sync_line, "--data", "someone/private-codes"],
            online,
            ["'someone/private-codes' does not exist, or it is private", "hf auth login"],
        ),
        "hub unreachable": (
            [*sync_line, "--data", "someone/codes"],
            dict(online, HF_ENDPOINT="http://127.0.0.1:9"),
            ["could not reach the Hugging Face Hub", "Internet connection"],
        ),
        "no answer": (
            ["join", "--preset", "tiny", "--data", tiny_shards, "--initial-peers", NOBODY],
            None,
            ["could not reach any initial peer", "check that the first peer is still running"],
        ),
        "run id": (
            ["join", "--preset", "tiny", "--run-id", "other_run", "--data", tiny_shards, *peers],
            None,
            ["trains run 'sync_run', not 'other_run'", "--run-id sync_run"],
        ),
        "preset": (
            ["join", "--preset", "small", "--run-id", "sync_run", "--data", tiny_shards, *peers],
            None,
            ["uses preset 'small' and run 'sync_run' trains preset 'tiny'", "collab-kit join --preset tiny"],
        ),
        "setting": (
            [*with_data, "--set", "optimizer.target_batch_size=999"],
            None,
            ["optimizer.target_batch_size=999 where the run has 2048"],
        ),
        "local peer, synchronous run": (
            [*with_data, "--set", "optimizer.local_steps=3"],
            None,
            ["in the local-update mode (optimizer.local_steps=3) and run 'sync_run' trains synchronously"],
        ),
        "synchronous peer, local run": (
            [word for word in local_line if word not in ("--set", mode)],
            None,
            [
                "this peer would train synchronously (optimizer.local_steps=0) and run "
                "'local_run' trains in the local-update mode (optimizer.local_steps=2)"
            ],
        ),
    }
    with ThreadPoolExecutor(max_workers=3) as pool:  # each waits mostly on its DHT: three at once on two cores
        outcomes = dict(zip(cases, pool.map(lambda case: join(case[0], case[1]), cases.values())))
    for name, (code, stderr) in outcomes.items():
        sentence = one_sentence(stderr)
        assert code == 2, (name, code, stderr)
        for part in cases[name][2]:
            assert part in sentence, (name, part, sentence)
