"""Peer addresses as people paste them: the multiaddrs of a swarm's initial peers, checked with a clear error.

A join line carries one or more full multiaddrs (``/ip4/HOST/tcp/PORT/p2p/PEER_ID``); settings files, notebook
cells and ``--initial-peers`` take them as a list or as one string separated by spaces or commas. The checks here
are those every entry point shares; the DHT that dials them is ``collab_kit.swarm.dht``.
"""

from __future__ import annotations

from collections.abc import Sequence

from collab_kit.errors import CollabKitError


class BadPeerAddress(CollabKitError, ValueError):
    """An initial peer's address is not a full multiaddr; the message shows what one looks like."""


ADDRESS_EXAMPLE = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWBmwXN3rsVfnLsZKbXeBrSLfczHxZHwVjPrbKwpLfYm3t"


def parse_initial_peers(initial_peers: Sequence[str] | str | None) -> list[str]:
    """Check the multiaddrs of initial peers and return them as a list of strings.

    :param initial_peers: multiaddrs, a list or one string with several separated by spaces or commas
    :raises BadPeerAddress: for an address that is not a full multiaddr, saying what one looks like
    """
    if not initial_peers:
        return []
    # lazy: the parser is hivemind's, and importing hivemind takes seconds: a preset names no peers to check, and
    # `collab-kit --help` parses none
    from hivemind.utils.multiaddr import Multiaddr

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
            raise BadPeerAddress(
                f"initial peer {address!r} is not a valid multiaddr ({e}). A peer address looks like "
                f"{ADDRESS_EXAMPLE}: copy it from the 'To join this swarm' line that the first peer prints."
            ) from None
        protocols = [p.name for p in parsed.protocols()]
        if "p2p" not in protocols:
            raise BadPeerAddress(
                f"initial peer {address!r} has no /p2p/<peer id> part, so it cannot be authenticated. "
                f"A peer address looks like {ADDRESS_EXAMPLE}."
            )
        if not any(p in protocols for p in ("ip4", "ip6", "dns", "dns4", "dns6")):
            raise BadPeerAddress(
                f"initial peer {address!r} names no host (/ip4/..., /ip6/... or /dns/...). "
                f"A peer address looks like {ADDRESS_EXAMPLE}."
            )
        checked.append(address)
    return checked


LOOPBACK_HOSTS = ("127.", "::1", "localhost")


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an IP address or a name) is this machine's loopback: 127.0.0.0/8, ::1 or localhost."""
    return str(host).startswith(LOOPBACK_HOSTS)


def host_of(address: str) -> str:
    """The host part of a multiaddr (``/ip4/10.1.2.3/tcp/...`` -> ``10.1.2.3``), '' when it names none."""
    parts = str(address).strip("/").split("/")
    return parts[1] if len(parts) >= 2 and parts[0] in ("ip4", "ip6", "dns", "dns4", "dns6") else ""


def all_on_this_machine(addresses: Sequence[str]) -> bool:
    """Whether every one of ``addresses`` (at least one) is on this machine's loopback: a swarm that stays here."""
    return bool(addresses) and all(is_loopback_host(host_of(address)) for address in addresses)
