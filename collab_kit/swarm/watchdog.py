"""Staying in the swarm: the watchdog that tells a cut link from a working one and dials the initial peers again.

hivemind drops a neighbour whose answer is late, and a peer in client mode knows one or two: ``SwarmWatchdog`` dials
the initial peers again then, and tells a cut link (and its return) from a slow one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from collab_kit.swarm.kept_tasks import kept_until_done

logger = logging.getLogger(__name__)


def _tcp_endpoint(maddr: Multiaddr) -> tuple[str, int] | None:
    """(host, port) of a multiaddr's TCP transport, or None (a relayed or non-TCP address)."""
    if "p2p-circuit" in str(maddr):
        return None
    for protocol in ("ip4", "ip6", "dns4", "dns6", "dns"):
        try:
            return maddr.value_for_protocol(protocol), int(maddr.value_for_protocol("tcp"))
        except Exception:  # the multiaddr package raises its own kinds for a protocol that is not there
            continue
    return None


async def _tcp_answers(endpoint: tuple[str, int] | None, timeout: float) -> bool:
    """Whether a TCP connection to ``endpoint`` opens within ``timeout`` (None: cannot tell, counted as yes).

    Outside libp2p, so it adds nothing to libp2p's dial backoff (5 s + tries^2 s per peer).
    """
    if endpoint is None:
        return True
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*endpoint), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


async def _ping_answers(node, peer_id: PeerID, timeout: float) -> bool:
    """Whether a neighbour of the DHT answers a ping within ``timeout`` (over libp2p's connection to it)."""
    try:
        return await asyncio.wait_for(node.protocol.call_ping(peer_id), timeout) is not None
    except asyncio.TimeoutError:
        return False


def _is_another_peer(error: BaseException) -> bool:
    """Whether a libp2p dial failed because another peer than the one dialled answered at the address (the daemon's
    "peer id mismatch": a peer started again there with a new identity)."""
    return "peer id mismatch" in str(error) or "remote key matches" in str(error)


@kept_until_done
async def _check_swarm_link(
    initial_peers: Sequence[str],
    fresh_connections: bool,
    timeout: float,
    probe_link: bool,
    impostors_before: Sequence[str],
    _dht,
    node,
) -> tuple[int, bool, list[str]]:
    """In the DHT's process: tell whether the link to the swarm works, and with no peer left in the routing table,
    dial the initial peers that a TCP connection reaches and ping them (which puts them back in the table).

    :param fresh_connections: drop libp2p's connections to the initial peers and the neighbours first (after a cut
      link: a connection that lived through it can stay stalled in TCP's retransmission backoff long after the link
      is back)
    :param probe_link: check the link even while the routing table holds peers (with an empty table it is always
      checked): a TCP connection to each initial peer and a ping to a few neighbours, any answer meaning the link works
    :param impostors_before: the initial peers at whose address another peer answered at the last check: a dial that
      libp2p holds back after a failed one (its dial backoff) tells nothing new, and they stay so
    :returns: peers in the routing table afterwards, whether the link works (True when not checked), and the initial
      peers at whose address another peer answers
    """
    table = node.protocol.routing_table
    neighbours = list(table.uid_to_peer_id.values())[:3]
    if neighbours and not probe_link:
        return len(table.uid_to_peer_id), True, list(impostors_before)
    peers, impostors = [], []
    for address in initial_peers:
        try:
            maddr = Multiaddr(address)
            peer_id = PeerID.from_base58(maddr["p2p"])
            peers.append((peer_id, maddr.decapsulate(Multiaddr(f"/p2p/{maddr['p2p']}")), _tcp_endpoint(maddr)))
        except Exception:  # checked when the swarm was joined; nothing to dial here
            continue
    if fresh_connections:  # pings over a connection stalled by the cut would fail while the link works again
        for peer_id in {peer_id for peer_id, _, _ in peers} | set(neighbours):
            try:
                await asyncio.wait_for(node.p2p._client.disconnect(peer_id), timeout)
            except Exception as e:  # already gone
                logger.debug(f"could not drop the connection to {peer_id}: {e!r}")
    answers = await asyncio.gather(
        *(_tcp_answers(endpoint, timeout) for _, _, endpoint in peers),
        *(_ping_answers(node, peer_id, timeout) for peer_id in neighbours),
    )
    tcp_answers, ping_answers = list(answers[: len(peers)]), answers[len(peers) :]
    if fresh_connections or not neighbours or not any(ping_answers):
        # dial the initial peers whose port answers: it puts them back in the table, and tells the right peer answering
        # from another one that listens there now (a peer started again with a new identity), which is no link back
        for index, ((peer_id, transport, _), answered) in enumerate(zip(peers, tcp_answers)):
            if not answered:
                continue
            try:
                await asyncio.wait_for(node.p2p._client.connect(peer_id, [transport]), 2 * timeout)
                if await node.protocol.call_ping(peer_id) is None:  # libp2p's connect keeps a connection it holds
                    logger.debug(f"initial peer {peer_id} accepts TCP connections but did not answer a ping")
            except Exception as e:  # not yet: the next check tries again
                logger.debug(f"could not reach initial peer {peer_id}: {e!r}")
                address = f"{transport}/p2p/{peer_id}"
                if _is_another_peer(e) or (address in impostors_before and "dial backoff" in str(e)):
                    tcp_answers[index] = False
                    impostors.append(address)
    return len(table.uid_to_peer_id), any(tcp_answers) or any(ping_answers), impostors


class SwarmWatchdog:
    """Keeps a peer in the swarm: dials its initial peers again when its DHT knows no one, and tells when its link is
    down and when it is back.

    - an empty routing table (hivemind dropped a late neighbour): it dials the initial peers again at its next check;
    - a link down: probes (a TCP connection to each initial peer, pings to a few neighbours) unanswered for
      ``down_after`` seconds call ``on_link_down``; an initial peer that answers again calls ``on_link_back`` after
      fresh dials. An address that answers as another peer is no return of the link
      (tests/swarm/test_watchdog.py::test_another_peer_on_the_first_peers_port_is_no_link_back_and_the_same_peer_is).

    :param dht: this peer's DHT
    :param initial_peers: the addresses it joined through
    :param period: seconds between two checks
    :param timeout: seconds for each TCP connection and ping of a probe (a libp2p dial gets twice as long)
    :param probe_every: seconds between two probes of the link while all is well
    :param down_after: seconds of probes that nothing answered before the link counts as down
    :param on_link_down: called (in the watchdog's thread) when the link goes down
    :param on_link_back: called (in the watchdog's thread) when the swarm answers again after that
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        initial_peers: Sequence[str],
        period: float = 1.0,
        timeout: float = 4.0,
        probe_every: float = 5.0,
        down_after: float = 8.0,
        on_link_down: Callable[[], None] | None = None,
        on_link_back: Callable[[], None] | None = None,
    ):
        self.dht, self.initial_peers, self.period, self.timeout = dht, list(initial_peers), period, timeout
        self.probe_every, self.down_after = probe_every, down_after
        self.on_link_down, self.on_link_back = on_link_down, on_link_back
        self.rejoins = 0  # times the routing table was empty and the initial peers were dialled again with success
        self.link_outages = 0  # times the link went down
        self.link_down = threading.Event()  # set while nothing of the swarm answers
        self.link_down_since: float | None = None  # time.time() when the link went down
        self._impostors: set[str] = set()  # initial peers at whose address another peer answers now
        self._told_impostors: set[str] = set()  # those said already, once each
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="collab_kit-swarm-watchdog")
        if self.initial_peers:
            self._thread.start()

    def _run(self) -> None:
        alone_since = unanswered_since = None
        next_probe = time.monotonic() + self.probe_every
        while not self._stop.wait(self.period):
            started = time.monotonic()
            probe = self.link_down.is_set() or unanswered_since is not None or started >= next_probe
            try:
                known, reachable, impostors = self.dht.run_coroutine(
                    partial(
                        _check_swarm_link,
                        self.initial_peers,
                        self.link_down.is_set(),
                        self.timeout,
                        probe,
                        sorted(self._impostors),
                    )
                )
            except Exception as e:  # the DHT is shutting down, or busy: the next check comes as usual
                logger.debug(f"the swarm watchdog could not check the DHT: {e!r}")
                continue
            now = time.monotonic()
            if probe:
                next_probe = now + self.probe_every
            unanswered_since = None if reachable else unanswered_since or started
            if known and alone_since is not None:
                self.rejoins += 1
                logger.info(f"back in the swarm's DHT after {now - alone_since:.1f} s")
                alone_since = None
            elif not known and alone_since is None:
                alone_since = now
                logger.info("this peer's DHT lost every neighbour (a request timed out): dialling the initial peers")
            self._impostors = set(impostors)
            for address in self._impostors - self._told_impostors:
                self._told_impostors.add(address)
                logger.warning(
                    f"another peer answers at the address of initial peer {address}: the peer there was "
                    f"started again with a new identity, and this line no longer reaches the run. Its "
                    f"organizer keeps the identity by starting it with the same --db (the key file beside "
                    f"it); otherwise ask for the new join line"
                )
            if self.link_down.is_set():
                if known and reachable:
                    assert self.link_down_since is not None  # set with link_down
                    logger.warning(f"the link to the swarm is back after {time.time() - self.link_down_since:.0f} s")
                    self.link_down.clear()
                    self.link_down_since = None
                    self._call(self.on_link_back)
            elif unanswered_since is not None and now - unanswered_since >= self.down_after:
                self.link_outages += 1
                self.link_down_since = time.time()
                self.link_down.set()
                logger.warning(
                    "the link to the swarm is down: no initial peer accepts a connection and no neighbour "
                    "answers (a cut link, or the peers are gone). Waiting for it to come back"
                )
                self._call(self.on_link_down)

    @staticmethod
    def _call(callback: Callable[[], None] | None) -> None:
        if callback is None:
            return
        try:
            callback()
        except Exception as e:  # the watchdog must go on watching
            logger.warning(f"the swarm watchdog's callback failed: {type(e).__name__}: {e}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.period + 4 * self.timeout + 5)
