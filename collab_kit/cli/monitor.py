"""``collab-kit monitor``: the swarm's first peer: run history, leaderboard, checkpoints, the anchor."""

from __future__ import annotations

import argparse
import os

from collab_kit.cli.common import add_swarm_options, build_config
from collab_kit.roles.processes import emit_event


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``collab-kit monitor`` to the command line."""
    monitor = commands.add_parser(
        "monitor",
        help="the swarm's first peer: watches the run, keeps its history and leaderboard, saves checkpoints",
        description="Start the swarm's first peer (volunteers join through it). It trains nothing: it polls the "
        "training peers' metrics in the DHT, stores the loss, alive peers, throughput and the "
        "contributors' leaderboard in SQLite (--db, what `collab-kit dashboard` draws), and every "
        "--checkpoint-every global epochs downloads the swarm's state from a peer and saves it as "
        "CHECKPOINTS/epoch-NNNNNN (the newest --keep are kept; --push-to also uploads them). Started "
        "again with the same command, it goes on where it was: the same peer id (its key beside --db) "
        "and port, so every join line it printed still works, and its anchor takes the newest state of "
        "the swarm (pass --initial-peers of a volunteer to rejoin a swarm of public peers that went on "
        "without it).",
    )
    add_swarm_options(monitor)
    monitor.add_argument(
        "--data",
        metavar="SHARDS",
        help="the run's data: a Hub dataset id (user/name), a folder or glob of parquet shards, or "
        "'synthetic'; published with the run's settings and carried by its join line, so "
        "volunteers who name none stream it",
    )
    monitor.add_argument("--address-file", help="also write the join addresses to this file")
    monitor.add_argument(
        "--anchor",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the swarm's anchor here, the peer that volunteers behind NAT average through and "
        "load the state from (default: when others can dial this monitor)",
    )
    monitor.add_argument(
        "--poll-every",
        dest="poll_every",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds between two readings of the swarm (default: 10)",
    )
    monitor.add_argument(
        "--db",
        default=os.path.join("monitor", "run.sqlite"),
        metavar="PATH",
        help="SQLite file of the run's history and leaderboard, continued if it exists; the "
        "monitor's key (run.key) and port (run.port) are kept beside it "
        "(default: monitor/run.sqlite; '' for none)",
    )
    monitor.add_argument(
        "--checkpoints",
        default=os.path.join("monitor", "checkpoints"),
        metavar="FOLDER",
        help="where checkpoints go, one folder per global epoch (default: monitor/checkpoints)",
    )
    monitor.add_argument(
        "--checkpoint-every",
        type=int,
        default=10,
        metavar="K",
        help="save the swarm's state every K global epochs (default: 10; 0: never)",
    )
    monitor.add_argument("--keep", type=int, default=3, metavar="N", help="checkpoints to keep (default: 3)")
    monitor.add_argument(
        "--push-to",
        metavar="REPO",
        help="also upload each checkpoint to this Hugging Face model repository (user/name)",
    )
    monitor.add_argument(
        "--wandb-project",
        default=os.environ.get("WANDB_PROJECT") or None,
        metavar="NAME",
        help="also log each poll to Weights & Biases (needs `pip install wandb`; default: $WANDB_PROJECT)",
    )
    monitor.add_argument(
        "--backoff",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="wait before retrying a failed state download, doubled each time (default: 5)",
    )
    monitor.add_argument(
        "--backoff-max",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="the longest wait between two retries (default: 300)",
    )
    monitor.add_argument(
        "--download-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="give up one state download after this long (default: 300)",
    )
    monitor.add_argument(
        "--dashboard-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the run's live page (loss, peers, leaderboard, checkpoints, the join line) and "
        "its JSON API (/api/status, /api/series) on this port while it monitors (0: any free "
        "one; the monitor prints the link)",
    )
    monitor.add_argument(
        "--dashboard-host",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="the address the live page listens on (default: 127.0.0.1, this machine only; "
        "0.0.0.0 publishes it on every interface)",
    )
    monitor.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # lazy: the libraries the command needs (torch, hivemind) load when it runs: `collab-kit --help` answers at once
    from collab_kit.roles.monitor import Monitor
    from collab_kit.roles.monitor_settings import MonitorSettings

    config = build_config(args)
    settings = MonitorSettings(
        db_path=args.db or None,
        checkpoint_dir=args.checkpoints,
        checkpoint_every=args.checkpoint_every,
        keep_last=args.keep,
        push_to=args.push_to,
        poll_every=args.poll_every,
        wandb_project=args.wandb_project,
        backoff_initial=args.backoff,
        backoff_max=args.backoff_max,
        download_timeout=args.download_timeout,
        address_file=args.address_file,
        anchor=args.anchor,
        dashboard_port=args.dashboard_port,
        dashboard_host=args.dashboard_host,
    )
    # a refused token, a swarm out of reach, a database of another run: CollabKitErrors, one line from main()
    monitor = Monitor(config, settings, on_event=emit_event if args.events else None)
    with monitor:
        monitor.run()
    return 0
