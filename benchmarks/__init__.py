"""Measured figures of collab_kit, each a ratio against a baseline measured in the same run.

``make bench`` (``python -m benchmarks.run_all``) runs every benchmark listed in
``benchmarks.run_all.BENCHMARKS`` and rewrites ``benchmarks/RESULTS.md``; each benchmark module can
also be run on its own (``python -m benchmarks.<module>``), which updates only its own rows.

A benchmark module provides:

- ``TITLE``: the heading of its section in RESULTS.md;
- ``HOW``: a few lines saying how its figures are measured and how to reproduce them;
- ``run(quick: bool = False) -> list[dict]``: measures and returns rows built with
  ``benchmarks.common.make_row``; ``quick`` trades precision for time (used by smoke tests).

Shared helpers (rows, the machine's description, RESULTS.md) are in ``benchmarks.common``.
"""
