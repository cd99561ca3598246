"""``collab-kit model-info``: the model's shape and parameter counts, built without memory."""

from __future__ import annotations

import argparse

from collab_kit.cli.common import build_config
from collab_kit.config import PRESETS
from collab_kit.units import format_bytes


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``collab-kit model-info`` to the command line."""
    info = commands.add_parser("model-info", help="the model's shape and parameter counts, built without memory")
    info.add_argument("--preset", choices=PRESETS, default="small", help="configuration preset (default: small)")
    info.add_argument(
        "--set",
        action="append",
        metavar="SECTION.FIELD=VALUE",
        help="change one configuration field, e.g. --set model.num_layers=32",
    )
    info.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # lazy: the libraries the command needs (torch, hivemind) load when it runs: `collab-kit --help` answers at once
    from collab_kit.model.transformer import describe

    config = build_config(args)
    model, info = config.model, describe(config.model)
    pattern = ", ".join(model.attention_pattern)
    last = f"; the last layer: {model.last_layer_attention}" if model.last_layer_attention else ""
    unique, compute = info["unique_parameters"], info["compute_parameters"]
    print(f"preset: {config.preset}")
    print(f"layers: {model.num_layers} (attention: {pattern}, repeated{last})")
    print(
        f"blocks: {info['unique_blocks']} stored"
        + (", shared by layer groups" if model.share_layer_groups else "")
        + (", reversible" if model.reversible else "")
    )
    print(
        f"width: hidden {model.hidden_size}, {info['heads']} heads, "
        f"GEGLU inner {model.ffn_multiplier * model.hidden_size}"
    )
    print(f"sequence: {info['sequence']} = {model.sequence_length} positions")
    print(f"params: unique={unique} compute={compute}")
    print(f"compute / unique: {compute / unique:.1f}x ({_count(unique)} stored, {_count(compute)} of compute)")
    print(f"weights: {format_bytes(unique * 4)} in fp32, {format_bytes(unique * 2)} in bf16")
    return 0


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)
