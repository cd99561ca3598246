"""Decompression bombs: the time and memory the codec spends refusing one / plain Brotli expanding one.

A shard row of a few hundred bytes can hold a Brotli payload that expands to gigabytes. ``decode_codes`` never
lets the decompressor past the size the record's header announces (at most 131,070 bytes), so refusing a bomb
costs a small, fixed amount where plain Brotli spends what the bomb expands to.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import brotli
import numpy as np

from benchmarks import common
from collab_kit.data.codec import encode_codes

TITLE = "Decompression bombs: refusing one / expanding it with plain Brotli"
HOW = """
Bombs: records whose header announces 16 codes of 5 bits (10 bytes) and whose Brotli payload (quality 5, written
16 MiB at a time) expands to 256 MiB or 1 GiB of zeros, declaring a window of 4 MiB (lgwin 22, the largest a record
may declare: such a bomb reaches the bounded decompressor) or 16 MiB (lgwin 24: refused from its window alone); a
few hundred bytes to 1.6 KB each. Each is decoded by `decode_codes` in a process of its own (`python -c`, after
one warm-up call on a legal record), which reports the growth of its resident memory's peak at the first call
(`/proc/self/clear_refs` reset, then `VmHWM` - `VmRSS`) and the call's time (`time.perf_counter`, best of 5, 3
with `--quick`). The baseline, measured the same way: plain `brotli.decompress` of the 256 MiB bomb of window
4 MiB (one call), what the codec did before. The figures are the worst bomb / that baseline; the details give the
absolute figures against the issue's
bound (refused within 0.1 s and 10 MB), and the largest legal record's decoding for scale.
"""

# run in a process of its own per record: its decode's resident-memory growth and time, as a JSON line
MEASURE = """
import json, sys, time
import brotli
import numpy as np
from collab_kit.data.codec import decode_codes, encode_codes

def rss(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))

def measure(call, repeats):
    # memory at the first call (freed memory that the allocator keeps would hide a later call's), then the time
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = rss("VmRSS")
    try:
        call()
    except ValueError:
        pass
    growth = rss("VmHWM") - before
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        try:
            call()
        except ValueError:
            pass
        best = min(best, time.perf_counter() - started)
    return dict(seconds=best, growth=growth)

repeats = int(sys.argv[1])
decode_codes(encode_codes(np.arange(1000) % 300, 300))
for name, path in zip(sys.argv[2::2], sys.argv[3::2]):
    record = open(path, "rb").read()
    call = (lambda: brotli.decompress(record[3:])) if name == "plain" else (lambda: decode_codes(record))
    print(json.dumps(dict(name=name, size=len(record), **measure(call, 1 if name == "plain" else repeats))))
"""


def _bomb(expanded_bytes: int, window_bits: int) -> bytes:
    compressor, chunk = brotli.Compressor(quality=5, lgwin=window_bits), bytes(16 << 20)
    payload = b"".join(compressor.process(chunk) for _ in range(expanded_bytes // len(chunk))) + compressor.finish()
    return bytes([5 | 0x80]) + (16).to_bytes(2, "little") + payload


def run(quick: bool = False) -> list[dict]:
    # the largest legal record that goes through Brotli: 65,535 codes of 16 bits, of low entropy (0..15)
    legal = encode_codes(np.random.default_rng(0).integers(0, 16, size=2**16 - 1), 2**16)
    records = {
        "legal": legal,
        "bomb 256 MiB, window 4 MiB": _bomb(256 << 20, 22),
        "bomb 1 GiB, window 4 MiB": _bomb(1 << 30, 22),
        "bomb 1 GiB, window 16 MiB": _bomb(1 << 30, 24),
    }
    records["plain"] = records["bomb 256 MiB, window 4 MiB"]
    with tempfile.TemporaryDirectory() as folder:
        arguments = []
        for index, (name, record) in enumerate(records.items()):
            path = os.path.join(folder, f"record-{index}")
            with open(path, "wb") as f:
                f.write(record)
            arguments += [name, path]
        measured = {}
        for name, path in zip(arguments[::2], arguments[1::2]):  # a fresh process each: nothing reused
            result = subprocess.run(
                [sys.executable, "-c", MEASURE, str(3 if quick else 5), name, path],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if result.returncode != 0:
                raise RuntimeError(f"the measuring process failed: {result.stderr[-1000:]}")
            measured[name] = json.loads(result.stdout.splitlines()[-1])
    bombs = {name: row for name, row in measured.items() if name.startswith("bomb")}
    plain, legal_row = measured["plain"], measured["legal"]
    slowest = max(row["seconds"] for row in bombs.values())
    largest = max(row["growth"] for row in bombs.values())
    held = slowest < 0.1 and largest < 10e6
    details = (
        "; ".join(
            f"{name} ({row['size']} bytes): refused in {row['seconds'] * 1e3:.2f} ms, +{row['growth'] / 2**20:.2f} MiB"
            for name, row in bombs.items()
        )
        + f"; bound 100 ms and 10 MB: {'held' if held else 'NOT held'}. Plain brotli.decompress of the 256 MiB "
        f"bomb: {plain['seconds']:.2f} s, +{plain['growth'] / 2**20:.0f} MiB. The largest legal Brotli "
        f"record ({legal_row['size']} bytes) decodes in {legal_row['seconds'] * 1e3:.2f} ms, "
        f"+{legal_row['growth'] / 2**20:.2f} MiB"
    )
    return [
        common.make_row(
            __spec__.name,
            "time: slowest bomb refused / plain Brotli expanding a 256 MiB bomb",
            slowest / plain["seconds"],
            "<= 0.1",
            f"{slowest / plain['seconds']:.4f}x",
            details,
        ),
        common.make_row(
            __spec__.name,
            "resident memory: largest growth refusing a bomb / plain Brotli's",
            largest / max(1, plain["growth"]),
            "<= 0.05",
            f"{largest / max(1, plain['growth']):.4f}x",
            "growth of the resident memory's peak during one call; absolute figures in the row above",
        ),
    ]


if __name__ == "__main__":
    common.main(sys.modules[__name__])
