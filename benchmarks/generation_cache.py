"""Image generation with a KV cache / without one, at 1024 image codes on the tiny width (target >= 10x).

Without a cache every new code runs the whole sequence through the model again; with it, each step
computes one position and reads the keys and values kept from the earlier ones.
"""

from __future__ import annotations

import sys
import time

import torch

from benchmarks import common

TITLE = "Generation: KV cache / no cache"
HOW = """
The `tiny` preset's width (hidden 32, 2 heads, 2 layers: row, then conv) with the paper's image of
32 x 32 = 1024 codes after the tiny 8-token caption, seed 0, batch 4, greedy decoding
(`collab_kit.model.sampling.generate_image_codes(model, captions, temperature=0, use_cache=...)`). With
`use_cache=True` the model reads the caption once (`start_decoding`) and then appends one code per
step (`continue_decoding`), attending over the cached keys and values; with `use_cache=False` each of
the 1024 steps runs the full forward pass over the caption and the codes drawn so far (later codes
are zeros, invisible to the causal masks). The figure is the ratio of the two wall times for the
whole image (best of the repeats); both must draw the same codes.
"""


def measure(image_side: int = 32, batch: int = 4, repeats: int = 2) -> dict:
    from collab_kit.config import get_preset
    from collab_kit.model.sampling import generate_image_codes
    from collab_kit.model.transformer import TextToImageTransformer

    config = get_preset("tiny", model=dict(image_side=image_side)).model
    torch.manual_seed(0)
    model = TextToImageTransformer(config).eval()
    captions = torch.randint(3, config.text_vocab_size, (batch, config.text_length))

    def timed(use_cache: bool):
        best, codes = float("inf"), None
        for _ in range(repeats):
            start = time.perf_counter()
            codes = generate_image_codes(model, captions, temperature=0, use_cache=use_cache)
            best = min(best, time.perf_counter() - start)
        return best, codes

    cached_seconds, cached_codes = timed(True)
    uncached_seconds, uncached_codes = timed(False)
    return dict(
        cached=cached_seconds,
        uncached=uncached_seconds,
        same=bool(torch.equal(cached_codes, uncached_codes)),
        codes=config.image_length,
        batch=batch,
        threads=torch.get_num_threads(),
    )


def run(quick: bool = False) -> list[dict]:
    result = measure(image_side=16 if quick else 32, repeats=1 if quick else 2)
    if not result["same"]:
        raise RuntimeError("greedy generation drew different codes with and without the cache")
    ratio = result["uncached"] / result["cached"]
    print(f"  with cache {result['cached']:.2f} s, without {result['uncached']:.2f} s", flush=True)
    details = (
        f"{result['codes']} codes x batch {result['batch']}: {result['cached']:.2f} s with the cache "
        f"({result['cached'] / result['codes'] * 1e3:.2f} ms per code), {result['uncached']:.2f} s without "
        f"({result['uncached'] / result['codes'] * 1e3:.2f} ms per code); both drew the same codes; "
        f"torch threads {result['threads']}."
    )
    return [
        common.make_row(
            __spec__.name,
            f"generation speed, KV cache / no cache ({result['codes']} image codes, tiny width)",
            ratio,
            ">= 10",
            f"{ratio:.1f}x",
            details,
        )
    ]


if __name__ == "__main__":
    common.main(sys.modules[__name__])
