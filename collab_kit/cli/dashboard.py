"""``collab-kit dashboard``: the monitor's database as one static HTML page."""

from __future__ import annotations

import argparse
import os


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``collab-kit dashboard`` to the command line."""
    board = commands.add_parser(
        "dashboard",
        help="the monitor's database as one static HTML page: loss, peers, throughput, leaderboard",
        description="Draw what `collab-kit monitor --db PATH` recorded (loss, alive peers, throughput, the "
        "contributors' leaderboard, checkpoints) into one HTML file with its plots embedded: no "
        "JavaScript, no other file. Safe to run while the monitor writes the database; run it again "
        "(by hand or from cron) to refresh the page.",
    )
    board.add_argument(
        "--db",
        metavar="PATH",
        help="the monitor's database (default: monitor/run.sqlite, else make demo's demo_out/monitor.sqlite)",
    )
    board.add_argument("--out", metavar="FILE.html", help="the page to write (default: dashboard.html beside --db)")
    board.add_argument("--title", default="collab_kit run", help="the page's heading (default: collab_kit run)")
    board.add_argument(
        "--loss-x", choices=("time", "epoch"), default="time", help="the loss curve's x axis (default: time)"
    )
    board.add_argument(
        "--max-contributors", type=int, default=200, metavar="N", help="leaderboard rows shown (default: 200)"
    )
    board.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # lazy: the libraries the command needs (torch, hivemind) load when it runs: `collab-kit --help` answers at once
    from collab_kit.widgets.dashboard import load, write_page

    data = load(args.db)  # a missing file: an error that says how to get one (collab-kit monitor --db)
    out = args.out or os.path.join(os.path.dirname(data.db_path), "dashboard.html")
    write_page(data, out, title=args.title, loss_x=args.loss_x, max_contributors=args.max_contributors)
    print(f"dashboard: {data.summary()}", flush=True)
    print(f"dashboard written to {out}", flush=True)
    return 0
