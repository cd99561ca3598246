"""PeerProcess, the parent's view of a peer's events: what a test sees when it looks back after a wait."""

import subprocess
import sys

import pytest
from waiting import wait_until

from collab_kit.roles.processes import PeerFailed, PeerProcess

# a child that prints events "first" and "second" at once, then waits for its standard input to close
CHILD = """
from collab_kit.roles.processes import emit_event
import sys
emit_event("first", n=1)
emit_event("second", n=2)
sys.stdin.read()
emit_event("last", n=3)
"""


@pytest.fixture
def child(tmp_path):
    peer = PeerProcess(
        "child", ["-c", CHILD], str(tmp_path / "child.log"), command=[sys.executable], stdin=subprocess.PIPE
    )
    yield peer
    peer.kill(grace=1.0)


def test_events_read_meanwhile_are_seen_without_another_wait(child):
    child.wait_for(lambda e: e["type"] == "first", timeout=30, what="the first event")
    # the second came with the first: looking back (as a test does after a wait of its own) must show it, not only
    # what wait_for happened to read (a cut-link test once judged the swarm's epoch from such a stale list)
    wait_until(
        lambda: [e["type"] for e in child.events] == ["first", "second"],
        timeout=30,
        what="the second event among the events",
    )


def test_a_predicate_that_looks_at_the_events_misses_none(child):
    seen = []

    def predicate(event):
        seen.append(event["type"])
        return len(child.events) >= 2 and event["type"] == "second"

    assert child.wait_for(predicate, timeout=30, what="the second event")["n"] == 2
    assert seen[-1] == "second" and "first" in seen


def test_an_exited_child_reports_its_last_events_then_fails_every_later_wait(child):
    child.process.stdin.close()
    assert child.wait_for(lambda e: e["type"] == "last", timeout=30, what="the last event")["n"] == 3
    assert child.wait_exit(30) == 0
    for _ in range(2):  # every wait after the exit says so, at once
        with pytest.raises(PeerFailed, match="exited with code 0"):
            child.wait_for(lambda e: e["type"] == "never", timeout=30, what="an event never printed")
    assert [e["type"] for e in child.events] == ["first", "second", "last"]
