"""``collab-kit reachability``: ask a swarm's peers whether they can dial this machine."""

from __future__ import annotations

import argparse

from collab_kit.addresses import parse_initial_peers
from collab_kit.roles.processes import emit_event


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``collab-kit reachability`` to the command line."""
    reach = commands.add_parser(
        "reachability",
        help="ask a swarm's peers whether they can dial this machine (what `join` decides client mode from)",
        description="Start a temporary libp2p host on PORT and ask the initial peers to connect back to it: behind NAT "
        "or a firewall that drops incoming connections they cannot, with a public address or a forwarded "
        "port they can.",
    )
    reach.add_argument(
        "--initial-peers",
        nargs="+",
        metavar="MULTIADDR",
        required=True,
        help="addresses of peers already in the swarm (they do the check)",
    )
    reach.add_argument("--host", default="0.0.0.0", help="the address to listen on (default: 0.0.0.0)")
    reach.add_argument("--port", type=int, help="the port to check (default: any free one)")
    reach.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long each peer may take to answer (default: 10)",
    )
    reach.add_argument("--events", action="store_true", help=argparse.SUPPRESS)
    reach.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # lazy: the libraries the command needs (torch, hivemind) load when it runs: `collab-kit --help` answers at once
    from collab_kit.swarm.reachability import probe_reachability

    initial_peers = parse_initial_peers(args.initial_peers)
    verdict = probe_reachability(initial_peers, host=args.host, port=args.port or 0, timeout=args.timeout)
    print(f"reachability: {verdict.explain()}", flush=True)
    if verdict.reachable is None:
        advice = "the swarm could not tell: check that the initial peers are running this kit"
    elif verdict.reachable:
        advice = f"others can join through this machine at {', '.join(verdict.public_addresses)} port {verdict.port}"
    else:
        advice = (
            "`collab-kit join` will train in client mode here, through the run's anchor (a peer that accepts "
            "connections: `collab-kit monitor` on a public host runs one)"
        )
    print(advice, flush=True)
    if args.events:
        emit_event(
            "reachability",
            reachable=verdict.reachable,
            port=verdict.port,
            public_addresses=list(verdict.public_addresses),
            answers=[
                dict(helper=a.helper, observed=a.observed_address, results=a.results, problem=a.problem)
                for a in verdict.answers
            ],
        )
    return 0
