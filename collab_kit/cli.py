"""``collab-kit``: the command line of the kit.

    collab-kit demo                         a local collaborative run (what `make demo` runs)
    collab-kit join --initial-peers ADDR    train with a swarm as a volunteer
    collab-kit monitor                      the swarm's first peer: run history, leaderboard, checkpoints
    collab-kit dashboard --db PATH --out FILE.html
                                            the monitor's database as a static page: plots and leaderboard
    collab-kit auth-server --organization ORG
                                            let the members of a Hugging Face organization join a run
    collab-kit model-info --preset paper    the model's shape and parameter counts (no memory needed)
    collab-kit preprocess SOURCE --vqgan LOCATION --output FOLDER
                                            images + captions -> filters -> VQGAN codes -> parquet shards (-> Hub)
    collab-kit toy train-vqgan | train-clip | make-dataset
                                            the toy world's tokenizer, ranker and dataset
"""
from __future__ import annotations

import argparse
import ast
import logging
import os
import signal
import sys
from typing import Dict, List, Optional, Sequence

from collab_kit.config import PRESETS

logger = logging.getLogger(__name__)


# collab_kit.preprocess.SOURCE_FORMATS, spelled out: importing that module loads torch, which every
# `collab-kit --help` would then wait for
PREPROCESS_SOURCE_FORMATS = ("folder", "webdataset", "parquet", "disk", "hub")


class CommandError(Exception):
    """A problem the user can fix; printed as one line, without a traceback."""


def parse_overrides(assignments: Sequence[str]) -> Dict[str, dict]:
    """Turn ``["optimizer.target_batch_size=64", ...]`` into ``{"optimizer": {"target_batch_size": 64}}``."""
    overrides: Dict[str, dict] = {}
    for assignment in assignments:
        key, sep, raw_value = assignment.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or not name:
            raise CommandError(f"--set {assignment!r}: expected SECTION.FIELD=VALUE, "
                               f"for example --set optimizer.target_batch_size=64")
        try:
            value = ast.literal_eval(raw_value)
        except (ValueError, SyntaxError):
            value = raw_value  # a plain string
        overrides.setdefault(section, {})[name] = value
    return overrides


def build_config(args: argparse.Namespace):
    """The run configuration from --preset, the swarm options and --set overrides."""
    from collab_kit.config import get_preset
    from collab_kit.swarm import parse_initial_peers

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


# ---------------------------------------------------------------------------------------------
# commands


def command_demo(args: argparse.Namespace) -> int:
    from collab_kit.demo import DemoFailed, run_demo

    try:
        result = run_demo(num_volunteers=args.peers, epochs=args.epochs, preset=args.preset, workdir=args.workdir,
                          timeout=args.timeout, num_samples=args.samples,
                          output_dir=None if args.output == "" else args.output, overrides=args.set or ())
    except DemoFailed as e:
        print(f"demo failed: {e}", file=sys.stderr, flush=True)
        return 1
    print(result.summary_line(), flush=True)
    return 0


def command_join(args: argparse.Namespace) -> int:
    from collab_kit.local_swarm import emit_event
    from collab_kit.swarm import SwarmConnectionError, join_addresses
    from collab_kit.volunteer import NonFiniteTrainingError, Volunteer

    config = build_config(args)
    if args.epochs is None and args.max_epochs is None and args.max_steps is None:
        args.max_epochs = config.optimizer.total_steps
    from collab_kit.auth import AuthorizationError

    try:
        volunteer = Volunteer(config, num_threads=args.threads, verbose=args.verbose)
    except (SwarmConnectionError, AuthorizationError) as e:
        raise CommandError(str(e)) from None
    with volunteer:
        _handle_stop_signals(volunteer.request_stop)
        if volunteer.reachability is not None:
            print(f"reachability: {volunteer.reachability.explain()}", flush=True)
        print(volunteer.join_line, flush=True)
        if args.events:
            emit_event("ready", peer_id=str(volunteer.dht.peer_id), addresses=join_addresses(volunteer.dht))
        on_epoch = (lambda record: emit_event("epoch", **record.to_dict())) if args.events else None
        on_restore = (lambda record: emit_event("restore", **record.to_dict())) if args.events else None
        on_lone = (lambda warning: emit_event("lone", **warning.to_dict())) if args.events else None
        on_link = (lambda state: emit_event("link", state=state, epoch=volunteer.local_epoch)) if args.events else None
        if args.events:  # the moment a gradient all-reduce is under way (tests kill peers in the middle of one)
            def on_averaging_start(epoch: int, stage: str):
                emit_event("averaging", epoch=epoch, stage=stage)
            volunteer.optimizer.on_averaging_start = on_averaging_start
        try:
            history = volunteer.train(epochs=args.epochs, max_epochs=args.max_epochs, max_steps=args.max_steps,
                                      progress=not args.no_progress, on_epoch=on_epoch,
                                      wait_for_peers=args.wait_for_peers, on_restore=on_restore, on_lone=on_lone,
                                      on_link=on_link)
        except NonFiniteTrainingError as e:
            raise CommandError(str(e)) from None
        if args.save_params:
            import torch

            torch.save(volunteer.parameters_snapshot(), args.save_params)
        if args.save_checkpoint:
            volunteer.save_checkpoint(args.save_checkpoint)
        if args.events:
            emit_event("done", start_epoch=history.start_epoch, final_epoch=history.final_epoch,
                       local_steps=history.local_steps, averaged_rounds=history.averaged_rounds,
                       interrupted=history.interrupted, skipped_steps=history.skipped_steps,
                       link_outages=history.link_outages)
    print(f"join: {history.summary()}", flush=True)
    return 130 if history.interrupted else 0


def command_monitor(args: argparse.Namespace) -> int:
    from collab_kit.auth import AuthorizationError
    from collab_kit.local_swarm import emit_event
    from collab_kit.monitor import Monitor, MonitorError, MonitorSettings
    from collab_kit.swarm import SwarmConnectionError

    config = build_config(args)
    settings = MonitorSettings(
        db_path=args.db or None, checkpoint_dir=args.checkpoints, checkpoint_every=args.checkpoint_every,
        keep_last=args.keep, push_to=args.push_to, poll_every=args.poll_every, wandb_project=args.wandb_project,
        backoff_initial=args.backoff, backoff_max=args.backoff_max, download_timeout=args.download_timeout,
        address_file=args.address_file, anchor=args.anchor)
    try:
        monitor = Monitor(config, settings, on_event=emit_event if args.events else None)
    except (AuthorizationError, MonitorError, SwarmConnectionError) as e:
        raise CommandError(str(e)) from None
    with monitor:
        monitor.run()
    return 0


def command_reachability(args: argparse.Namespace) -> int:
    from collab_kit.local_swarm import emit_event
    from collab_kit.reachability import probe_reachability
    from collab_kit.swarm import parse_initial_peers

    initial_peers = parse_initial_peers(args.initial_peers)
    verdict = probe_reachability(initial_peers, host=args.host, port=args.port or 0, timeout=args.timeout)
    print(f"reachability: {verdict.explain()}", flush=True)
    if verdict.reachable is None:
        advice = "the swarm could not tell: check that the initial peers are running this kit"
    elif verdict.reachable:
        advice = f"others can join through this machine at {', '.join(verdict.public_addresses)} port {verdict.port}"
    else:
        advice = ("`collab-kit join` will train in client mode here, through the run's anchor (a peer that accepts "
                  "connections: `collab-kit monitor` on a public host runs one)")
    print(advice, flush=True)
    if args.events:
        emit_event("reachability", reachable=verdict.reachable, port=verdict.port,
                   public_addresses=list(verdict.public_addresses),
                   answers=[dict(helper=a.helper, observed=a.observed_address, results=a.results, problem=a.problem)
                            for a in verdict.answers])
    return 0


def command_dashboard(args: argparse.Namespace) -> int:
    from collab_kit.dashboard import load, write_page

    data = load(args.db)  # a missing file: an error that says how to get one (collab-kit monitor --db)
    out = args.out or os.path.join(os.path.dirname(data.db_path), "dashboard.html")
    write_page(data, out, title=args.title, loss_x=args.loss_x, max_contributors=args.max_contributors)
    print(f"dashboard: {data.summary()}", flush=True)
    print(f"dashboard written to {out}", flush=True)
    return 0


def command_auth_server(args: argparse.Namespace) -> int:
    import datetime
    import math

    from collab_kit.auth_server import AuthServerSettings, serve

    if not (args.token_lifetime > 0 and math.isfinite(args.token_lifetime)):
        raise CommandError(f"--token-lifetime {args.token_lifetime:g}: expected a positive number of minutes")
    options = dict(organization=args.organization, allowlist=args.allow or (), database_path=args.db,
                   key_path=args.key, token_lifetime=datetime.timedelta(minutes=args.token_lifetime),
                   joins_per_minute=args.rate_limit, coordinator_addresses=args.coordinator or (),
                   request_deadline=args.request_deadline, connections_per_client=args.connections_per_client)
    if args.run_id is not None:
        options["run_id"] = args.run_id
    if args.hub_endpoint is not None:
        options["hub_endpoint"] = args.hub_endpoint
    settings = AuthServerSettings(**options)
    on_listening = None
    if args.events:  # a script waiting for the server (collab_kit.services) reads its URL from a "ready" event
        from collab_kit.local_swarm import emit_event

        def on_listening(line: str):
            print(line, flush=True)
            emit_event("ready", url=line.rsplit(" ", 1)[-1])  # the line ends "listening on http://HOST:PORT"
    try:
        serve(settings, host=args.host, port=args.port, on_listening=on_listening)
    except KeyboardInterrupt:  # uvicorn has shut down cleanly and passes the signal on
        pass
    print("auth server stopped", flush=True)
    return 0


def command_toy(args: argparse.Namespace) -> int:
    if args.toy_command == "train-vqgan":
        from collab_kit.toy_vqgan import main as train

        return train(args.options) or 0
    if args.toy_command == "train-clip":
        from collab_kit.toy_clip import main as train

        return train(args.options) or 0
    from collab_kit.toy import prepare_toy_dataset

    shards = prepare_toy_dataset(args.samples, seed=args.seed, cache_dir=args.cache_dir, progress=not args.no_progress)
    print(f"toy dataset: {shards}", flush=True)
    return 0


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def _size(num_bytes: float) -> str:
    for scale, unit in ((2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} bytes"


def command_model_info(args: argparse.Namespace) -> int:
    from collab_kit.model import describe

    config = build_config(args)
    model, info = config.model, describe(config.model)
    pattern = ", ".join(model.attention_pattern)
    last = f"; the last layer: {model.last_layer_attention}" if model.last_layer_attention else ""
    unique, compute = info["unique_parameters"], info["compute_parameters"]
    print(f"preset: {config.preset}")
    print(f"layers: {model.num_layers} (attention: {pattern}, repeated{last})")
    print(f"blocks: {info['unique_blocks']} stored" + (", shared by layer groups" if model.share_layer_groups else "")
          + (", reversible" if model.reversible else ""))
    print(f"width: hidden {model.hidden_size}, {info['heads']} heads, GEGLU inner {model.ffn_multiplier * model.hidden_size}")
    print(f"sequence: {info['sequence']} = {model.sequence_length} positions")
    print(f"params: unique={unique} compute={compute}")
    print(f"compute / unique: {compute / unique:.1f}x ({_count(unique)} stored, {_count(compute)} of compute)")
    print(f"weights: {_size(unique * 4)} in fp32, {_size(unique * 2)} in bf16")
    return 0


def command_preprocess(args: argparse.Namespace) -> int:
    from collab_kit.preprocess import PushError, preprocess

    try:
        report = preprocess(args.source, args.output, args.vqgan, rows_per_shard=args.rows_per_shard,
                            batch_size=args.batch_size, push_to_hub=args.push_to_hub, private=args.private or None,
                            source_format=args.format, captions_file=args.captions, image_column=args.image_column,
                            caption_column=args.caption_column, nsfw_column=args.nsfw_column, split=args.split,
                            max_samples=args.max_samples, device=args.device, num_workers=args.workers,
                            progress=not args.no_progress)
    except PushError as e:
        if e.report is not None:  # the shards are written: say so before the error
            print(e.report.summary(), flush=True)
        raise CommandError(str(e)) from None
    print(report.summary(), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# the parser


def _add_swarm_options(parser: argparse.ArgumentParser):
    parser.add_argument("--preset", choices=PRESETS, default="small", help="configuration preset (default: small)")
    parser.add_argument("--run-id", help="peers with the same run id train together")
    parser.add_argument("--initial-peers", nargs="+", metavar="MULTIADDR",
                        help="addresses of peers already in the swarm (printed by the first peer)")
    parser.add_argument("--host", help="address to listen on (127.0.0.1 keeps the peer on this machine)")
    parser.add_argument("--port", type=int, help="port to listen on (default: any free port)")
    parser.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                        help="change one configuration field, e.g. --set optimizer.target_batch_size=64")
    parser.add_argument("--events", action="store_true", help=argparse.SUPPRESS)  # machine-readable lines


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="collab-kit", description="Train transformers together over the Internet.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'collab-kit COMMAND --help' for the options of one command.")
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    parser.add_argument("--debug-logger", action="append", default=[], metavar="NAME",
                        help="also log this logger at DEBUG, whatever --log-level says (for instance "
                             "hivemind.averaging.matchmaking to see why a peer found no averaging group); repeatable")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = commands.add_parser("demo", help="a local collaborative run: a first peer and N volunteers on 127.0.0.1")
    demo.add_argument("--peers", type=int, default=2, help="volunteers that train (default: 2)")
    demo.add_argument("--epochs", type=int, help="global epochs to train (default: 60 for toy, 5 for others)")
    demo.add_argument("--preset", choices=PRESETS, default="toy", help="configuration preset (default: toy)")
    demo.add_argument("--workdir", help="keep the logs here (default: a temporary folder)")
    demo.add_argument("--timeout", type=float,
                      help="give up training after this many seconds (default: 480 for toy, 270 for others)")
    demo.add_argument("--samples", type=int, default=4096, help="pictures in the dataset (default: 4096)")
    demo.add_argument("--output", default="demo_out",
                      help="where samples.png, loss.png and the model go (default: demo_out; '' for nowhere)")
    demo.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                      help="change a field of the preset for every peer (repeatable)")
    demo.set_defaults(handler=command_demo)

    join = commands.add_parser("join", help="train with a swarm as a volunteer")
    _add_swarm_options(join)
    join.add_argument("--client-mode", action=argparse.BooleanOptionalAction, default=None,
                      help="connect out only, accept no incoming connections (default: asked of the swarm's peers, "
                           "which try to dial this one back)")
    join.add_argument("--data", help="parquet shards: a folder, a glob, or a Hub dataset id (user/name)")
    join.add_argument("--epochs", type=int, help="train this many global epochs from the swarm's current one")
    join.add_argument("--max-epochs", type=int, help="stop when the swarm reaches this global epoch")
    join.add_argument("--max-steps", type=int, help="stop after this many local steps")
    join.add_argument("--threads", type=int, help="CPU threads for torch")
    join.add_argument("--wait-for-peers", type=int, default=1, metavar="N",
                      help="start training once N peers (this one included) are ready (default: 1)")
    join.add_argument("--no-progress", action="store_true", help="no progress bar")
    join.add_argument("--verbose", action="store_true", help="log every stage of the global steps")
    join.add_argument("--save-params", metavar="PATH", help="save the final parameters here (torch.save)")
    join.add_argument("--save-checkpoint", metavar="FOLDER",
                      help="save the final model and its configuration here (a checkpoint generate_images reads)")
    join.set_defaults(handler=command_join)

    monitor = commands.add_parser(
        "monitor", help="the swarm's first peer: watches the run, keeps its history and leaderboard, saves checkpoints",
        description="Start the swarm's first peer (volunteers join through it). It trains nothing: it polls the "
                    "training peers' metrics in the DHT, stores the loss, alive peers, throughput and the "
                    "contributors' leaderboard in SQLite (--db, what `collab-kit dashboard` draws), and every "
                    "--checkpoint-every global epochs downloads the swarm's state from a peer and saves it as "
                    "CHECKPOINTS/epoch-NNNNNN (the newest --keep are kept; --push-to also uploads them). Started "
                    "again with the same --db and --checkpoints, it goes on where it was (pass --initial-peers of "
                    "a volunteer to rejoin a swarm that went on without it).")
    _add_swarm_options(monitor)
    monitor.add_argument("--address-file", help="also write the join addresses to this file")
    monitor.add_argument("--anchor", action=argparse.BooleanOptionalAction, default=None,
                         help="run the swarm's anchor here, the peer that volunteers behind NAT average through and "
                              "load the state from (default: when others can dial this monitor)")
    monitor.add_argument("--poll-every", "--report-every", dest="poll_every", type=float, default=10.0,
                         metavar="SECONDS", help="seconds between two readings of the swarm (default: 10)")
    monitor.add_argument("--db", default=os.path.join("monitor", "run.sqlite"), metavar="PATH",
                         help="SQLite file of the run's history and leaderboard, continued if it exists "
                              "(default: monitor/run.sqlite; '' for none)")
    monitor.add_argument("--checkpoints", default=os.path.join("monitor", "checkpoints"), metavar="FOLDER",
                         help="where checkpoints go, one folder per global epoch (default: monitor/checkpoints)")
    monitor.add_argument("--checkpoint-every", type=int, default=10, metavar="K",
                         help="save the swarm's state every K global epochs (default: 10; 0: never)")
    monitor.add_argument("--keep", type=int, default=3, metavar="N", help="checkpoints to keep (default: 3)")
    monitor.add_argument("--push-to", metavar="REPO",
                         help="also upload each checkpoint to this Hugging Face model repository (user/name)")
    monitor.add_argument("--wandb-project", default=os.environ.get("WANDB_PROJECT") or None, metavar="NAME",
                         help="also log each poll to Weights & Biases (needs `pip install wandb`; "
                              "default: $WANDB_PROJECT)")
    monitor.add_argument("--backoff", type=float, default=5.0, metavar="SECONDS",
                         help="wait before retrying a failed state download, doubled each time (default: 5)")
    monitor.add_argument("--backoff-max", type=float, default=300.0, metavar="SECONDS",
                         help="the longest wait between two retries (default: 300)")
    monitor.add_argument("--download-timeout", type=float, default=300.0, metavar="SECONDS",
                         help="give up one state download after this long (default: 300)")
    monitor.set_defaults(handler=command_monitor)

    reach = commands.add_parser(
        "reachability", help="ask a swarm's peers whether they can dial this machine (what `join` decides client "
                             "mode from)",
        description="Start a temporary libp2p host on PORT and ask the initial peers to connect back to it: behind NAT "
                    "or a firewall that drops incoming connections they cannot, with a public address or a forwarded "
                    "port they can.")
    reach.add_argument("--initial-peers", nargs="+", metavar="MULTIADDR", required=True,
                       help="addresses of peers already in the swarm (they do the check)")
    reach.add_argument("--host", default="0.0.0.0", help="the address to listen on (default: 0.0.0.0)")
    reach.add_argument("--port", type=int, help="the port to check (default: any free one)")
    reach.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                       help="how long each peer may take to answer (default: 10)")
    reach.add_argument("--events", action="store_true", help=argparse.SUPPRESS)
    reach.set_defaults(handler=command_reachability)

    board = commands.add_parser(
        "dashboard", help="the monitor's database as one static HTML page: loss, peers, throughput, leaderboard",
        description="Draw what `collab-kit monitor --db PATH` recorded (loss, alive peers, throughput, the "
                    "contributors' leaderboard, checkpoints) into one HTML file with its plots embedded: no "
                    "JavaScript, no other file. Safe to run while the monitor writes the database; run it again "
                    "(by hand or from cron) to refresh the page.")
    board.add_argument("--db", metavar="PATH",
                       help="the monitor's database (default: monitor/run.sqlite, else make demo's "
                            "demo_out/monitor.sqlite)")
    board.add_argument("--out", metavar="FILE.html", help="the page to write (default: dashboard.html beside --db)")
    board.add_argument("--title", default="collab_kit run", help="the page's heading (default: collab_kit run)")
    board.add_argument("--loss-x", choices=("time", "epoch"), default="time",
                       help="the loss curve's x axis (default: time)")
    board.add_argument("--max-contributors", type=int, default=200, metavar="N",
                       help="leaderboard rows shown (default: 200)")
    board.set_defaults(handler=command_dashboard)

    auth = commands.add_parser(
        "auth-server", help="let the members of a Hugging Face organization join a run (signs access tokens)",
        description="The run's authentication server: a volunteer's peer sends its Hugging Face user token once, "
                    "the server asks the Hub who it belongs to and, for a member of the organization (or a user "
                    "on the allowlist), signs an access token for the peer's key. It listens on 127.0.0.1 by "
                    "default: put it behind an HTTPS reverse proxy, since tokens travel in the requests.")
    auth.add_argument("--organization", metavar="ORG", help="the Hugging Face organization whose members may join")
    auth.add_argument("--allow", action="append", metavar="USER", help="a user who may join without being a member "
                                                                       "(repeatable)")
    auth.add_argument("--db", default="auth_server.sqlite3", metavar="PATH",
                      help="SQLite file of joins and per-user stats (default: auth_server.sqlite3)")
    auth.add_argument("--key", metavar="PATH", help="the server's RSA key, made the first time and kept: tokens stay "
                                                    "valid across restarts (default: beside --db, NAME_key.der)")
    auth.add_argument("--host", default="127.0.0.1",
                      help="address to listen on (default: 127.0.0.1, for an HTTPS reverse proxy on this machine; "
                           "0.0.0.0 to be reached directly, unencrypted)")
    auth.add_argument("--port", type=int, default=8555, help="port to listen on (default: 8555; 0 for any free one)")
    auth.add_argument("--coordinator", action="append", metavar="MULTIADDR",
                      help="an address of the run's first peer, sent to volunteers to join through (repeatable)")
    auth.add_argument("--run-id", help="the run's id, sent to volunteers (default: collab_kit)")
    auth.add_argument("--token-lifetime", type=float, default=60.0, metavar="MINUTES",
                      help="how long an access token is valid (default: 60)")
    auth.add_argument("--rate-limit", type=int, default=10, metavar="N",
                      help="joins one user may make per minute (default: 10)")
    auth.add_argument("--hub-endpoint", metavar="URL",
                      help="the Hugging Face Hub that checks tokens (default: $HF_ENDPOINT or https://huggingface.co)")
    auth.add_argument("--request-deadline", type=float, default=10.0, metavar="SECONDS",
                      help="seconds a client has to send a whole request; slower ones are answered 408 and "
                           "closed (default: 10)")
    auth.add_argument("--connections-per-client", type=int, default=32, metavar="N",
                      help="connections one client address may hold open at once, 0 for no cap (default: 32); "
                           "behind a reverse proxy, every connection comes from the proxy")
    auth.add_argument("--events", action="store_true", help=argparse.SUPPRESS)  # machine-readable lines
    auth.set_defaults(handler=command_auth_server)

    info = commands.add_parser("model-info", help="the model's shape and parameter counts, built without memory")
    info.add_argument("--preset", choices=PRESETS, default="small", help="configuration preset (default: small)")
    info.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                      help="change one configuration field, e.g. --set model.num_layers=32")
    info.set_defaults(handler=command_model_info)

    prep = commands.add_parser(
        "preprocess", help="images + captions -> the paper's filters -> VQGAN codes -> parquet shards (-> the Hub)",
        description="Turn image-caption pairs into the shards volunteers stream: drop short captions, aspect "
                    "ratios above 2 and NSFW labels other than UNLIKELY, encode the images with the VQGAN, write "
                    "shard-00000.parquet, ... and, with --push-to-hub, upload them. Run it again to resume: shards "
                    "already written are skipped.")
    prep.add_argument("source", help="a folder of images with captions.jsonl / .tsv / .csv or NAME.txt files, a "
                                     "WebDataset .tar (or a folder of them), parquet files, a saved dataset, or a "
                                     "Hub dataset id")
    prep.add_argument("--output", required=True, help="the folder of shards (created if missing)")
    prep.add_argument("--vqgan", required=True, metavar="LOCATION",
                      help="the VQGAN: a checkpoint file, a folder (last.ckpt + model.yaml) or a Hub repo id")
    prep.add_argument("--rows-per-shard", type=int, default=10_000, help="samples per shard (default: 10000)")
    prep.add_argument("--batch-size", type=int, default=32, help="images per VQGAN forward pass (default: 32)")
    prep.add_argument("--push-to-hub", metavar="REPO", help="also upload the shards to this Hub dataset (user/name)")
    prep.add_argument("--private", action="store_true", help="create the Hub dataset private")
    prep.add_argument("--format", choices=PREPROCESS_SOURCE_FORMATS, help="how to read SOURCE (default: found from it)")
    prep.add_argument("--captions", metavar="FILE", help="a folder's captions file, if not one in the folder")
    prep.add_argument("--image-column", help="the column of images (default: image, jpg, ...)")
    prep.add_argument("--caption-column", help="the column of captions (default: caption, text, TEXT, txt)")
    prep.add_argument("--nsfw-column", help="the column or JSON field of NSFW labels (default: NSFW, nsfw)")
    prep.add_argument("--split", default="train", help="the split of a Hub or saved dataset (default: train)")
    prep.add_argument("--max-samples", type=int, help="read at most this many pairs of SOURCE")
    prep.add_argument("--device", help="where the VQGAN runs (default: cuda if there is one, else cpu)")
    prep.add_argument("--workers", type=int, help="threads that decode images (default: up to 8)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    prep.set_defaults(handler=command_preprocess)

    toy = commands.add_parser("toy", help="the toy world: train its VQGAN and CLIP, make its dataset")
    toy_commands = toy.add_subparsers(dest="toy_command", metavar="ACTION", required=True)
    for action, what in (("train-vqgan", "train the toy VQGAN (the weights shipped in collab_kit/toy_assets)"),
                         ("train-clip", "train the toy CLIP (the weights shipped in collab_kit/toy_assets)")):
        # the training script parses its own options: `collab-kit toy train-vqgan --help` lists them
        trainer = toy_commands.add_parser(action, help=what, add_help=False)
        trainer.add_argument("options", nargs=argparse.REMAINDER)
    dataset = toy_commands.add_parser("make-dataset", help="the toy pictures as shards, made by preprocess (cached)")
    dataset.add_argument("--samples", type=int, default=4096, help="pictures (default: 4096)")
    dataset.add_argument("--seed", type=int, default=0, help="the pictures' seed (default: 0)")
    dataset.add_argument("--cache-dir", help="where to keep it (default: $COLLAB_KIT_CACHE or ~/.cache/collab_kit)")
    dataset.add_argument("--no-progress", action="store_true", help="no progress bar")
    toy.set_defaults(handler=command_toy)
    return parser


def _handle_stop_signals(request_stop=None):
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


def main(argv: Optional[List[str]] = None) -> int:
    parser = make_parser()
    # `collab-kit toy train-vqgan OPTIONS...`: the training script parses its own options (argparse's REMAINDER
    # would not take options that come first)
    argv, script_options = list(sys.argv[1:] if argv is None else argv), []
    for i in range(len(argv) - 1):
        if argv[i] == "toy" and argv[i + 1] in ("train-vqgan", "train-clip"):
            argv, script_options = argv[:i + 2], argv[i + 2:]
            break
    args = parser.parse_args(argv)
    if getattr(args, "toy_command", None) in ("train-vqgan", "train-clip"):
        args.options = script_options
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in args.debug_logger:
        logging.getLogger(name).setLevel(logging.DEBUG)
    _handle_stop_signals()
    try:
        return args.handler(args)
    except (CommandError, ValueError, FileNotFoundError) as e:
        print(f"collab-kit {args.command}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print(f"collab-kit {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
