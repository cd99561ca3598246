"""``collab-kit auth-server``: let the members of a Hugging Face organization join a run."""

from __future__ import annotations

import argparse
import datetime
import math

from collab_kit.cli.common import CommandError
from collab_kit.roles.processes import emit_event


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``collab-kit auth-server`` to the command line."""
    auth = commands.add_parser(
        "auth-server",
        help="let the members of a Hugging Face organization join a run (signs access tokens)",
        description="The run's authentication server: a volunteer's peer sends its Hugging Face user token once, "
        "the server asks the Hub who it belongs to and, for a member of the organization (or a user "
        "on the allowlist), signs an access token for the peer's key. It listens on 127.0.0.1 by "
        "default: put it behind an HTTPS reverse proxy, since tokens travel in the requests.",
    )
    auth.add_argument("--organization", metavar="ORG", help="the Hugging Face organization whose members may join")
    auth.add_argument(
        "--allow", action="append", metavar="USER", help="a user who may join without being a member (repeatable)"
    )
    auth.add_argument(
        "--db",
        default="auth_server.sqlite3",
        metavar="PATH",
        help="SQLite file of joins and per-user stats (default: auth_server.sqlite3)",
    )
    auth.add_argument(
        "--key",
        metavar="PATH",
        help="the server's RSA key, made the first time and kept: tokens stay "
        "valid across restarts (default: beside --db, NAME_key.der)",
    )
    auth.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, for an HTTPS reverse proxy on this machine; "
        "0.0.0.0 to be reached directly, unencrypted)",
    )
    auth.add_argument("--port", type=int, default=8555, help="port to listen on (default: 8555; 0 for any free one)")
    auth.add_argument(
        "--coordinator",
        action="append",
        metavar="MULTIADDR",
        help="an address of the run's first peer, sent to volunteers to join through (repeatable)",
    )
    auth.add_argument("--run-id", help="the run's id, sent to volunteers (default: collab_kit)")
    auth.add_argument(
        "--token-lifetime",
        type=float,
        default=60.0,
        metavar="MINUTES",
        help="how long an access token is valid (default: 60)",
    )
    auth.add_argument(
        "--rate-limit", type=int, default=10, metavar="N", help="joins one user may make per minute (default: 10)"
    )
    auth.add_argument(
        "--hub-endpoint",
        metavar="URL",
        help="the Hugging Face Hub that checks tokens (default: $HF_ENDPOINT or https://huggingface.co)",
    )
    auth.add_argument(
        "--request-deadline",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds a client has to send a whole request; slower ones are answered 408 and closed (default: 10)",
    )
    auth.add_argument(
        "--connections-per-client",
        type=int,
        default=32,
        metavar="N",
        help="connections one client address may hold open at once, 0 for no cap (default: 32); "
        "behind a reverse proxy, every connection comes from the proxy",
    )
    auth.add_argument("--events", action="store_true", help=argparse.SUPPRESS)  # machine-readable lines
    auth.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # lazy: the libraries the command needs (torch, hivemind) load when it runs: `collab-kit --help` answers at once
    from collab_kit.auth.server import serve
    from collab_kit.auth.server_settings import AuthServerSettings

    if not (args.token_lifetime > 0 and math.isfinite(args.token_lifetime)):
        raise CommandError(f"--token-lifetime {args.token_lifetime:g}: expected a positive number of minutes")
    options = dict(
        organization=args.organization,
        allowlist=args.allow or (),
        database_path=args.db,
        key_path=args.key,
        token_lifetime=datetime.timedelta(minutes=args.token_lifetime),
        joins_per_minute=args.rate_limit,
        coordinator_addresses=args.coordinator or (),
        request_deadline=args.request_deadline,
        connections_per_client=args.connections_per_client,
    )
    if args.run_id is not None:
        options["run_id"] = args.run_id
    if args.hub_endpoint is not None:
        options["hub_endpoint"] = args.hub_endpoint
    settings = AuthServerSettings(**options)

    def announce(line: str):  # a script waiting for the server (collab_kit.roles.services) reads its URL from "ready"
        print(line, flush=True)
        emit_event("ready", url=line.rsplit(" ", 1)[-1])  # the line ends "listening on http://HOST:PORT"

    on_listening = announce if args.events else None
    try:
        serve(settings, host=args.host, port=args.port, on_listening=on_listening)
    except KeyboardInterrupt:  # uvicorn has shut down cleanly and passes the signal on
        pass
    print("auth server stopped", flush=True)
    return 0
