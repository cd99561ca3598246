"""``collab-kit toy``: the toy world: train its VQGAN and CLIP, make its dataset."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``collab-kit toy train-vqgan | train-clip | make-dataset`` to the command line."""
    toy = commands.add_parser("toy", help="the toy world: train its VQGAN and CLIP, make its dataset")
    toy_commands = toy.add_subparsers(dest="toy_command", metavar="ACTION", required=True)
    for action, what in (
        ("train-vqgan", "train the toy VQGAN (the weights shipped in collab_kit/toy/assets)"),
        ("train-clip", "train the toy CLIP (the weights shipped in collab_kit/toy/assets)"),
    ):
        # the training script parses its own options: `collab-kit toy train-vqgan --help` lists them
        trainer = toy_commands.add_parser(action, help=what, add_help=False)
        trainer.add_argument("options", nargs=argparse.REMAINDER)
    dataset = toy_commands.add_parser("make-dataset", help="the toy pictures as shards, made by preprocess (cached)")
    dataset.add_argument("--samples", type=int, default=4096, help="pictures (default: 4096)")
    dataset.add_argument("--seed", type=int, default=0, help="the pictures' seed (default: 0)")
    dataset.add_argument("--cache-dir", help="where to keep it (default: $COLLAB_KIT_CACHE or ~/.cache/collab_kit)")
    dataset.add_argument("--no-progress", action="store_true", help="no progress bar")
    toy.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # lazy: the toy world's models load torch and taming-transformers; `collab-kit --help` answers at once
    from collab_kit.toy import clip, dataset, vqgan

    if args.toy_command in ("train-vqgan", "train-clip"):
        # each training script parses its own options
        return (vqgan if args.toy_command == "train-vqgan" else clip).main(args.options) or 0
    shards = dataset.prepare_toy_dataset(
        args.samples, seed=args.seed, cache_dir=args.cache_dir, progress=not args.no_progress
    )
    print(f"toy dataset: {shards}", flush=True)
    return 0
