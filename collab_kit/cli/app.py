"""``collab-kit``: the command line of the kit.

    collab-kit demo                         a local collaborative run (what `make demo` runs)
    collab-kit join --initial-peers ADDR    train with a swarm as a volunteer
    collab-kit monitor                      the swarm's first peer: run history, leaderboard, checkpoints
    collab-kit anchor --initial-peers ADDR  one more public peer that volunteers behind NAT average through
    collab-kit dashboard --db PATH --out FILE.html
                                            the monitor's database as a static page: plots and leaderboard
    collab-kit auth-server --organization ORG
                                            let the members of a Hugging Face organization join a run
    collab-kit model-info --preset paper    the model's shape and parameter counts (no memory needed)
    collab-kit preprocess SOURCE --vqgan LOCATION --output FOLDER
                                            images + captions -> filters -> VQGAN codes -> parquet shards (-> Hub)
    collab-kit toy train-vqgan | train-clip | make-dataset
                                            the toy world's tokenizer, ranker and dataset

Each command is a module of this package with ``register(commands)``, which adds its options, and ``run(args)``;
a command loads what it needs (torch, hivemind) only when it runs, so ``collab-kit --help`` answers at once.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Mapping

from collab_kit.cli import (
    anchor,
    auth_server,
    dashboard,
    demo,
    join,
    model_info,
    monitor,
    preprocess,
    reachability,
    toy,
)
from collab_kit.cli.common import handle_stop_signals
from collab_kit.errors import CollabKitError

COMMANDS = (demo, join, monitor, anchor, reachability, dashboard, auth_server, model_info, preprocess, toy)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="collab-kit",
        description="Train transformers together over the Internet.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'collab-kit COMMAND --help' for the options of one command.",
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    parser.add_argument(
        "--debug-logger",
        action="append",
        default=[],
        metavar="NAME",
        help="also log this logger at DEBUG, whatever --log-level says (for instance "
        "hivemind.averaging.matchmaking to see why a peer found no averaging group); repeatable",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(commands)
    return parser


def main(
    argv: list[str] | None = None, handlers: Mapping[str, Callable[[argparse.Namespace], int]] | None = None
) -> int:
    """``collab-kit``: parse ``argv`` (default: the process's arguments), set up logging and signals, run the command.

    :param handlers: command name -> the function that runs it, in place of the command's own ``run`` (a test peer
      that joins with parts of its own: ``{"join": partial(join.run, make_volunteer=...)}``)
    :returns: the exit status: 0, 2 for a problem the user can fix (said in one line), 130 when interrupted
    """
    parser = make_parser()
    # `collab-kit toy train-vqgan OPTIONS...`: the training script parses its own options (argparse's REMAINDER
    # would not take options that come first)
    argv, script_options = list(sys.argv[1:] if argv is None else argv), []
    for i in range(len(argv) - 1):
        if argv[i] == "toy" and argv[i + 1] in ("train-vqgan", "train-clip"):
            argv, script_options = argv[: i + 2], argv[i + 2 :]
            break
    args = parser.parse_args(argv)
    if getattr(args, "toy_command", None) in ("train-vqgan", "train-clip"):
        args.options = script_options
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in args.debug_logger:
        logging.getLogger(name).setLevel(logging.DEBUG)
    handle_stop_signals()
    handler = (handlers or {}).get(args.command, args.handler)
    try:
        return handler(args)
    except (CollabKitError, ValueError, FileNotFoundError) as e:  # what the user can fix: one line, no traceback
        print(f"collab-kit {args.command}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print(f"collab-kit {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
