"""From a prompt to a grid of pictures: sample image codes, decode them, keep the ones CLIP likes best.

The paper draws 128 images per prompt (top-k 256 or top-p 0.75), decodes them with the VQGAN and
shows the 4 that CLIP ViT-B/32 finds closest to the prompt (section 3.4)::

    grid = generate_images("a pyramid made of ice", model="user/dalle-run", vqgan="user/vqgan-f8")
    grid.info["clip_scores"]   # the kept images' scores, best first

Each piece can be passed built (a model, a VQGAN, a ClipRanker) or as a location to load it from
(a local folder or a Hub repository id).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from PIL import Image, ImageDraw, ImageFont
from tqdm.auto import tqdm

from collab_kit.data.tokenizers import caption_tokenizer, tokenizer_for_vocabulary
from collab_kit.model.checkpoint import load_checkpoint
from collab_kit.model.clip_rank import ClipRanker
from collab_kit.model.sampling import PAPER_TOP_K, generate_image_codes
from collab_kit.model.vqgan import images_to_pil
from collab_kit.model.vqgan_files import load_vqgan

logger = logging.getLogger(__name__)


def encode_prompt(prompt: str, tokenizer, config) -> list[int]:
    """A caption's token ids, cut or padded to ``config.text_length``.

    :param tokenizer: a caption tokenizer with ``encode(caption, length)``
      (collab_kit.data.tokenizers.caption_tokenizer)
    :param config: the model's ModelConfig
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"expected a prompt: a non-empty string, got {prompt!r}")
    ids = tokenizer.encode(prompt, config.text_length)
    if max(ids) >= config.text_vocab_size:
        raise ValueError(
            f"the tokenizer gave token {max(ids)}, beyond the model's text vocabulary of "
            f"{config.text_vocab_size}: pass the tokenizer the model was trained with"
        )
    return ids


def _load_pieces(model, vqgan, ranker):
    if isinstance(model, str):
        model, run_config, _ = load_checkpoint(model)
        model.caption_tokenizer_name = run_config.data.tokenizer  # the tokenizer it was trained with
    if isinstance(vqgan, str):
        vqgan = load_vqgan(vqgan)
    if isinstance(ranker, str):
        ranker = ClipRanker.from_pretrained(ranker)
    check_vqgan_fits(model.config, vqgan)
    return model, vqgan, ranker


def check_vqgan_fits(model_config, vqgan) -> None:
    """The VQGAN must decode the code grid the model draws (``model_config``: a ModelConfig)."""
    side, codebook = model_config.image_side, model_config.codebook_size
    if vqgan.codebook_size != codebook or vqgan.grid_size != side:
        raise ValueError(
            f"the model draws {side}x{side} codes from {codebook}, but the VQGAN decodes "
            f"{vqgan.grid_size}x{vqgan.grid_size} codes from {vqgan.codebook_size}: "
            f"pass the VQGAN the model's dataset was encoded with"
        )


@torch.no_grad()
def draw_images(
    prompt: str,
    n: int,
    *,
    model,
    vqgan,
    tokenizer=None,
    temperature: float = 1.0,
    top_k: int | None = PAPER_TOP_K,
    top_p: float | None = None,
    batch_size: int = 32,
    seed: int | None = None,
    progress: bool = True,
) -> torch.Tensor:
    """Sample ``n`` images of one prompt: float ``[n, 3, H, W]`` in [0, 1] (no ranking).

    Arguments as in ``generate_images``.
    """
    model, vqgan, _ = _load_pieces(model, vqgan, None)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} is not allowed: expected the number of images to draw, at least 1")
    config = model.config
    if tokenizer is None:
        name = getattr(model, "caption_tokenizer_name", None)
        tokenizer = (
            caption_tokenizer(name, config.pad_token_id)
            if name
            else tokenizer_for_vocabulary(config.text_vocab_size, config.pad_token_id)
        )
    device = next(model.parameters()).device
    caption = torch.tensor(encode_prompt(prompt, tokenizer, config), device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else torch.seed())

    images = []
    with tqdm(
        total=n * config.image_length,
        unit="code",
        unit_scale=True,
        disable=not progress,
        desc=f"drawing {n} image{'s' if n > 1 else ''}",
    ) as bar:
        for start in range(0, n, batch_size):
            count = min(batch_size, n - start)
            codes = generate_image_codes(
                model,
                caption.expand(count, -1),
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                generator=generator,
                progress=lambda _: bar.update(count),
            )
            images.append(vqgan.decode(codes).cpu())
    return torch.cat(images)


def image_grid(images: Sequence[Image.Image], columns: int | None = None) -> Image.Image:
    """Paste equally sized images into a grid, row by row (``columns`` default: as square as possible)."""
    if not images:
        raise ValueError("no images to put in a grid")
    columns = columns or math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / columns)
    width, height = images[0].size
    grid = Image.new("RGB", (columns * width, rows * height), "white")
    for index, image in enumerate(images):
        grid.paste(image, ((index % columns) * width, (index // columns) * height))
    return grid


def generate_images(
    prompt: str,
    n: int = 128,
    keep: int = 4,
    *,
    model,
    vqgan,
    ranker: None | str | object = "openai/clip-vit-base-patch32",
    tokenizer=None,
    temperature: float = 1.0,
    top_k: int | None = PAPER_TOP_K,
    top_p: float | None = None,
    batch_size: int = 32,
    seed: int | None = None,
    columns: int | None = None,
    progress: bool = True,
) -> Image.Image:
    """Draw ``n`` images of ``prompt`` and return the ``keep`` best as one PIL grid.

    :param prompt: what to draw
    :param n: images to sample (the paper: 128)
    :param keep: images CLIP keeps, best first (the paper: 4)
    :param model: a TextToImageTransformer, or a checkpoint location (local folder or Hub repo id)
    :param vqgan: a collab_kit.model.vqgan.VQGAN, or its location (see collab_kit.model.vqgan_files.load_vqgan)
    :param ranker: a collab_kit.model.clip_rank.ClipRanker, a CLIP model name or folder, or None to keep the
      first ``keep`` images unranked
    :param tokenizer: the model's caption tokenizer (default: collab_kit.data.tokenizers.tokenizer_for_vocabulary)
    :param temperature: 0 is greedy (every image alike); 1 samples the model's distribution
    :param top_k: sample among the k most likely codes (the paper: 256); None for all
    :param top_p: sample among the most likely codes reaching probability p (the paper's alternative: 0.75)
    :param batch_size: images sampled at once (memory grows with it: every layer caches keys and values)
    :param seed: for the same images again
    :param columns: of the grid (default: as square as possible)
    :param progress: show progress bars
    :returns: a PIL image; ``grid.info["clip_scores"]`` holds the kept images' scores, best first, and
      ``grid.info["candidate_scores"]`` the scores of all ``n`` drawn images, in the order they were drawn
    """
    if not isinstance(keep, int) or not 1 <= keep <= n:
        raise ValueError(f"keep={keep!r} is not allowed: expected a number of images between 1 and n={n}")
    model, vqgan, ranker = _load_pieces(model, vqgan, ranker)
    images = draw_images(
        prompt,
        n,
        model=model,
        vqgan=vqgan,
        tokenizer=tokenizer,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        batch_size=batch_size,
        seed=seed,
        progress=progress,
    )
    if ranker is None:
        kept, scores, candidate_scores = images[:keep], None, None
    else:
        if progress:
            logger.info(f"ranking {n} images with CLIP")
        # rank all n (best first), keep the first `keep`: the scores of every candidate come back too
        ranked, ranked_scores, order = ranker.rank(prompt, images, keep=n)
        kept, scores = ranked[:keep], ranked_scores[:keep]
        candidate_scores = torch.empty_like(ranked_scores).scatter_(0, order, ranked_scores)  # drawing order
    grid = image_grid(images_to_pil(kept), columns)
    grid.info["clip_scores"] = None if scores is None else [float(s) for s in scores]
    # every drawn image's score, in the order they were drawn (None without a ranker)
    grid.info["candidate_scores"] = None if candidate_scores is None else [float(s) for s in candidate_scores]
    grid.info["prompt"] = prompt
    grid.info["images"] = images_to_pil(kept)  # the kept images one by one, best first
    return grid


def prompt_sheet(
    grids: Sequence[Image.Image], prompts: Sequence[str] | None = None, scale: int = 2, font_size: int = 14
) -> Image.Image:
    """Stack image grids into one picture, each below its prompt (what ``make demo`` saves as samples.png).

    :param grids: one grid per prompt (from ``generate_images``)
    :param prompts: the rows' titles (default: each grid's ``info["prompt"]``)
    :param scale: enlarge the pictures this many times (nearest neighbour, so small pictures stay sharp)
    """
    if not grids:
        raise ValueError("no grids to put on a sheet")
    prompts = list(prompts) if prompts is not None else [grid.info.get("prompt", "") for grid in grids]
    if len(prompts) != len(grids):
        raise ValueError(f"expected one prompt per grid: got {len(prompts)} prompts for {len(grids)} grids")
    font = ImageFont.load_default(size=font_size)
    line = font_size + 8
    grids = [grid.resize((grid.width * scale, grid.height * scale), Image.NEAREST) for grid in grids]
    width = max(max(grid.width for grid in grids), max(int(font.getlength(prompt)) for prompt in prompts) + 8)
    sheet = Image.new("RGB", (width, sum(line + grid.height + 6 for grid in grids)), "white")
    pen, top = ImageDraw.Draw(sheet), 0
    for prompt, grid in zip(prompts, grids):
        pen.text((4, top + 3), prompt, fill="black", font=font)
        sheet.paste(grid, (0, top + line))
        top += line + grid.height + 6
    return sheet
