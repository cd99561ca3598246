"""What every benchmark shares: result rows, the machine's description, and RESULTS.md.

Rows are kept in ``benchmarks/results.json`` (the record) and rendered to ``benchmarks/RESULTS.md``
(what people read). A run replaces the rows of the benchmarks it ran on this machine and keeps the
rest, so a figure measured on another machine (a GPU, say) stays until it is measured there again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import operator
import os
import platform
import sys
import traceback
from collections.abc import Callable, Sequence
from types import ModuleType

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
RESULTS_JSON = os.path.join(BENCH_DIR, "results.json")
RESULTS_MD = os.path.join(BENCH_DIR, "RESULTS.md")

_COMPARISONS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


def machine_description() -> str:
    """The device a figure was measured on, e.g. ``CPU x86_64, 2 cores, torch 2.13.0``."""
    import torch

    if torch.cuda.is_available():
        device = f"GPU {torch.cuda.get_device_name(0)}, CPU {os.cpu_count()} cores"
    else:
        device = f"CPU {platform.machine()}, {os.cpu_count()} cores"
    return f"{device}, torch {torch.__version__.split('+')[0]}"


def short_name(module) -> str:
    """``optimizer_state`` for the module benchmarks.optimizer_state (or for that name itself).

    ``__spec__.name`` rather than ``__name__``: a module run with ``python -m`` is called ``__main__``.
    """
    name = module if isinstance(module, str) else module.__spec__.name
    return name.rsplit(".", 1)[-1]


def command_for(module) -> str:
    return f".venv/bin/python -m benchmarks.{short_name(module)}"


def make_row(
    module, name: str, value: float | None, target: str, display: str, details: str = "", note: str = ""
) -> dict:
    """One line of the results table.

    :param module: the benchmark module that measured it, or its name (``__spec__.name``)
    :param name: what was measured, e.g. "optimizer throughput, 1 peer / plain loop"
    :param value: the measured figure (None if it could not be measured)
    :param target: the acceptance target as a comparison and a number, e.g. ">= 0.95"
    :param display: the value as shown in the table, e.g. "0.97x"
    :param details: one or two sentences with the raw measurements behind the figure
    :param note: a few words shown next to pass / MISSED when the figure alone would mislead
    """
    comparison, threshold = target.split()
    passed = value is not None and _COMPARISONS[comparison](value, float(threshold))
    return dict(
        benchmark=short_name(module),
        name=name,
        value=value,
        display=display,
        target=target,
        passed=passed,
        machine=machine_description(),
        command=command_for(module),
        date=datetime.date.today().isoformat(),
        details=details,
        note=note,
    )


def error_row(module, error: BaseException) -> dict:
    row = make_row(module, f"{short_name(module)} (failed)", None, ">= 0", "error")
    row.update(target="-", details=f"{type(error).__name__}: {error}")
    return row


# ---------------------------------------------------------------------------------------------
# the record and its rendering


def load_rows() -> list[dict]:
    if not os.path.exists(RESULTS_JSON):
        return []
    with open(RESULTS_JSON) as f:
        return json.load(f)


def merge_rows(
    old_rows: Sequence[dict], new_rows: Sequence[dict], ran: Sequence[str], known: Sequence[str], partial: bool = False
) -> list[dict]:
    """Replace the rows of the benchmarks in ``ran`` measured on this machine (or on the machine that measured the new
    rows, when a GPU run's rows are recorded here); drop unknown benchmarks. ``partial``: replace only the rows of
    the same names as new ones (part of a benchmark ran)."""
    machines = {machine_description(), *(row["machine"] for row in new_rows)}
    measured = {(row["benchmark"], row["name"]) for row in new_rows}

    def replaced(row: dict) -> bool:
        if row["benchmark"] not in ran or row["machine"] not in machines:
            return False
        return not partial or (row["benchmark"], row["name"]) in measured

    kept = [row for row in old_rows if row["benchmark"] in known and not replaced(row)]
    order = {name: index for index, name in enumerate(known)}
    # a stable sort: benchmarks in registry order, this machine's new rows after older rows of other machines
    return sorted([*kept, *new_rows], key=lambda row: order[row["benchmark"]])


def render_markdown(rows: Sequence[dict], modules: Sequence[ModuleType]) -> str:
    lines = [
        "# Benchmarks",
        "",
        "Measured by `make bench` (`.venv/bin/python -m benchmarks.run_all`), which rewrites this file;",
        "each figure is a ratio against a baseline measured in the same run, on the machine named in its row.",
        "A missed target is shown as MISSED, not hidden.",
        "",
        "| Figure | Measured | Target | Result | Machine | Command | Date |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        result = result_text(row)
        lines.append(
            f"| {row['name']} | {row['display']} | {row['target']} | {result} | {row['machine']} "
            f"| `{row['command']}` | {row['date']} |"
        )
    lines.append("")
    for module in modules:
        lines += [f"## {module.TITLE}", "", module.HOW.strip(), ""]
        module_rows = [row for row in rows if row["benchmark"] == short_name(module)]
        if module_rows:
            lines += ["Last measurements:", ""]
            for row in module_rows:
                lines.append(
                    f"- {row['name']} ({row['machine']}, {row['date']}): {row['display']}. {row['details']}".rstrip()
                )
            lines.append("")
        lines += [f"Reproduce: `{command_for(module)}` (or `make bench` for every figure).", ""]
    return "\n".join(lines)


def record(new_rows: Sequence[dict], ran: Sequence[ModuleType], partial: bool = False) -> None:
    """Merge ``new_rows`` into results.json and rewrite RESULTS.md (``partial``: some parts of the modules ran, and
    only the figures they measured are replaced)."""
    from benchmarks.run_all import BENCHMARKS

    known = [short_name(module) for module in BENCHMARKS]
    rows = merge_rows(load_rows(), new_rows, [short_name(module) for module in ran], known, partial=partial)
    with open(RESULTS_JSON, "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")
    with open(RESULTS_MD, "w") as f:
        f.write(render_markdown(rows, BENCHMARKS))


def result_text(row: dict) -> str:
    result = "pass" if row["passed"] else ("ERROR" if row["value"] is None else "MISSED")
    return f"{result} ({row['note']})" if row.get("note") else result


def format_table(rows: Sequence[dict]) -> str:
    """A short plain-text table for the terminal."""
    header = ("figure", "measured", "target", "result")
    body = [(row["name"], row["display"], row["target"], result_text(row)) for row in rows]
    widths = [max(len(str(line[i])) for line in (header, *body)) for i in range(len(header))]
    return "\n".join("  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)) for line in (header, *body))


def run_modules(
    modules: Sequence[ModuleType], quick: bool = False, write: bool = True, parts: Sequence[str] | None = None
) -> int:
    """Run benchmarks, print the table, record the rows; returns the exit code (1 if any benchmark failed).

    :param quick: a smoke test with fewer steps and repeats; its figures are never recorded
    :param parts: of a module with ``PARTS``, only these (its other figures in RESULTS.md are kept)
    """
    rows: list[dict] = []
    failed = False
    for index, module in enumerate(modules):
        print(f"[{index + 1}/{len(modules)}] {module.TITLE}", flush=True)
        try:
            rows += module.run(quick=quick, parts=parts) if parts else module.run(quick=quick)
        except Exception as e:  # one failing benchmark must not hide the figures of the others
            traceback.print_exc()
            rows.append(error_row(module, e))
            failed = True
    print()
    print(format_table(rows))
    if quick:
        print("\n--quick: a smoke test, RESULTS.md left as it was")
    elif write:
        record(rows, modules, partial=bool(parts))
        print(f"\nwrote {os.path.relpath(RESULTS_MD)}")
    return 1 if failed else 0


def main(module: ModuleType, argv: Sequence[str] | None = None) -> None:
    """Command line of a single benchmark module: measure, print, update RESULTS.md."""
    parser = argparse.ArgumentParser(description=(module.__doc__ or "").strip().splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer repeats and steps: a smoke test, not a figure (RESULTS.md is not touched)",
    )
    parser.add_argument("--no-write", action="store_true", help="print the figures without touching RESULTS.md")
    parts = getattr(module, "PARTS", None)
    if parts:
        parser.add_argument(
            "--only",
            action="append",
            choices=list(parts),
            metavar="PART",
            help=f"measure only this part ({', '.join(parts)}); the others' figures are kept",
        )
    args = parser.parse_args(argv)
    sys.exit(run_modules([module], quick=args.quick, write=not args.no_write, parts=getattr(args, "only", None)))


def main_or_peer(
    module: ModuleType,
    argv: Sequence[str] | None,
    description: str,
    add_peer_arguments: Callable[[argparse.ArgumentParser], None],
    peer_main: Callable[[argparse.Namespace], int],
) -> None:
    """Command line of a benchmark whose peers are processes of its own: with ``--peer``, one peer (``peer_main`` on
    the arguments ``add_peer_arguments`` declares); without, the benchmark itself (``main``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--peer" not in argv:
        main(module, argv)
        return
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--peer", action="store_true")
    add_peer_arguments(parser)
    sys.exit(peer_main(parser.parse_args(argv)))


def require_network_lab() -> None:
    """Raise RuntimeError, with the reason, where this machine cannot build the network lab
    (tests/helpers/netlab.py)."""
    from tests.helpers.netlab import lab_unavailable

    reason = lab_unavailable()
    if reason is not None:
        raise RuntimeError(f"no network lab on this machine: {reason}")


def pick(values: Sequence[float], how: str = "best") -> float:
    """The best (largest) or the median of repeated measurements."""
    ordered = sorted(values)
    if how == "best":
        return ordered[-1]
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def synthetic_batches(
    config, batch_size: int, count: int, folder: str | None = None, seed: int = 0, num_samples: int = 2048
) -> list[dict]:
    """``count`` batches of the kit's synthetic samples for ``config`` (a RunConfig), read back through
    ``collab_kit.data.stream.ShardStream`` as in training. The same arguments give the same batches in any process.

    :param folder: where the shards are, written there first if it holds none (default: a temporary folder)
    :param num_samples: samples in the shards (when they are written)
    """
    import itertools
    import tempfile

    from collab_kit.data.stream import ShardStream, batches
    from collab_kit.data.synthetic import make_synthetic_shards

    def read(path: str) -> list[dict]:
        if not os.path.exists(os.path.join(path, "shard-00000.parquet")):
            make_synthetic_shards(
                path,
                num_samples=num_samples,
                seed=seed,
                image_side=config.model.image_side,
                codebook_size=config.model.codebook_size,
            )
        stream = ShardStream(path, config.model.text_length, config.model.image_length, shuffle_buffer=256, seed=seed)
        return list(itertools.islice(batches(stream, batch_size), count))

    if folder is not None:
        return read(folder)
    with tempfile.TemporaryDirectory(prefix="collab_kit_bench_") as path:
        return read(path)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
