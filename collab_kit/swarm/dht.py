"""Joining the swarm: the DHT every peer starts, the addresses peers give each other, reachability.

A swarm starts from one peer; every later peer passes its address as ``initial_peers``. Whether a peer accepts
connections is found out, not configured: its initial peers try to dial it back (collab_kit.swarm.reachability),
and if they cannot it joins in client mode.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import shlex
import socket
import threading
import time
from collections.abc import Sequence

import hivemind
import psutil
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from collab_kit.addresses import all_on_this_machine, is_loopback_host, parse_initial_peers
from collab_kit.config import RunConfig, SwarmConfig, shared_setting_options
from collab_kit.errors import CollabKitError
from collab_kit.swarm.keys import presence_key
from collab_kit.swarm.p2p_fixes import install_p2p_fixes
from collab_kit.swarm.reachability import ReachabilityVerdict, probe_reachability, serve_reachability_checks

logger = logging.getLogger(__name__)

# Seconds a peer in client mode waits for each DHT answer (hivemind's wait_timeout, 3 s): hivemind drops a late
# neighbour, and on a thin link a DHT answer queues behind a state download (docs/known-hivemind-behaviours.md).
CLIENT_DHT_REQUEST_TIMEOUT = 20.0


class _QuietShutdownFilter(logging.Filter):
    """Hide hivemind's noise when a peer leaves, which volunteers would read as a failure.

    Averagers that stop leave requests in flight: tracebacks and a hard stop, both harmless.
    """

    GONE_CLIENT = (FileNotFoundError, ConnectionResetError, ConnectionRefusedError, EOFError, BrokenPipeError)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], self.GONE_CLIENT) and record.funcName == "_run":
            return False
        if record.getMessage().startswith("DHT did not shut down within the grace period"):
            # shown only where debug logs are asked for (the level is checked before filters)
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


class _OneLinePerFailedRoundFilter(logging.Filter):
    """An averaging round that fails is one line in the log, not a traceback.

    The kit reports failed rounds itself (tests/swarm/test_swarm.py::test_a_failed_averaging_round_is_one_log_line).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and record.levelno >= logging.ERROR:
            error = record.exc_info[1]
            message = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
            record.msg, record.args = f"averaging round failed: {message}", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_filters_installed = False


def install_log_filters() -> None:
    """Quiet hivemind's logs of a peer leaving and of failed averaging rounds (idempotent; start_dht calls it)."""
    global _filters_installed
    if _filters_installed:
        return
    logging.getLogger("hivemind.dht.dht").addFilter(_QuietShutdownFilter())
    for name in ("hivemind.averaging.averager", "hivemind.averaging.allreduce"):
        logging.getLogger(name).addFilter(_OneLinePerFailedRoundFilter())
    _filters_installed = True


class SwarmConnectionError(CollabKitError, RuntimeError):
    """The peer could not reach any of the initial peers."""


def _has_public_interface_address() -> bool:

    return any(
        entry.family == socket.AF_INET and ipaddress.ip_address(entry.address).is_global
        for entries in psutil.net_if_addrs().values()
        for entry in entries
    )


def resolve_reachability(config: SwarmConfig, timeout: float = 10.0) -> tuple[SwarmConfig, ReachabilityVerdict | None]:
    """Decide where ``config``'s peer listens and, unless set, its client mode: ask the initial peers to dial back.

    - the host: ``config.listen_host`` (every interface unless the whole swarm is on this machine);
    - ``client_mode`` already True or False, or no initial peers (the swarm's first peer), or a swarm whose every
      initial peer is on this machine's loopback: no question asked;
    - a peer made to listen on loopback while its initial peers are elsewhere: nobody there can dial it, so it is in
      client mode (and never announces a loopback address);
    - otherwise the probe's verdict decides; a peer the helpers reached announces the address they saw (a port
      forwarded by a router is then what others dial); when no helper could tell (peers of another kit, say), an
      interface address that is routable on the Internet means accepting connections, anything else client mode.

    Shown by tests/swarm/test_swarm.py::test_where_a_peer_listens_and_whether_it_is_asked_to_be_dialled_back.

    :returns: the configuration with ``host``, ``client_mode`` (and the probed ``port``, and announced addresses) set,
      and the verdict (None when nothing was asked)
    """
    host = config.listen_host
    config = dataclasses.replace(config, host=host)
    if config.client_mode is not None:
        return config, None
    if not config.initial_peers or all_on_this_machine(config.initial_peers):
        return dataclasses.replace(config, client_mode=False), None
    if is_loopback_host(host):
        logger.warning(
            f"this peer listens on {host} only and its initial peers are on other machines, which "
            f"cannot dial it: it joins in client mode (leave --host out to listen where they can)"
        )
        return dataclasses.replace(config, client_mode=True), None
    verdict = probe_reachability(
        config.initial_peers,
        host,
        config.port,
        timeout=timeout,
        extra_ports=[port for port in map(_port_of, config.announce_maddrs) if port],
    )
    if verdict.reachable is None:
        client_mode = not _has_public_interface_address()
        how = (
            "in client mode (no address of this machine is routable on the Internet)"
            if client_mode
            else "as a peer that accepts connections (this machine has an address routable on the Internet)"
        )
        logger.warning(f"{verdict.explain()}: joining {how}")
    else:
        client_mode = not verdict.reachable
    announce = tuple(config.announce_maddrs)
    if not client_mode and not announce:
        announce = tuple(
            f"/ip4/{address}/tcp/{verdict.port}" for address in verdict.public_addresses if ":" not in address
        )
    return dataclasses.replace(config, client_mode=client_mode, port=verdict.port, announce_maddrs=announce), verdict


def _port_of(maddr: str) -> int | None:
    parts = str(maddr).strip("/").split("/")
    return int(parts[3]) if len(parts) >= 4 and parts[2] == "tcp" and parts[3].isdigit() else None


def start_dht(config: SwarmConfig, **dht_kwargs) -> hivemind.DHT:
    """Start this peer's DHT: a new swarm if ``config.initial_peers`` is empty, else join through them.

    A ``config`` whose ``client_mode`` is None is resolved first (``resolve_reachability``). A peer that accepts
    connections answers other peers' reachability checks.

    :param config: where to listen, whom to contact first, client mode, relays, identity
    :param dht_kwargs: passed to hivemind.DHT (for instance ``record_validators`` or ``authorizer``)
    :raises SwarmConnectionError: if none of the initial peers could be reached
    """
    install_log_filters()  # before the DHT's process forks, so that it (and the averagers') inherit them
    install_p2p_fixes()  # likewise: every p2p client of the peer's processes keeps reading answers
    config, _ = resolve_reachability(config)
    initial_peers = parse_initial_peers(config.initial_peers)
    if config.client_mode:
        dht_kwargs.setdefault("wait_timeout", CLIENT_DHT_REQUEST_TIMEOUT)
    host = config.listen_host  # config.host, set by resolve_reachability
    host_maddrs = [f"/ip{'6' if ':' in host else '4'}/{host}/tcp/{config.port}"]
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
        if "is already taken" in str(e):
            raise SwarmConnectionError(
                f"a peer of the swarm runs with this peer's identity ({config.identity_path}) now: is the same monitor "
                f"(or peer) already running? Stop it, or give this one a database of its own (--db: a monitor keeps "
                f"its key beside it) or a key of its own (--set swarm.identity_path=FILE)"
            ) from None
        if initial_peers and "bootstrap" in str(e):
            raise SwarmConnectionError(
                f"could not reach any initial peer ({', '.join(initial_peers)}): check that the first peer is "
                f"still running and that its address and port are reachable from here"
            ) from e
        raise
    if not config.client_mode:
        try:
            serve_reachability_checks(dht)
        except BaseException:
            dht.shutdown()
            raise
    logger.info(f"DHT started, peer id {dht.peer_id}")
    return dht


def initial_peer_ids(addresses: Sequence[str]) -> list[PeerID]:
    """The peer ids of full multiaddrs (``.../p2p/<peer id>``), each once, in order."""
    peer_ids = []
    for address in parse_initial_peers(addresses):
        peer_id = PeerID.from_base58(address.rstrip("/").rsplit("/p2p/", 1)[1].split("/", 1)[0])
        if peer_id not in peer_ids:
            peer_ids.append(peer_id)
    return peer_ids


def join_addresses(dht: hivemind.DHT) -> list[str]:
    """The multiaddrs other peers can pass as ``initial_peers`` to join through this one.

    None for a peer in client mode (nobody can dial it); loopback addresses only when the peer has no other (a run
    that stays on this machine).
    """
    if dht.client_mode:
        return []
    addresses = [str(address) for address in dht.get_visible_maddrs()]
    others = [address for address in addresses if not address.startswith(("/ip4/127.", "/ip6/::1/"))]
    return others or addresses


def join_command(config: RunConfig, addresses: Sequence[str], data: str | None = None) -> str:
    """The command that joins ``config``'s run through ``addresses``: run id, preset, every shared setting that differs
    from the preset, the run's data (``data``: what its card names), the auth server (with a placeholder for the
    volunteer's token)."""
    options = [*shared_setting_options(config), *(["--data", shlex.quote(data)] if data else [])]
    command = " ".join(["collab-kit", "join", *options, "--initial-peers", *addresses])
    return f"HF_TOKEN=hf_... {command}" if config.swarm.auth_server else command


def join_instructions(
    dht: hivemind.DHT, config: RunConfig, data: str | None = None, other_anchors: Sequence[str] = ()
) -> str:
    """One line that tells others how to join ``config``'s run (on ``data``, the run's data): through this peer (and
    ``other_anchors``, the addresses of the run's other anchors), or, when nobody can dial it, through its initial
    peers (the addresses it joined through)."""
    addresses = join_addresses(dht)
    if addresses:
        addresses += [address for address in other_anchors if address not in addresses]
    if addresses:
        return f"To join this swarm: {join_command(config, addresses, data)}"
    through = list(config.swarm.initial_peers) or ["ADDRESS-OF-A-PEER-THAT-ACCEPTS-CONNECTIONS"]
    return (
        f"This peer accepts no connections (others could not dial it back: behind NAT or a firewall), so nobody "
        f"can join through it. To join this swarm: {join_command(config, through, data)}"
    )


def announce_presence(dht: hivemind.DHT, run_id: str, ttl: float = 60.0) -> None:
    """Tell the swarm that this peer is about to train in ``run_id`` (the record expires after ``ttl`` s)."""
    now = get_dht_time()
    dht.store(presence_key(run_id), subkey=dht.peer_id.to_base58(), value=now, expiration_time=now + ttl)


def count_present_peers(dht: hivemind.DHT, run_id: str) -> int:
    """How many peers announced themselves in ``run_id`` within their record's lifetime."""
    found = dht.get(presence_key(run_id), latest=True)
    return len(found.value) if found is not None and isinstance(found.value, dict) else 0


def wait_for_peers(
    dht: hivemind.DHT, run_id: str, count: int, timeout: float, stop: threading.Event | None = None
) -> int:
    """Announce this peer, then wait until ``count`` peers (this one included) have announced themselves.

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
            raise SwarmConnectionError(f"only {present} of {count} peers joined run {run_id!r} within {timeout:.0f} s")
        if stop.wait(0.2):
            raise KeyboardInterrupt
