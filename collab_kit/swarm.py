"""Joining the swarm: the DHT every peer starts, the addresses peers give each other, reachability.

A swarm starts from one peer (the coordinator, or simply the first volunteer). It prints the
address others use to join; every later peer passes one or more such addresses as ``initial_peers``.
Peers behind a NAT or firewall join in client mode: they connect out to others but accept no
incoming connections, so they can train but never serve state to others.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import List, Optional, Sequence

import hivemind
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from collab_kit.config import SwarmConfig

logger = logging.getLogger(__name__)


class _QuietShutdownFilter(logging.Filter):
    """Hide hivemind's noise when a peer leaves, which volunteers would read as a failure.

    When the optimizer's averager processes stop, requests they left in flight make the DHT process
    log tracebacks (the sender's pipe is gone), and the DHT may need a hard stop. Both are harmless.
    """

    GONE_CLIENT = (FileNotFoundError, ConnectionResetError, ConnectionRefusedError, EOFError, BrokenPipeError)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], self.GONE_CLIENT) and record.funcName == "_run":
            return False
        if record.getMessage().startswith("DHT did not shut down within the grace period"):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


logging.getLogger("hivemind.dht.dht").addFilter(_QuietShutdownFilter())

ADDRESS_EXAMPLE = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWBmwXN3rsVfnLsZKbXeBrSLfczHxZHwVjPrbKwpLfYm3t"


class SwarmConnectionError(RuntimeError):
    """The peer could not reach any of the initial peers."""


def parse_initial_peers(initial_peers: Sequence[str] | str | None) -> List[str]:
    """Check the multiaddrs of initial peers and return them as a list of strings.

    :param initial_peers: multiaddrs, a list or one string with several separated by spaces or commas
    :raises ValueError: for an address that is not a full multiaddr, saying what one looks like
    """
    if initial_peers is None:
        return []
    if isinstance(initial_peers, str):
        initial_peers = initial_peers.replace(",", " ").split()
    checked = []
    for address in initial_peers:
        address = str(address).strip()
        if not address:
            continue
        try:
            parsed = Multiaddr(address)
        except Exception as e:  # the multiaddr package raises several exception types
            raise ValueError(
                f"initial peer {address!r} is not a valid multiaddr ({e}). A peer address looks like "
                f"{ADDRESS_EXAMPLE}: copy it from the 'To join this swarm' line that the first peer prints."
            ) from None
        protocols = [p.name for p in parsed.protocols()]
        if "p2p" not in protocols:
            raise ValueError(
                f"initial peer {address!r} has no /p2p/<peer id> part, so it cannot be authenticated. "
                f"A peer address looks like {ADDRESS_EXAMPLE}."
            )
        if not any(p in protocols for p in ("ip4", "ip6", "dns", "dns4", "dns6")):
            raise ValueError(f"initial peer {address!r} names no host (/ip4/..., /ip6/... or /dns/...). "
                             f"A peer address looks like {ADDRESS_EXAMPLE}.")
        checked.append(address)
    return checked


def start_dht(config: SwarmConfig, **dht_kwargs) -> hivemind.DHT:
    """Start this peer's DHT: a new swarm if ``config.initial_peers`` is empty, else join through them.

    :param config: where to listen, whom to contact first, client mode, relays, identity
    :param dht_kwargs: passed to hivemind.DHT (for instance ``record_validators`` or ``authorizer``)
    :raises SwarmConnectionError: if none of the initial peers could be reached
    """
    initial_peers = parse_initial_peers(config.initial_peers)
    host_maddrs = [f"/ip{'6' if ':' in config.host else '4'}/{config.host}/tcp/{config.port}"]
    try:
        dht = hivemind.DHT(
            initial_peers=initial_peers,
            host_maddrs=host_maddrs,
            announce_maddrs=list(config.announce_maddrs) or None,
            client_mode=config.client_mode,
            use_auto_relay=config.use_auto_relay,
            identity_path=config.identity_path,
            start=True,
            **dht_kwargs,
        )
    except RuntimeError as e:
        if initial_peers and "bootstrap failed" in str(e):
            # the daemon connected, but no DHT node answered: the run requires authorization, or is gone
            raise SwarmConnectionError(
                f"the initial peers ({', '.join(initial_peers)}) did not answer this peer's DHT requests: if the run "
                f"requires authorization, set swarm.auth_server (--set swarm.auth_server=URL) and your Hugging Face "
                f"token; otherwise check that the first peer is still running"
            ) from None
        raise
    except hivemind.p2p.P2PDaemonError as e:
        if initial_peers and "bootstrap" in str(e):
            raise SwarmConnectionError(
                f"could not reach any initial peer ({', '.join(initial_peers)}): check that the first peer is "
                f"still running and that its address and port are reachable from here"
            ) from e
        raise
    logger.info(f"DHT started, peer id {dht.peer_id}")
    return dht


def join_addresses(dht: hivemind.DHT) -> List[str]:
    """The multiaddrs other peers can pass as ``initial_peers`` to join through this one."""
    return [str(address) for address in dht.get_visible_maddrs()]


def join_instructions(dht: hivemind.DHT, run_id: Optional[str] = None) -> str:
    """One line that tells others how to join through this peer."""
    addresses = " ".join(join_addresses(dht))
    run = f" --run-id {run_id}" if run_id else ""
    return f"To join this swarm: collab-kit join{run} --initial-peers {addresses}"


def _presence_key(run_id: str) -> str:
    return f"{run_id}_present"


def announce_presence(dht: hivemind.DHT, run_id: str, ttl: float = 60.0) -> None:
    """Tell the swarm that this peer is about to train in ``run_id`` (the record expires after ``ttl`` s)."""
    now = get_dht_time()
    dht.store(_presence_key(run_id), subkey=dht.peer_id.to_base58(), value=now, expiration_time=now + ttl)


def count_present_peers(dht: hivemind.DHT, run_id: str) -> int:
    """How many peers announced themselves in ``run_id`` within their record's lifetime."""
    found = dht.get(_presence_key(run_id), latest=True)
    return len(found.value) if found is not None and isinstance(found.value, dict) else 0


def wait_for_peers(dht: hivemind.DHT, run_id: str, count: int, timeout: float,
                   stop: Optional[threading.Event] = None) -> int:
    """Announce this peer, then wait until ``count`` peers (this one included) have announced themselves.

    Starting together matters when steps are short: a peer alone would finish global steps by itself
    before the others arrive.

    :returns: the number of peers present
    :raises SwarmConnectionError: if fewer than ``count`` peers arrived within ``timeout`` seconds
    """
    deadline = time.monotonic() + timeout
    stop = stop or threading.Event()
    announce_presence(dht, run_id)
    while True:
        present = count_present_peers(dht, run_id)
        if present >= count:
            return present
        if time.monotonic() > deadline:
            raise SwarmConnectionError(f"only {present} of {count} peers joined run {run_id!r} within "
                                       f"{timeout:.0f} s")
        if stop.wait(0.2):
            raise KeyboardInterrupt
