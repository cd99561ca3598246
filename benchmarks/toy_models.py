"""The toy world's shipped models on held-out pictures (CLIP caption retrieval, VQGAN reconstruction PSNR),
re-measured from the weights in collab_kit/toy/assets, and what CLIP's reranking adds to a trained toy model.

Chance for the retrieval is 1/8; the figures the training scripts stated (metrics.json) are shown beside.
"""

from __future__ import annotations

import itertools
import sys
import time

from benchmarks import common

TITLE = "Toy world: the shipped models on held-out pictures, and CLIP's reranking"
HOW = """
`collab_kit.toy.clip.load_toy_clip()` loads the weights shipped in `collab_kit/toy/assets/clip/` (trained by
`python -m collab_kit.toy.clip --output collab_kit/toy/assets/clip --steps 1500 --threads 1`, its training time in
that folder's `metrics.json`). CLIP: `collab_kit.toy.clip.evaluate_toy_clip` on the held-out
pictures `synthetic.scenes(512, seed=20211206)` (seeds the training never draws): for each picture, its caption against
7
captions of other held-out pictures; the figure is the share where its own caption has the highest cosine (chance
0.125). The details add the colour test (its caption against the 7 same captions in the other colours) and the same
on pictures blurred as a VQGAN reconstruction would be. VQGAN: mean PSNR of decode(encode(x)) against x over its
held-out pictures (`collab_kit.toy.vqgan.evaluate_toy_vqgan`), with the share of reconstructions whose dominant
colour (`synthetic.dominant_color`, pixels only) is still the caption's.

Reranking: a toy-preset model is trained in this process as the demo's swarm trains it, but in a plain loop
(`collab_kit.swarm.lamb.make_lamb8bit` and the preset's linear schedule: 60 steps of 64 pictures from the demo's
cached toy dataset, 2 torch threads, seed 0). Then for 32 prompts (4 per colour, shapes, sizes and places
from `synthetic.scenes(32, seed=4242)`) it draws 32 pictures each (`generate.draw_images`, top-k 32 as in the demo,
seed = prompt index). CLIP's best 4 of the 32 (`ClipRanker.rank`) are set against 4 of the same 32 picked at
random (seeded); the figure is colour match of CLIP's 4 / colour match of the random 4 (target: above 1). The
details give the share over all 32 (the expected colour match of a random 4) and the same after 30 steps,
where the model is less sure of its colours.
"""
RERANK_STEPS, RERANK_CHECKPOINT_STEPS, DRAWS, KEEP, TOP_K = 60, 30, 32, 4, 32


def train_toy_model(steps: int, evaluate_at: dict[int, callable], batch_size: int = 64, threads: int = 2):
    """A toy-preset model trained in a plain loop (no swarm); calls ``evaluate_at[step](model)`` on the way."""
    import torch

    from collab_kit.config import get_preset
    from collab_kit.data.stream import ShardStream, batches
    from collab_kit.data.tokenizers import caption_tokenizer
    from collab_kit.model.transformer import TextToImageTransformer
    from collab_kit.swarm.lamb import make_lamb8bit, make_scheduler_factory, parameter_groups
    from collab_kit.toy.dataset import prepare_toy_dataset

    torch.set_num_threads(threads)
    config = get_preset("toy")
    config.optimizer.total_steps = steps
    torch.manual_seed(0)
    model = TextToImageTransformer(config.model)
    stream = ShardStream(
        prepare_toy_dataset(progress=False),
        config.model.text_length,
        config.model.image_length,
        tokenizer=caption_tokenizer("toy", config.model.pad_token_id),
        seed=0,
        codebook_size=config.model.codebook_size,
    )
    micro = config.optimizer.batch_size_per_step
    optimizer = make_lamb8bit(parameter_groups(model, config.optimizer.weight_decay), config.optimizer)
    schedule = make_scheduler_factory(config.optimizer)(optimizer)
    micro_batches = batches(stream, micro)
    results = {}
    for step in range(1, steps + 1):
        model.train()
        for batch in itertools.islice(micro_batches, batch_size // micro):
            (model(**batch).loss * micro / batch_size).backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step in evaluate_at:
            model.eval()
            results[step] = evaluate_at[step](model)
    return results


def rerank_colour_match(model) -> dict[str, float]:
    """Colour match of CLIP's best 4 of 32, of a random 4 of the same 32, and of all 32, over 32 prompts."""
    import numpy as np

    from collab_kit.data import synthetic
    from collab_kit.data.tokenizers import ToyTokenizer
    from collab_kit.images.generate import draw_images
    from collab_kit.model.vqgan import images_to_pil
    from collab_kit.toy.clip import load_toy_clip
    from collab_kit.toy.vqgan import load_toy_vqgan

    vqgan, ranker, tokenizer = load_toy_vqgan(), load_toy_clip(), ToyTokenizer()
    prompts = [
        scene.caption
        for colour in synthetic.COLORS
        for scene in [s for s in synthetic.scenes(400, seed=4242) if s.color == colour][:4]
    ]
    rng = np.random.default_rng(0)
    reranked, random_four, every = [], [], []
    for index, prompt in enumerate(prompts):
        pictures = draw_images(
            prompt, DRAWS, model=model, vqgan=vqgan, tokenizer=tokenizer, top_k=TOP_K, seed=index, progress=False
        )
        matches = [
            synthetic.dominant_color(picture) == synthetic.prompt_color(prompt) for picture in images_to_pil(pictures)
        ]
        _, _, best = ranker.rank(prompt, pictures, keep=KEEP)
        reranked += [matches[int(i)] for i in best[:KEEP]]
        random_four += [matches[int(i)] for i in rng.choice(DRAWS, KEEP, replace=False)]
        every += matches
    return dict(
        reranked=float(np.mean(reranked)),
        random=float(np.mean(random_four)),
        every=float(np.mean(every)),
        prompts=len(prompts),
    )


def run(quick: bool = False) -> list[dict]:
    rows = []
    from collab_kit.toy.clip import evaluate_toy_clip, load_toy_clip, toy_clip_metrics

    ranker, stated = load_toy_clip(), toy_clip_metrics()
    count = 128 if quick else stated["held_out"]
    sharp = evaluate_toy_clip(ranker, count=count, seed=stated["held_out_seed"])
    blurred = evaluate_toy_clip(ranker, count=count, seed=stated["held_out_seed"], blurred=True)
    accuracy = sharp["retrieval_accuracy_of_8"]
    print(f"  toy CLIP: right caption of 8 {accuracy:.3f}, colour of 8 {sharp['colour_accuracy_of_8']:.3f}", flush=True)
    details = (
        f"{count} held-out pictures: right caption of 8 {accuracy:.3f} "
        f"(stated {stated['retrieval_accuracy_of_8']:.3f}, "
        f"chance 0.125), right colour of 8 {sharp['colour_accuracy_of_8']:.3f}, shape of 5 "
        f"{sharp['shape_accuracy_of_5']:.3f}; blurred pictures: caption {blurred['retrieval_accuracy_of_8']:.3f}, "
        f"colour {blurred['colour_accuracy_of_8']:.3f}. Trained {stated['steps']} steps of batch "
        f"{stated['batch_size']} in {stated['train_seconds'] / 60:.1f} min on one CPU thread; "
        f"{stated['parameters'] / 1e6:.2f} M parameters."
    )
    rows.append(
        common.make_row(
            __spec__.name,
            "toy CLIP caption retrieval, right caption of 8 (held-out)",
            accuracy,
            ">= 0.9",
            f"{accuracy:.3f}",
            details,
        )
    )

    from collab_kit.toy.vqgan import EDGE_WEIGHT, evaluate_toy_vqgan, load_toy_vqgan, toy_vqgan_metrics

    stated = toy_vqgan_metrics()
    measured = evaluate_toy_vqgan(
        load_toy_vqgan(), count=64 if quick else stated["held_out"], seed=stated["held_out_seed"]
    )
    print(f"  toy VQGAN: {measured['psnr_db']:.2f} dB", flush=True)
    rows.append(
        common.make_row(
            __spec__.name,
            "toy VQGAN reconstruction PSNR, dB (held-out)",
            measured["psnr_db"],
            ">= 25",
            f"{measured['psnr_db']:.2f} dB",
            f"{measured['held_out']} held-out pictures (seed {measured['held_out_seed']}): "
            f"{measured['psnr_db']:.2f} dB "
            f"(stated {stated['psnr_db']:.2f}), the caption's colour kept in {measured['color_match']:.3f} of the "
            f"reconstructions, {measured['codes_used']} of {stated['codebook_size']} codes used. Trained "
            f"{stated['steps']} steps of batch {stated['batch_size']} in {stated['train_seconds'] / 60:.1f} min on "
            f"{stated['torch_threads']} CPU thread(s).",
        )
    )
    print(f"  toy VQGAN: shape kept in {measured['shape_match']:.3f} of the reconstructions", flush=True)
    rows.append(
        common.make_row(
            __spec__.name,
            "toy VQGAN: reconstructions that keep the picture's shape (held-out; the most a toy model can draw)",
            measured["shape_match"],
            ">= 0.8",
            f"{measured['shape_match']:.3f}",
            f"{measured['held_out']} held-out pictures, decode(encode(x)) read by collab_kit.data.scene_scores: "
            f"shape {measured['shape_match']:.3f} (stated {stated['shape_match']:.3f}), place "
            f"{measured['place_match']:.3f}, size {measured['size_match']:.3f}. The edges weigh 1 + "
            f"{EDGE_WEIGHT:g} in the training loss; with an even loss the shipped model kept 0.695 of the shapes.",
        )
    )

    steps, early = (4, 2) if quick else (RERANK_STEPS, RERANK_CHECKPOINT_STEPS)
    started = time.perf_counter()
    results = train_toy_model(steps, {early: rerank_colour_match, steps: rerank_colour_match})
    final, half = results[steps], results[early]
    ratio = final["reranked"] / max(final["random"], 1e-9)
    print(
        f"  reranking: CLIP's best {KEEP} of {DRAWS} {final['reranked']:.3f}, random {KEEP} {final['random']:.3f}",
        flush=True,
    )
    rows.append(
        common.make_row(
            __spec__.name,
            f"toy colour match, CLIP's best {KEEP} of {DRAWS} / a random {KEEP} of the same (trained toy model)",
            ratio,
            "> 1",
            f"{ratio:.2f}x",
            f"{final['prompts']} prompts x {DRAWS} pictures, model after {steps} steps of 64: CLIP's best {KEEP} "
            f"{final['reranked']:.3f}, random {KEEP} {final['random']:.3f}, all {DRAWS} {final['every']:.3f}; after "
            f"{early} steps: CLIP's {half['reranked']:.3f}, random {half['random']:.3f}, all {half['every']:.3f} "
            f"(chance 0.125). Training and drawing took {time.perf_counter() - started:.0f} s.",
        )
    )
    return rows


if __name__ == "__main__":
    common.main(sys.modules[__name__])
