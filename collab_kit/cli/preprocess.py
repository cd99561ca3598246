"""``collab-kit preprocess``: images + captions -> the paper's filters -> VQGAN codes -> parquet shards (-> the Hub)."""

from __future__ import annotations

import argparse

from collab_kit.cli.common import CommandError
from collab_kit.data.sources import SOURCE_FORMATS, PairSource


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``collab-kit preprocess`` to the command line."""
    prep = commands.add_parser(
        "preprocess",
        help="images + captions -> the paper's filters -> VQGAN codes -> parquet shards (-> the Hub)",
        description="Turn image-caption pairs into the shards volunteers stream: drop short captions, aspect "
        "ratios above 2 and NSFW labels other than UNLIKELY, encode the images with the VQGAN, write "
        "shard-00000.parquet, ... and, with --push-to-hub, upload them. Run it again to resume: shards "
        "already written are skipped.",
    )
    prep.add_argument(
        "source",
        help="a folder of images with captions.jsonl / .tsv / .csv or NAME.txt files, a "
        "WebDataset .tar (or a folder of them), parquet files, a saved dataset, or a "
        "Hub dataset id",
    )
    prep.add_argument("--output", required=True, help="the folder of shards (created if missing)")
    prep.add_argument(
        "--vqgan",
        required=True,
        metavar="LOCATION",
        help="the VQGAN: a checkpoint file, a folder (last.ckpt + model.yaml) or a Hub repo id",
    )
    prep.add_argument("--rows-per-shard", type=int, default=10_000, help="samples per shard (default: 10000)")
    prep.add_argument("--batch-size", type=int, default=32, help="images per VQGAN forward pass (default: 32)")
    prep.add_argument("--push-to-hub", metavar="REPO", help="also upload the shards to this Hub dataset (user/name)")
    prep.add_argument("--private", action="store_true", help="create the Hub dataset private")
    prep.add_argument("--format", choices=SOURCE_FORMATS, help="how to read SOURCE (default: found from it)")
    prep.add_argument("--captions", metavar="FILE", help="a folder's captions file, if not one in the folder")
    prep.add_argument("--image-column", help="the column of images (default: image, jpg, ...)")
    prep.add_argument("--caption-column", help="the column of captions (default: caption, text, TEXT, txt)")
    prep.add_argument("--nsfw-column", help="the column or JSON field of NSFW labels (default: NSFW, nsfw)")
    prep.add_argument("--split", default="train", help="the split of a Hub or saved dataset (default: train)")
    prep.add_argument("--max-samples", type=int, help="read at most this many pairs of SOURCE")
    prep.add_argument("--device", help="where the VQGAN runs (default: cuda if there is one, else cpu)")
    prep.add_argument("--workers", type=int, help="threads that decode images (default: up to 8)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    prep.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # lazy: the libraries the command needs (torch, hivemind) load when it runs: `collab-kit --help` answers at once
    from collab_kit.data.preprocess import PushError, preprocess

    try:
        source = PairSource(
            args.source,
            format=args.format,
            captions_file=args.captions,
            image_column=args.image_column,
            caption_column=args.caption_column,
            nsfw_column=args.nsfw_column,
            split=args.split,
            max_samples=args.max_samples,
        )
        report = preprocess(
            source,
            args.output,
            args.vqgan,
            rows_per_shard=args.rows_per_shard,
            batch_size=args.batch_size,
            push_to_hub=args.push_to_hub,
            private=args.private or None,
            device=args.device,
            num_workers=args.workers,
            progress=not args.no_progress,
        )
    except PushError as e:
        if e.report is not None:  # the shards are written: say so before the error
            print(e.report.summary(), flush=True)
        raise CommandError(str(e)) from None
    print(report.summary(), flush=True)
    return 0
