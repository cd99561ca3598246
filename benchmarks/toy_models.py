"""The toy world's shipped models on held-out pictures: CLIP caption retrieval (pick the right caption of 8),
re-measured from the weights in collab_kit/toy_assets (the toy VQGAN's PSNR joins it when its weights ship).

Chance for the retrieval is 1/8; the figures the training scripts stated (metrics.json) are shown beside.
"""
from __future__ import annotations

import sys
from typing import List

from benchmarks import common

TITLE = "Toy world: the shipped models on held-out pictures"
HOW = """
`collab_kit.toy_clip.load_toy_clip()` loads the weights shipped in `collab_kit/toy_assets/clip/` (trained by
`python -m collab_kit.toy_clip --output collab_kit/toy_assets/clip --steps 1500 --threads 1`, its training time in
that folder's `metrics.json`). CLIP: `collab_kit.toy_clip.evaluate_toy_clip` on the held-out
pictures `toy.scenes(512, seed=20211206)` (seeds the training never draws): for each picture, its caption against 7
captions of other held-out pictures; the figure is the share where its own caption has the highest cosine (chance
0.125). The details add the colour test (its caption against the 7 same captions in the other colours) and the same
on pictures blurred as a VQGAN reconstruction would be. VQGAN: mean PSNR of decode(encode(x)) against x over its
held-out pictures (`collab_kit.toy_vqgan.evaluate_toy_vqgan`), with the share of reconstructions whose dominant
colour (`toy.dominant_color`, pixels only) is still the caption's.
"""


def run(quick: bool = False) -> List[dict]:
    rows = []
    from collab_kit.toy_clip import evaluate_toy_clip, load_toy_clip, toy_clip_metrics

    ranker, stated = load_toy_clip(), toy_clip_metrics()
    count = 128 if quick else stated["held_out"]
    sharp = evaluate_toy_clip(ranker, count=count, seed=stated["held_out_seed"])
    blurred = evaluate_toy_clip(ranker, count=count, seed=stated["held_out_seed"], blurred=True)
    accuracy = sharp["retrieval_accuracy_of_8"]
    print(f"  toy CLIP: right caption of 8 {accuracy:.3f}, colour of 8 {sharp['colour_accuracy_of_8']:.3f}", flush=True)
    details = (f"{count} held-out pictures: right caption of 8 {accuracy:.3f} (stated {stated['retrieval_accuracy_of_8']:.3f}, "
               f"chance 0.125), right colour of 8 {sharp['colour_accuracy_of_8']:.3f}, shape of 5 "
               f"{sharp['shape_accuracy_of_5']:.3f}; blurred pictures: caption {blurred['retrieval_accuracy_of_8']:.3f}, "
               f"colour {blurred['colour_accuracy_of_8']:.3f}. Trained {stated['steps']} steps of batch "
               f"{stated['batch_size']} in {stated['train_seconds'] / 60:.1f} min on one CPU thread; "
               f"{stated['parameters'] / 1e6:.2f} M parameters.")
    rows.append(common.make_row(__spec__.name, "toy CLIP caption retrieval, right caption of 8 (held-out)", accuracy,
                                ">= 0.9", f"{accuracy:.3f}", details))

    return rows


if __name__ == "__main__":
    common.main(sys.modules[__name__])
