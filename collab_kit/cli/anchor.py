"""``collab-kit anchor``: one more public peer that volunteers behind NAT average through, beside the monitor's."""

from __future__ import annotations

import argparse
import os

from collab_kit.cli.common import CommandError, add_swarm_options, build_config
from collab_kit.roles.processes import emit_event


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``collab-kit anchor`` to the command line."""
    anchor = commands.add_parser(
        "anchor",
        help="a second public machine for a run: volunteers behind NAT average through it too",
        description="Join a run as an anchor only: a peer on a machine others can dial that trains nothing, reduces "
        "its share of every round of the volunteers behind NAT (each round's parts split among the "
        "anchors, as hivemind splits them among the peers that accept connections), and serves the "
        "swarm's state to late joiners. The run goes on through it when the monitor's machine dies. "
        "Give it the run's join line options (--preset, --run-id, --set, --initial-peers); it keeps "
        "its peer id and port in --keep-in across restarts.",
    )
    add_swarm_options(anchor)
    anchor.add_argument("--data", metavar="SHARDS", help=argparse.SUPPRESS)  # on the join line; an anchor reads none
    anchor.add_argument(
        "--keep-in",
        default="anchor",
        metavar="FOLDER",
        help="where the anchor keeps its key, its port and a history of the run (default: anchor)",
    )
    anchor.add_argument(
        "--poll-every",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds between two readings of the swarm (default: 10)",
    )
    anchor.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # lazy: the libraries the command needs (torch, hivemind) load when it runs: `collab-kit --help` answers at once
    from collab_kit.roles.monitor import Monitor
    from collab_kit.roles.monitor_settings import MonitorSettings

    if not args.initial_peers:
        raise CommandError(
            "an anchor joins a run: give --initial-peers with the addresses of its join line (start "
            "the run itself with `collab-kit monitor`)"
        )
    args.data = None  # the run's card names the data; an anchor trains on none
    config = build_config(args)
    settings = MonitorSettings(
        db_path=os.path.join(args.keep_in, "run.sqlite"), checkpoint_every=0, anchor=True, poll_every=args.poll_every
    )
    with Monitor(config, settings, on_event=emit_event if args.events else None) as monitor:
        monitor.run()
    return 0
