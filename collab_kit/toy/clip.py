"""A tiny CLIP of the toy world, trained here, shipped with the package: the demo ranks toy pictures with it.

The paper keeps CLIP's best 4 of 128 generated images. OpenAI's CLIP cannot be downloaded offline and
knows nothing of the toy world anyway, so the kit trains a CLIP of its own (transformers' ``CLIPModel``
at toy sizes, about 1M parameters) on ``collab_kit.data.synthetic`` pictures and their captions:

    collab-kit toy train-clip --output collab_kit/toy/assets/clip      # ~17 minutes on one CPU core

and ships the result (under 10 MB) in ``collab_kit/toy/assets/clip``, so nothing is trained at demo time:

    ranker = load_toy_clip()                                             # a ClipRanker
    best, scores, order = ranker.rank("a small red circle at the top left", images, keep=4)

The images it ranks are decoded by a toy VQGAN, so they are blurry: training degrades part of every
batch (gaussian blur, shrinking and enlarging again, noise, a slight colour cast) so that CLIP learns
to read blurry pictures as well as sharp ones. Each batch holds distinct captions (a repeated caption
would be a false negative of the contrastive loss).

Held-out pictures (a seed training never uses) measure it: for each picture, does its own caption
score above 7 captions of other pictures (``retrieval_accuracy_of_8``), and above the same caption
in each of the 7 other colours (``colour_accuracy_of_8``)? Shapes, sizes and positions are measured
the same way. ``train_toy_clip`` writes these figures to ``metrics.json`` next to the weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing
from tqdm.auto import tqdm
from transformers import CLIPConfig, CLIPModel

from collab_kit.data import synthetic
from collab_kit.data.tokenizers import ToyTokenizer
from collab_kit.model.clip_rank import ClipRanker

logger = logging.getLogger(__name__)

TOY_CLIP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "clip")
METRICS_FILE = "metrics.json"
MAX_TEXT_LENGTH = 16  # the longest toy caption is 8 words + [EOS]
HELD_OUT_SEED = 20211206  # the pictures measured, never trained on (training seeds start at TRAIN_SEED_BASE)
HELD_OUT_COUNT = 512
# training pictures of step s with seed k: synthetic.scenes(..., TRAIN_SEED_BASE + k * 10**6 + s)
TRAIN_SEED_BASE = 1_000_000_000
NUM_CANDIDATES = 8  # captions a picture is matched against in the retrieval accuracy
# the attributes a caption names, and the field of synthetic.Scene that holds each
ATTRIBUTES = {
    "colour": ("color", tuple(synthetic.COLORS)),
    "shape": ("shape", tuple(synthetic.SHAPES)),
    "size": ("size", tuple(synthetic.SIZES)),
    "position": ("position", tuple(synthetic.POSITIONS)),
}


def toy_clip_config(vocab_size: int | None = None) -> CLIPConfig:
    """The toy CLIP's shape: a ViT of 4 layers (hidden 128) over 64x64 pictures in 8x8 patches, a text encoder of 2
    layers (hidden 64) over up to 16 word tokens, both projected to 64 dimensions. About 0.94M parameters (3.8 MB).

    :param vocab_size: the caption vocabulary (default: ``ToyTokenizer().vocab_size``)
    """
    vocab_size = vocab_size if vocab_size is not None else ToyTokenizer().vocab_size
    ids = dict(
        pad_token_id=ToyTokenizer.pad_token_id,
        eos_token_id=ToyTokenizer.eos_token_id,
        bos_token_id=ToyTokenizer.eos_token_id,
    )  # no start token: captions start with their first word
    # the text encoder pools the hidden state of the first eos_token_id; 1 is [EOS] here (2 would mean "argmax")
    return CLIPConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=MAX_TEXT_LENGTH,
            **ids,
        ),
        vision_config=dict(
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            image_size=synthetic.IMAGE_SIZE,
            patch_size=8,
        ),
        projection_dim=64,
    )


def toy_clip_tokenizer():
    """The toy world's word-level tokenizer as a transformers tokenizer, for :class:`ClipRanker`.

    The same ids as ``ToyTokenizer``; calling it appends ``[EOS]`` (CLIP's text encoder pools there) and
    pads with ``[PAD]``. It saves to and loads from ``tokenizer.json`` like any transformers tokenizer.
    """
    # lazy: transformers takes seconds to import; only this needs it
    from transformers import PreTrainedTokenizerFast

    words = ToyTokenizer()
    backend = Tokenizer.from_str(words.tokenizer.to_str())  # a copy: ToyTokenizer's own stays without [EOS]
    backend.post_processor = TemplateProcessing(
        single=f"$A {words.eos_token}", special_tokens=[(words.eos_token, words.eos_token_id)]
    )
    # model_input_names: CLIP's text encoder takes no token_type_ids
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=words.pad_token,
        eos_token=words.eos_token,
        unk_token=words.unk_token,
        model_max_length=MAX_TEXT_LENGTH,
        model_input_names=["input_ids", "attention_mask"],
    )


def new_toy_clip(seed: int = 0) -> ClipRanker:
    """An untrained toy CLIP (random weights from ``seed``) with its tokenizer; the global torch RNG is left as it
    was."""
    tokenizer = toy_clip_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(toy_clip_config(len(tokenizer)))
    return ClipRanker(model, tokenizer)


# ---------------------------------------------------------------------------------------------
# pictures in, degraded like a VQGAN's reconstructions


def scene_pixels(scenes: Sequence[synthetic.Scene]) -> torch.Tensor:
    """The pictures of ``scenes`` as float ``[n, 3, 64, 64]`` in [0, 1]."""
    array = np.stack([np.asarray(synthetic.draw(scene), dtype=np.uint8) for scene in scenes])
    return torch.from_numpy(array).permute(0, 3, 1, 2).float() / 255.0


def _gaussian_blur(pixels: torch.Tensor, sigma: float) -> torch.Tensor:
    radius = max(1, int(math.ceil(2.5 * sigma)))
    offsets = torch.arange(-radius, radius + 1, dtype=pixels.dtype)
    kernel = torch.exp(-0.5 * (offsets / sigma) ** 2)
    kernel = kernel / kernel.sum()
    channels = pixels.shape[1]
    # separable: rows then columns; replicate padding keeps the border the background's colour
    padded = F.pad(pixels, (radius, radius, radius, radius), mode="replicate")
    rows = F.conv2d(padded, kernel.view(1, 1, 1, -1).expand(channels, 1, 1, -1).contiguous(), groups=channels)
    return F.conv2d(rows, kernel.view(1, 1, -1, 1).expand(channels, 1, -1, 1).contiguous(), groups=channels)


def degrade(pixels: torch.Tensor, generator: torch.Generator, share: float = 0.6) -> torch.Tensor:
    """Make about ``share`` of the pictures look decoded by a VQGAN: blurred, shrunk and enlarged, noisy, off-colour.

    Each picture chosen gets each of the four, independently, with probability 1/2 (at least one of them).

    :param pixels: float ``[n, 3, H, W]`` in [0, 1]
    :param generator: the random choices come from it (a CPU ``torch.Generator``)
    :param share: the expected share of pictures degraded; the others stay sharp
    """
    n = pixels.shape[0]
    chosen = torch.rand(n, generator=generator) < share
    ops = (torch.rand(n, 4, generator=generator) < 0.5) & chosen[:, None]
    ops[chosen & ~ops.any(1), 0] = True  # a picture chosen is degraded somehow
    out = pixels.clone()
    # a few blur strengths and shrink factors, so that each is one batched call
    blur_level = torch.randint(0, 3, (n,), generator=generator)
    for level, sigma in enumerate((0.8, 1.3, 2.0)):
        index = (ops[:, 0] & (blur_level == level)).nonzero().flatten()
        if len(index):
            out[index] = _gaussian_blur(out[index], sigma)
    shrink = torch.randint(0, 3, (n,), generator=generator)
    size = pixels.shape[-1]
    for level, factor in enumerate((2, 3, 4)):
        index = (ops[:, 1] & (shrink == level)).nonzero().flatten()
        if len(index):
            small = F.interpolate(out[index], size=size // factor, mode="area")
            out[index] = F.interpolate(small, size=size, mode="bilinear", align_corners=False)
    # a colour cast of a few percent: a VQGAN's colours drift a little, but not into another named colour
    cast = 1 + 0.12 * (torch.rand(n, 3, 1, 1, generator=generator) - 0.5)
    out = torch.where(ops[:, 2, None, None, None], out * cast, out)
    noise = torch.randn(out.shape, generator=generator) * (0.06 * torch.rand(n, 1, 1, 1, generator=generator))
    out = torch.where(ops[:, 3, None, None, None], out + noise, out)
    return out.clamp(0.0, 1.0)


def fixed_blur(pixels: torch.Tensor) -> torch.Tensor:
    """One fixed, fairly strong degradation (shrunk 3x, enlarged, blurred with sigma 1): the "blurred" figures."""
    small = F.interpolate(pixels, size=pixels.shape[-1] // 3, mode="area")
    return _gaussian_blur(F.interpolate(small, size=pixels.shape[-1], mode="bilinear", align_corners=False), 1.0)


def training_scenes(batch_size: int, seed: int, step: int) -> list[synthetic.Scene]:
    """``batch_size`` scenes with distinct captions (as far as the world allows) for training step ``step``."""
    scenes_seed = TRAIN_SEED_BASE + seed * 10**6 + step
    chosen, seen = [], set()
    for scene in synthetic.scenes(4 * batch_size, seed=scenes_seed):
        if scene.caption not in seen:
            seen.add(scene.caption)
            chosen.append(scene)
            if len(chosen) == batch_size:
                return chosen
    # a batch larger than the world's captions (400) repeats some: top it up with pictures of repeated captions
    extra = synthetic.scenes(batch_size - len(chosen), seed=scenes_seed + 10**9)
    return chosen + extra


# ---------------------------------------------------------------------------------------------
# measuring


@torch.inference_mode()
def _embed_texts(ranker: ClipRanker, captions: Sequence[str], batch_size: int = 256) -> torch.Tensor:
    out = []
    for start in range(0, len(captions), batch_size):
        text = ranker.tokenizer(
            list(captions[start : start + batch_size]),
            padding=True,
            truncation=True,
            max_length=ranker.max_text_length,
            return_tensors="pt",
        ).to(ranker.device)
        embedding = ranker.model.get_text_features(**text)
        embedding = embedding if isinstance(embedding, torch.Tensor) else embedding.pooler_output
        out.append(F.normalize(embedding.float(), dim=-1).cpu())
    return torch.cat(out)


@torch.inference_mode()
def _embed_images(ranker: ClipRanker, pixels: torch.Tensor, batch_size: int = 128) -> torch.Tensor:
    out = []
    for start in range(0, len(pixels), batch_size):
        embedding = ranker.model.get_image_features(pixel_values=ranker.preprocess(pixels[start : start + batch_size]))
        embedding = embedding if isinstance(embedding, torch.Tensor) else embedding.pooler_output
        out.append(F.normalize(embedding.float(), dim=-1).cpu())
    return torch.cat(out)


def evaluate_toy_clip(
    ranker: ClipRanker, count: int = HELD_OUT_COUNT, seed: int = HELD_OUT_SEED, blurred: bool = False
) -> dict[str, float]:
    """How often the right caption of a held-out picture scores highest (cosines, as ``ClipRanker.score``).

    ``retrieval_accuracy_of_8``: against 7 captions of other held-out pictures (distinct, seeded); then
    ``colour_accuracy_of_8``, ``shape_accuracy_of_5``, ``size_accuracy_of_2``, ``position_accuracy_of_5``: against
    the same caption with each other value of that attribute.

    :param ranker: the CLIP to measure
    :param count: the number of held-out pictures, ``synthetic.scenes(count, seed)``
    :param seed: their seed; keep it away from the training seeds (``TRAIN_SEED_BASE`` and above)
    :param blurred: measure on the pictures degraded by :func:`fixed_blur` instead of the sharp ones
    """
    if seed >= TRAIN_SEED_BASE:
        raise ValueError(f"seed={seed} may be a training seed: held-out seeds must be below {TRAIN_SEED_BASE}")
    scenes = synthetic.scenes(count, seed=seed)
    captions = [scene.caption for scene in scenes]
    distinct = sorted(set(captions))
    if len(distinct) < NUM_CANDIDATES:
        raise ValueError(
            f"count={count} held-out pictures have {len(distinct)} distinct captions; the retrieval "
            f"accuracy needs at least {NUM_CANDIDATES}: measure more pictures"
        )
    # every caption that can be asked about: the world's 400, so each is embedded once
    world = [
        synthetic.Scene(shape, color, size, position, "sand").caption
        for shape in synthetic.SHAPES
        for color in synthetic.COLORS
        for size in synthetic.SIZES
        for position in synthetic.POSITIONS
    ]
    text_index = {caption: i for i, caption in enumerate(world)}
    unknown = set(captions) - set(text_index)
    if unknown:
        raise RuntimeError(f"held-out captions outside the world's: {sorted(unknown)[:3]}")
    pixels = scene_pixels(scenes)
    image_embeddings = _embed_images(ranker, fixed_blur(pixels) if blurred else pixels)
    similarity = image_embeddings @ _embed_texts(ranker, world).T  # [count, 400]

    def accuracy(candidates: list[list[str]]) -> float:
        # candidates[i][0] is picture i's own caption; it must beat every other one strictly
        index = torch.tensor([[text_index[c] for c in row] for row in candidates])
        scores = similarity.gather(1, index)
        return float((scores[:, 0] > scores[:, 1:].max(1).values).float().mean())

    rng = np.random.default_rng(seed)
    retrieval = []
    for caption in captions:
        others = [c for c in distinct if c != caption]
        retrieval.append([caption] + [others[i] for i in rng.choice(len(others), NUM_CANDIDATES - 1, replace=False)])
    metrics = {f"retrieval_accuracy_of_{NUM_CANDIDATES}": accuracy(retrieval)}
    for name, (field, values) in ATTRIBUTES.items():
        rows = [
            [scene.caption]
            + [
                dataclasses.replace(scene, **{field: value}).caption
                for value in values
                if value != getattr(scene, field)
            ]
            for scene in scenes
        ]
        metrics[f"{name}_accuracy_of_{len(values)}"] = accuracy(rows)
    return metrics


# ---------------------------------------------------------------------------------------------
# training


def train_toy_clip(
    output_folder: str,
    steps: int = 1500,
    batch_size: int = 128,
    seed: int = 0,
    lr: float = 1e-3,
    progress: bool = True,
    held_out: int = HELD_OUT_COUNT,
    held_out_seed: int = HELD_OUT_SEED,
    degrade_share: float = 0.6,
) -> dict[str, object]:
    """Train the toy CLIP contrastively on toy pictures, measure it on held-out ones, save it with its figures.

    Writes ``output_folder``: the model and tokenizer (``ClipRanker.save_pretrained``, loadable offline with
    ``ClipRanker.from_pretrained``) and ``metrics.json`` (the dict returned). Prints a one-line summary.

    :param output_folder: where to write; created if missing, existing files of the same names replaced
    :param steps: optimizer steps (about 0.6-0.7 s each at batch 128 on one CPU core)
    :param batch_size: pictures per step, each with a distinct caption where the world allows (400 captions)
    :param seed: the seed of the initial weights, of the training pictures and of their degradation
    :param lr: the peak learning rate of AdamW (linear warm-up over 5% of the steps, then cosine to 0)
    :param progress: show a progress bar
    :param held_out: the number of held-out pictures measured
    :param held_out_seed: their seed (never a training seed)
    :param degrade_share: the share of each batch degraded to look like a VQGAN's reconstruction
    """
    if steps < 1 or batch_size < 2:
        raise ValueError(
            f"steps={steps}, batch_size={batch_size}: expected steps >= 1 and batch_size >= 2 "
            f"(contrastive learning needs other pictures in the batch)"
        )
    if held_out_seed >= TRAIN_SEED_BASE:
        raise ValueError(
            f"held_out_seed={held_out_seed} may collide with the training seeds "
            f"(from {TRAIN_SEED_BASE}): choose a smaller one"
        )
    ranker = new_toy_clip(seed)
    model, tokenizer = ranker.model.train(), ranker.tokenizer
    # no weight decay on biases, norms, embeddings of positions and the temperature, as CLIP
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embedding" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embedding" not in n)]
    optimizer = torch.optim.AdamW(
        [dict(params=decay, weight_decay=0.1), dict(params=no_decay, weight_decay=0.0)],
        lr=lr,
        betas=(0.9, 0.98),
        eps=1e-6,
    )
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(
            (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, max(0, s + 1 - warmup) / max(1, steps - warmup))))
        ),
    )
    generator = torch.Generator().manual_seed(seed)
    started, losses = time.perf_counter(), []
    bar = tqdm(range(steps), desc="toy CLIP", disable=not progress)
    for step in bar:
        scenes = training_scenes(batch_size, seed, step)
        pixels = degrade(scene_pixels(scenes), generator, share=degrade_share)
        text = tokenizer([scene.caption for scene in scenes], padding=True, return_tensors="pt")
        loss = model(**text, pixel_values=ranker.preprocess(pixels), return_loss=True).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        with torch.no_grad():  # CLIP caps its temperature at 100 so that the logits cannot blow up
            model.logit_scale.clamp_(0, math.log(100))
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}", refresh=False)
    train_seconds = time.perf_counter() - started
    model.eval()

    sharp = evaluate_toy_clip(ranker, held_out, held_out_seed)
    blurred = evaluate_toy_clip(ranker, held_out, held_out_seed, blurred=True)
    metrics: dict[str, object] = dict(sharp)
    metrics["colour_accuracy_of_8"] = sharp["colour_accuracy_of_8"]  # (named here too: the figure the demo needs)
    metrics.update({f"blurred_{name}": value for name, value in blurred.items()})
    metrics.update(
        held_out=held_out,
        held_out_seed=held_out_seed,
        steps=steps,
        batch_size=batch_size,
        seed=seed,
        lr=lr,
        final_loss=float(np.mean(losses[-50:])),
        train_seconds=round(train_seconds, 1),
        parameters=sum(p.numel() for p in model.parameters()),
    )
    os.makedirs(output_folder, exist_ok=True)
    ranker.save_pretrained(output_folder)
    with open(os.path.join(output_folder, METRICS_FILE + ".tmp"), "w") as f:
        json.dump(metrics, f, indent=2)
    os.replace(os.path.join(output_folder, METRICS_FILE + ".tmp"), os.path.join(output_folder, METRICS_FILE))
    # safetensors writes its file readable by its owner only; a file shipped in the package must be readable by all
    mode = os.stat(os.path.join(output_folder, METRICS_FILE)).st_mode  # what this umask gives a plain file
    for name in os.listdir(output_folder):
        os.chmod(os.path.join(output_folder, name), mode)
    print(
        f"toy CLIP: steps={steps} batch={batch_size} {train_seconds:.0f}s loss={metrics['final_loss']:.3f} "
        f"held_out={held_out} retrieval_of_8={sharp['retrieval_accuracy_of_8']:.3f} "
        f"colour_of_8={sharp['colour_accuracy_of_8']:.3f} shape_of_5={sharp['shape_accuracy_of_5']:.3f} "
        f"size_of_2={sharp['size_accuracy_of_2']:.3f} position_of_5={sharp['position_accuracy_of_5']:.3f} "
        f"blurred_retrieval_of_8={blurred['retrieval_accuracy_of_8']:.3f} "
        f"blurred_colour_of_8={blurred['colour_accuracy_of_8']:.3f} -> {output_folder}",
        flush=True,
    )
    return metrics


# ---------------------------------------------------------------------------------------------
# the shipped CLIP


def _missing(folder: str) -> str | None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", METRICS_FILE):
        if not os.path.isfile(os.path.join(folder, name)):
            return name
    return None


def load_toy_clip(folder: str = TOY_CLIP_DIR, device: str | None = None) -> ClipRanker:
    """The toy CLIP shipped with the package (or trained into ``folder``) as a :class:`ClipRanker`, offline.

    :param folder: a folder written by :func:`train_toy_clip` (default: the one shipped in the package)
    :param device: where to run it (default: the GPU if there is one, else the CPU)
    """
    missing = _missing(folder)
    if missing is not None:
        raise FileNotFoundError(
            f"no toy CLIP in {folder} ({missing} is missing): train one with "
            f"`collab-kit toy train-clip --output {folder}` (about 17 minutes on one CPU core)"
        )
    return ClipRanker.from_pretrained(folder, device=device)


def toy_clip_metrics(folder: str = TOY_CLIP_DIR) -> dict[str, object]:
    """The figures :func:`train_toy_clip` measured for the CLIP in ``folder`` (``metrics.json``)."""
    path = os.path.join(folder, METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no {METRICS_FILE} in {folder}: train a toy CLIP with `collab-kit toy train-clip --output {folder}`"
        )
    with open(path) as f:
        return json.load(f)


def main(argv: Sequence[str] | None = None) -> int:
    """``collab-kit toy train-clip``: train the toy CLIP and write it with its held-out figures."""
    parser = argparse.ArgumentParser(prog="collab-kit toy train-clip", description=main.__doc__)
    parser.add_argument("--output", default=TOY_CLIP_DIR, help="the folder to write (default: the package's own)")
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps (~0.7 s each on one CPU core)")
    parser.add_argument("--batch-size", type=int, default=128, help="pictures per step")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the training pictures")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--held-out", type=int, default=HELD_OUT_COUNT, help="held-out pictures measured")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    train_toy_clip(
        args.output,
        steps=args.steps,
        batch_size=args.batch_size,
        seed=args.seed,
        lr=args.lr,
        progress=not args.no_progress,
        held_out=args.held_out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
