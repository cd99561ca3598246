"""What the commands share: the run configuration from the command line, the swarm options, clean stops, and the
error a user can fix."""

from __future__ import annotations

import argparse
import logging
import os
import signal

from collab_kit.addresses import parse_initial_peers
from collab_kit.config import PRESETS, get_preset, parse_overrides
from collab_kit.errors import CollabKitError

logger = logging.getLogger(__name__)


class CommandError(CollabKitError):
    """A problem the user can fix; printed as one line, without a traceback."""


def build_config(args: argparse.Namespace):
    """The run configuration from --preset, the swarm options and --set overrides."""
    overrides = parse_overrides(getattr(args, "set", None) or [])
    swarm = overrides.setdefault("swarm", {})
    if getattr(args, "initial_peers", None):
        swarm["initial_peers"] = parse_initial_peers(args.initial_peers)
    for option in ("run_id", "host", "port"):
        if getattr(args, option, None) is not None:
            swarm[option] = getattr(args, option)
    if getattr(args, "client_mode", None) is not None:
        swarm["client_mode"] = args.client_mode
    if getattr(args, "data", None):
        overrides.setdefault("data", {})["shards"] = args.data
    return get_preset(args.preset, **overrides)


def add_swarm_options(parser: argparse.ArgumentParser):
    parser.add_argument("--preset", choices=PRESETS, default="small", help="configuration preset (default: small)")
    parser.add_argument("--run-id", help="peers with the same run id train together")
    parser.add_argument(
        "--initial-peers",
        nargs="+",
        metavar="MULTIADDR",
        help="addresses of peers already in the swarm (printed by the first peer)",
    )
    parser.add_argument(
        "--host",
        help="address to listen on (default: every interface, or 127.0.0.1 when every "
        "initial peer is on this machine; 127.0.0.1 keeps the peer on this machine)",
    )
    parser.add_argument("--port", type=int, help="port to listen on (default: any free port)")
    parser.add_argument(
        "--set",
        action="append",
        metavar="SECTION.FIELD=VALUE",
        help="change one configuration field, e.g. --set optimizer.target_batch_size=64",
    )
    parser.add_argument("--events", action="store_true", help=argparse.SUPPRESS)  # machine-readable lines


def handle_stop_signals(request_stop=None):
    """Ctrl-C and SIGTERM (from a process manager, or the demo) stop a peer cleanly.

    With ``request_stop``, the first signal asks training to stop after the current step (a flag,
    not an exception, which hivemind's own error handling could swallow) and a second one forces the
    exit; without, a signal raises KeyboardInterrupt. hivemind forks helper processes (the DHT) that
    inherit these handlers; in them the signal keeps its default meaning, since hivemind uses it to
    end them.
    """
    main_pid = os.getpid()
    received = []

    def handler(signum, frame):
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        received.append(signum)
        if request_stop is None or len(received) > 1:
            raise KeyboardInterrupt
        logger.warning("stopping after the current step (press Ctrl-C again to force)")
        request_stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
