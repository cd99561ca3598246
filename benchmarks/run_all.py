"""Run every benchmark, print a short table and rewrite benchmarks/RESULTS.md (``make bench``).

The exit code is non-zero only when a benchmark failed with an error; a missed target is a result,
shown as MISSED in RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks import (
    axial_attention,
    code_storage,
    four_bit,
    fragments,
    generation_cache,
    gpu_check,
    gradient_compression,
    hostile_data,
    internet_links,
    live_page_load,
    local_updates,
    memory_estimates,
    optimizer_state,
    optimizer_throughput,
    overlap,
    reversible_memory,
    robust_aggregation,
    swarm_scaling,
    toy_models,
    two_anchors,
    utilization,
)

# one module per figure, in the order of RESULTS.md; a new benchmark is a module with TITLE, HOW
# and run(quick) -> rows (see benchmarks/__init__.py), added here
BENCHMARKS = [
    optimizer_throughput,
    gradient_compression,
    optimizer_state,
    reversible_memory,
    memory_estimates,
    generation_cache,
    axial_attention,
    code_storage,
    hostile_data,
    toy_models,
    robust_aggregation,
    swarm_scaling,
    internet_links,
    two_anchors,
    local_updates,
    four_bit,
    overlap,
    fragments,
    utilization,
    live_page_load,
    gpu_check,
]  # gpu_check: rows on a GPU only


def main(argv=None) -> int:
    from benchmarks import common

    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer repeats and steps: a smoke test, not figures (RESULTS.md is not touched)",
    )
    parser.add_argument("--no-write", action="store_true", help="print the figures without touching RESULTS.md")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        choices=[common.short_name(m) for m in BENCHMARKS],
        help="run only these benchmarks (their rows are replaced, the others kept)",
    )
    args = parser.parse_args(argv)
    modules = [m for m in BENCHMARKS if args.only is None or common.short_name(m) in args.only]
    start = time.perf_counter()
    code = common.run_modules(modules, quick=args.quick, write=not args.no_write)
    print(f"benchmarks took {time.perf_counter() - start:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
