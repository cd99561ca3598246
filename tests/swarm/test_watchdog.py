"""The watchdog of a peer in client mode: a port that answers is not the swarm unless the right peer answers there.

Real DHTs on 127.0.0.1: the first peer is shut down and another one (a new identity) listens on its port; the peer that
joined through it must take that for a link that is down, say why, and take the first peer's return with its key file
for the link's return.
"""

import logging
import queue
import socket
import time

from collab_kit.config import SwarmConfig
from collab_kit.swarm.dht import join_addresses, start_dht
from collab_kit.swarm.watchdog import SwarmWatchdog


def next_event(events: queue.Queue, wanted: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            event = events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"the watchdog did not say the link is {wanted} within {timeout:.0f} s") from None
        if event == wanted:
            return event


def wait_until_refused(port: int, timeout: float) -> None:
    """Wait until nothing listens on ``port``: a DHT's shutdown returns before its p2p daemon has exited, and libp2p
    listens with SO_REUSEPORT, so a peer started at once on the same port would share it with the old one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
        except OSError:
            return
        time.sleep(0.1)
    raise AssertionError(f"port {port} still answers {timeout:.0f} s after its peer was shut down")


def test_another_peer_on_the_first_peers_port_is_no_link_back_and_the_same_peer_is(tmp_path, caplog):
    key = str(tmp_path / "first.key")
    first = start_dht(SwarmConfig(host="127.0.0.1", identity_path=key))
    address = join_addresses(first)[0]
    port = int(address.split("/tcp/")[1].split("/")[0])
    peer = start_dht(SwarmConfig(host="127.0.0.1", client_mode=True, initial_peers=[address]))
    events: queue.Queue = queue.Queue()
    started = [peer]
    watchdog = SwarmWatchdog(
        peer,
        [address],
        period=0.2,
        timeout=1.0,
        probe_every=0.5,
        down_after=1.5,
        on_link_down=lambda: events.put("down"),
        on_link_back=lambda: events.put("back"),
    )
    try:
        with caplog.at_level(logging.WARNING, logger="collab_kit.swarm.watchdog"):
            first.shutdown()
            wait_until_refused(port, timeout=30)
            impostor = start_dht(SwarmConfig(host="127.0.0.1", port=port))  # a new identity, the same port
            started.append(impostor)
            next_event(events, "down", timeout=30)  # its port answers, and it is not the peer of the line
            deadline = time.monotonic() + 10
            while "another peer answers at the address" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.1)
            assert f"another peer answers at the address of initial peer /ip4/127.0.0.1/tcp/{port}" in caplog.text
            assert events.empty()  # no return of the link while the other peer is there
            impostor.shutdown()
            wait_until_refused(port, timeout=30)
            again = start_dht(SwarmConfig(host="127.0.0.1", port=port, identity_path=key))  # the same identity
            started.append(again)
            assert join_addresses(again) == [address]
            next_event(events, "back", timeout=30)
    finally:
        watchdog.stop()
        for dht in started:
            dht.shutdown()
