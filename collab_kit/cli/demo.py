"""``collab-kit demo``: a local collaborative run on 127.0.0.1, what `make demo` runs."""

from __future__ import annotations

import argparse
import sys

from collab_kit.config import PRESETS


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``collab-kit demo`` to the command line."""
    demo = commands.add_parser("demo", help="a local collaborative run: a first peer and N volunteers on 127.0.0.1")
    demo.add_argument("--peers", type=int, default=2, help="volunteers that train (default: 2)")
    demo.add_argument(
        "--epochs",
        type=int,
        help="global epochs to train (default: 300 for toy, 5 for others; in "
        "local-update mode, rounds holding as many global batches)",
    )
    demo.add_argument(
        "--local-steps",
        type=int,
        default=0,
        metavar="H",
        help="local-update mode (DiLoCo): average once every H global batches instead of at every one, "
        "about H times fewer bytes (the same as --set optimizer.local_steps=H; default: 0, "
        "synchronous)",
    )
    demo.add_argument("--preset", choices=PRESETS, default="toy", help="configuration preset (default: toy)")
    demo.add_argument("--workdir", help="keep the logs here (default: a temporary folder)")
    demo.add_argument(
        "--timeout", type=float, help="give up training after this many seconds (default: 720 for toy, 270 for others)"
    )
    demo.add_argument(
        "--samples", type=int, help="pictures in the dataset (default: 2048 for toy, a world of 1200 scenes; else 4096)"
    )
    demo.add_argument(
        "--output",
        default="demo_out",
        help="where samples.png, loss.png and the model go (default: demo_out; '' for nowhere)",
    )
    demo.add_argument(
        "--set",
        action="append",
        metavar="SECTION.FIELD=VALUE",
        help="change a field of the preset for every peer (repeatable)",
    )
    demo.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # lazy: the libraries the command needs (torch, hivemind) load when it runs: `collab-kit --help` answers at once
    from collab_kit.demo import DemoFailed, run_demo

    try:
        result = run_demo(
            num_volunteers=args.peers,
            epochs=args.epochs,
            preset=args.preset,
            workdir=args.workdir,
            timeout=args.timeout,
            num_samples=args.samples,
            output_dir=None if args.output == "" else args.output,
            overrides=[*(args.set or ()), *([f"optimizer.local_steps={args.local_steps}"] if args.local_steps else [])],
        )
    except DemoFailed as e:
        print(f"demo failed: {e}", file=sys.stderr, flush=True)
        return 1
    print(result.summary_line(), flush=True)
    return 0
