"""Axial attention / dense masked attention: training throughput at the paper's sequence of 1280 positions.

Both compute the same attention (tests/model/test_attention.py checks they agree): the dense side builds
scores for all 1280 x 1280 pairs and masks most of them; the axial side groups the image by rows,
columns or bands of rows and scores each group against the caption and itself.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from benchmarks import common

TITLE = "Attention: axial / dense masked"
HOW = """
The paper's attention shape: 256 caption tokens + 32 x 32 image codes = 1280 positions, 16 heads of 64,
batch 1, float32 on this machine's device (CPU here), random q, k, v (seed 0). For each kind of layer
(row, column, conv with the paper's 11 x 11 window) one training step of attention alone, forward and
backward, is timed with `collab_kit.model.attention.Layout(256, 32, 11).attend(q, k, v, kind)` and with
`torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=layout.dense_mask(kind))`. Each
side is run in alternation, best of the repeats after a warm-up; throughput = steps / second. The
figure is axial throughput / dense throughput for each kind; the details give the times and the
number of attention scores each side computes.
"""


def measure(kinds=("row", "column", "conv"), repeats: int = 5, batch: int = 1) -> dict:
    from collab_kit.model.attention import Layout

    layout = Layout(256, 32, 11)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, 16, layout.length, 64, device=device, requires_grad=True) for _ in range(3))
    upstream = torch.randn(batch, 16, layout.length, 64, device=device)

    def step(fn):
        def run_once():
            out = fn()
            torch.autograd.grad(out, (q, k, v), upstream)
            if device == "cuda":
                torch.cuda.synchronize()

        return run_once

    results = {}
    for kind in kinds:
        mask = layout.dense_mask(kind, device)
        sides = dict(
            axial=step(lambda: layout.attend(q, k, v, kind)),
            dense=step(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
        )
        times = {name: [] for name in sides}
        for fn in sides.values():
            fn()  # warm-up: masks, allocator
        for _ in range(repeats):
            for name, fn in sides.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        T, S = layout.text_length, layout.image_side
        band = S if kind in ("row", "column") else (layout.conv_kernel_size // 2 + 1) * S
        results[kind] = dict(
            axial=min(times["axial"]),
            dense=min(times["dense"]),
            axial_scores=T * T + S * S * (T + band),
            dense_scores=layout.length**2,
        )
    return dict(results=results, device=device)


def run(quick: bool = False) -> list[dict]:
    measured = measure(repeats=2 if quick else 5)
    rows = []
    for kind, r in measured["results"].items():
        ratio = r["dense"] / r["axial"]  # throughput ratio = inverse time ratio
        print(f"  {kind}: axial {r['axial'] * 1e3:.1f} ms, dense {r['dense'] * 1e3:.1f} ms", flush=True)
        details = (
            f"{kind}: forward + backward {r['axial'] * 1e3:.1f} ms axial vs {r['dense'] * 1e3:.1f} ms dense "
            f"masked ({measured['device']}); scores per head: {r['axial_scores'] / 1e6:.2f} M axial vs "
            f"{r['dense_scores'] / 1e6:.2f} M dense."
        )
        rows.append(
            common.make_row(
                __spec__.name,
                f"attention throughput, axial / dense masked ({kind}, seq 1280, 16 x 64 heads)",
                ratio,
                ">= 1",
                f"{ratio:.2f}x",
                details,
            )
        )
    return rows


if __name__ == "__main__":
    common.main(sys.modules[__name__])
