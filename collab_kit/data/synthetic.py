"""Synthetic data made from nothing: the picture world every offline run draws, and codes without a VQGAN.

The picture world (the "toy world"): 64x64 pictures of one shape (circle, square, triangle, diamond, cross) in one of 8
named colours, small or large, at one of 5 places, on a plain neutral background, captioned the way people would say
it: "a small red circle at the top left". The same seed always draws the same pictures. Because the caption says
everything that matters in the picture, a model's drawing can be checked by eye and by number (``dominant_color``:
which named colour covers most of the picture besides its background; ``color_match`` over many). The toy preset
trains on these pictures (collab_kit.toy makes its dataset with the toy VQGAN), and the demo's other presets encode
them with an untrained VQGAN (``make_synthetic_images``).

``make_synthetic_shards`` writes codes directly, with no VQGAN at all, for the tiny and small presets: a shape of one
colour's band of codes on another's, captioned "a red cross on blue".
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from collab_kit.data.shards import write_shard

IMAGE_SIZE = 64

# the 8 named colours a caption can ask for; they are far from each other and from the backgrounds
COLORS: dict[str, tuple] = {
    "red": (220, 40, 40),
    "orange": (245, 140, 30),
    "yellow": (235, 215, 40),
    "green": (40, 170, 70),
    "cyan": (40, 200, 210),
    "blue": (50, 80, 220),
    "purple": (140, 60, 170),
    "pink": (240, 130, 190),
}
# plain backgrounds, never named in captions: a light and a dark grey, and a sand
BACKGROUNDS: dict[str, tuple] = {"light grey": (200, 200, 200), "dark grey": (70, 70, 70), "sand": (225, 210, 175)}
SHAPES = ("circle", "square", "triangle", "diamond", "cross")
SIZES = {"small": 9, "large": 17}  # half the shape's width, in pixels
# where a shape's centre lies (x, y), as a caption says it
POSITIONS = {
    "top left": (17, 17),
    "top right": (47, 17),
    "bottom left": (17, 47),
    "bottom right": (47, 47),
    "center": (32, 32),
}
# pixels a centre may move from its place. 0: the same caption on the same background is always the same picture.
# With 3, a shape lands on 49 alignments of the toy VQGAN's 8-pixel code grid, each a different pattern of codes, and
# the demo's model learnt colour and place but not shape: 0.35 after 240 steps, 0.85 without (a test of the scores still
# moves shapes, tests/data/test_scene_scores.py)
JITTER = 0
# the version of the world's pictures: a made dataset is kept under it (collab_kit.toy.dataset), so a changed world is
# made anew, not read from the cache. 2: no jitter
WORLD_VERSION = 2


@dataclass(frozen=True)
class Scene:
    """What one picture shows; ``caption`` says it in words."""

    shape: str
    color: str
    size: str
    position: str
    background: str
    offset: tuple = (0, 0)  # the jitter of the centre, (dx, dy)

    @property
    def caption(self) -> str:
        where = "in the center" if self.position == "center" else f"at the {self.position}"
        return f"a {self.size} {self.color} {self.shape} {where}"


def random_scene(rng: np.random.Generator) -> Scene:
    pick = lambda options: options[int(rng.integers(len(options)))]  # noqa: E731
    return Scene(
        shape=pick(SHAPES),
        color=pick(list(COLORS)),
        size=pick(list(SIZES)),
        position=pick(list(POSITIONS)),
        background=pick(list(BACKGROUNDS)),
        offset=tuple(int(v) for v in rng.integers(-JITTER, JITTER + 1, size=2)),
    )


def scenes(count: int, seed: int = 0) -> list[Scene]:
    """``count`` random scenes; the same seed gives the same scenes."""
    rng = np.random.default_rng(seed)
    return [random_scene(rng) for _ in range(count)]


def draw(scene: Scene, size: int = IMAGE_SIZE) -> Image.Image:
    """The picture of ``scene``: flat colours, no anti-aliasing, so every pixel is the shape's or the background's."""
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUNDS[scene.background])
    pen, fill = ImageDraw.Draw(image), COLORS[scene.color]
    x, y = POSITIONS[scene.position]
    x, y, r = x + scene.offset[0], y + scene.offset[1], SIZES[scene.size]
    if scene.shape == "circle":
        pen.ellipse([x - r, y - r, x + r, y + r], fill=fill)
    elif scene.shape == "square":
        side = round(r * 0.85)  # a square looks larger than a circle of the same width
        pen.rectangle([x - side, y - side, x + side, y + side], fill=fill)
    elif scene.shape == "triangle":
        pen.polygon([(x, y - r), (x + r, y + r), (x - r, y + r)], fill=fill)
    elif scene.shape == "diamond":
        pen.polygon([(x, y - r), (x + r, y), (x, y + r), (x - r, y)], fill=fill)
    elif scene.shape == "cross":
        arm = max(2, r // 3)
        pen.rectangle([x - r, y - arm, x + r, y + arm], fill=fill)
        pen.rectangle([x - arm, y - r, x + arm, y + r], fill=fill)
    else:
        raise ValueError(f"shape={scene.shape!r} is not known: choose one of {', '.join(SHAPES)}")
    return image if size == IMAGE_SIZE else image.resize((size, size), Image.NEAREST)


def pictures(count: int, seed: int = 0) -> Iterator[tuple]:
    """``(image, caption)`` pairs of ``scenes(count, seed)``."""
    for scene in scenes(count, seed):
        yield draw(scene), scene.caption


# ---------------------------------------------------------------------------------------------
# what a picture shows, measured on its pixels (no model)


NAMED = [*COLORS, *BACKGROUNDS]  # what a pixel of a picture is taken to be: a named colour or a background
_PALETTE = np.array([*COLORS.values(), *BACKGROUNDS.values()], dtype=np.float32)


def nearest_named(image) -> np.ndarray:
    """Each pixel's nearest named colour or background (in RGB), as an index into ``NAMED``, shaped [H, W].

    :param image: a PIL image or an array ``[H, W, 3]`` of 0..255
    """
    pixels = np.asarray(image, dtype=np.float32)[..., :3]
    height, width = pixels.shape[:2]
    nearest = ((pixels.reshape(-1, 1, 3) - _PALETTE[None]) ** 2).sum(-1).argmin(1)
    return nearest.reshape(height, width)


def main_color(grid: np.ndarray, background_share: float = 0.0) -> int | None:
    """The index (into ``NAMED``) of the named colour covering most of ``grid`` (from ``nearest_named``) besides the
    background, the class of the border pixels; None if no colour covers more than ``background_share`` of it."""
    border = np.concatenate([grid[0], grid[-1], grid[:, 0], grid[:, -1]])
    background = np.bincount(border, minlength=len(NAMED)).argmax()
    counts = np.bincount(grid.ravel(), minlength=len(NAMED))[: len(COLORS)].astype(float)
    if background < len(COLORS):
        counts[background] = 0
    if counts.max() <= background_share * grid.size or counts.max() == 0:
        return None
    return int(counts.argmax())


def dominant_color(image, background_share: float = 0.0) -> str | None:
    """The named colour covering most of ``image`` besides its background, or None if there is none.

    Every pixel is taken to the nearest of the named colours and the backgrounds (``nearest_named``), so decoded
    (blurry) pictures work too.

    :param image: a PIL image or an array ``[H, W, 3]`` of 0..255
    """
    index = main_color(nearest_named(image), background_share)
    return None if index is None else NAMED[index]


def prompt_color(prompt: str) -> str | None:
    """The named colour a caption asks for ("a small red circle ..." -> "red"), or None if it names none."""
    words = prompt.lower().replace(",", " ").split()
    named = [word for word in words if word in COLORS]
    return named[0] if named else None


def color_match(images: Sequence, prompts: Sequence[str]) -> float:
    """The share of ``images`` whose dominant colour (``dominant_color``) is the colour of their prompt.

    Chance is 1/8 for a drawing that ignores the prompt. :param images: PIL images (or arrays), one per prompt
    """
    if len(images) != len(prompts) or not images:
        raise ValueError(
            f"expected one prompt per image and at least one image, got {len(images)} images and {len(prompts)} prompts"
        )
    wanted = [prompt_color(prompt) for prompt in prompts]
    if None in wanted:
        raise ValueError(f"the prompt {prompts[wanted.index(None)]!r} names none of the colours {list(COLORS)}")
    return sum(dominant_color(image) == color for image, color in zip(images, wanted)) / len(images)


def world_words() -> list[str]:
    """Every word a toy caption can use."""
    words = {"a", "at", "the", "in", *SHAPES, *COLORS, *SIZES}
    for position in POSITIONS:
        words.update(position.split())
    return sorted(words)


# ---------------------------------------------------------------------------------------------
# the world's pictures as files, and codes without a VQGAN


def write_captioned_images(folder: str, pairs) -> str:
    """Save ``(PIL image, caption)`` pairs as PNG files plus ``captions.jsonl``, what ``collab-kit preprocess`` reads.

    The captions file is written last and atomically: a folder that has it is complete. Returns the folder.
    """
    os.makedirs(folder, exist_ok=True)
    lines = []
    for index, (image, caption) in enumerate(pairs):
        name = f"picture-{index:06d}.png"
        image.save(os.path.join(folder, name))
        lines.append(json.dumps(dict(file=name, caption=caption)))
    tmp_path = os.path.join(folder, "captions.jsonl.tmp")
    with open(tmp_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp_path, os.path.join(folder, "captions.jsonl"))
    return folder


def make_synthetic_images(folder: str, num_samples: int, size: int = IMAGE_SIZE, seed: int = 0) -> str:
    """Write the pictures of ``scenes(num_samples, seed)``, ``size`` pixels wide, as PNG files plus ``captions.jsonl``
    (``write_captioned_images``): what ``collab-kit preprocess`` reads. Returns the folder."""
    return write_captioned_images(folder, ((draw(scene, size), scene.caption) for scene in scenes(num_samples, seed)))


# ---------------------------------------------------------------------------------------------
# codes without a VQGAN: each of the world's colours owns a band of codes, and a shape takes some cells of the grid

CODE_COLORS = tuple(COLORS)
CODE_SHAPES = ("square", "cross", "stripe", "frame")


def _synthetic_image(
    color: int, shape: int, background: int, side: int, codebook_size: int, rng: np.random.Generator
) -> np.ndarray:
    """Codes of a made-up image: a shape of one color on a background of another.

    Each color owns a band of codes; the shape decides which cells take the shape's color. A few
    codes are noise, so the images are learnable but not trivially deterministic.
    """
    band = max(1, codebook_size // len(CODE_COLORS))
    rows, cols = np.mgrid[0:side, 0:side]
    centre, half = side / 2 - 0.5, max(1, side // 4)
    if shape == 0:
        mask = (np.abs(rows - centre) <= half) & (np.abs(cols - centre) <= half)
    elif shape == 1:
        mask = (np.abs(rows - centre) <= 0.5) | (np.abs(cols - centre) <= 0.5)
    elif shape == 2:
        mask = (rows % 2) == 0
    else:
        mask = (rows == 0) | (cols == 0) | (rows == side - 1) | (cols == side - 1)
    codes = np.where(mask, color * band, background * band) + rng.integers(0, min(2, band), size=(side, side))
    noise = rng.random((side, side)) < 0.05
    codes[noise] = rng.integers(0, codebook_size, size=int(noise.sum()))
    return codes.astype(np.int16) % codebook_size


def make_synthetic_shards(
    folder: str, num_samples: int, image_side: int, codebook_size: int, num_shards: int = 4, seed: int = 0
) -> list[str]:
    """Write ``num_samples`` captioned synthetic images as parquet shards; returns their paths.

    Captions read like "a red cross on blue"; the codes follow the caption, so a model that reads
    the caption can learn to predict them.
    """
    rng = np.random.default_rng(seed)
    per_shard = [num_samples // num_shards + (i < num_samples % num_shards) for i in range(num_shards)]
    paths = []
    for shard_index, count in enumerate(per_shard):
        captions, codes = [], []
        for _ in range(count):
            color, background = rng.choice(len(CODE_COLORS), size=2, replace=False)
            shape = int(rng.integers(len(CODE_SHAPES)))
            captions.append(f"a {CODE_COLORS[color]} {CODE_SHAPES[shape]} on {CODE_COLORS[background]}")
            codes.append(_synthetic_image(int(color), shape, int(background), image_side, codebook_size, rng))
        paths.append(
            write_shard(
                os.path.join(folder, f"shard-{shard_index:05d}.parquet"),
                captions,
                codes,
                codebook_size=codebook_size,
                image_side=image_side,
                source_ids=[f"synthetic-{shard_index}-{i}" for i in range(count)],
            )
        )
    return paths


# the data source that names these shards, in a run's settings and on the command line (``--data synthetic``)
SYNTHETIC = "synthetic"
SYNTHETIC_SAMPLES = 4096  # what each peer of a synthetic run makes
_made: dict[tuple, str] = {}
_made_lock = threading.Lock()


def synthetic_shards_folder(image_side: int, codebook_size: int, num_samples: int = SYNTHETIC_SAMPLES) -> str:
    """The folder of ``make_synthetic_shards`` for this code grid and codebook: what ``--data synthetic`` reads.

    Made once per process in a temporary folder, removed when the process exits; every peer makes the same shards
    (the same seed) and reads them in its own order.
    """
    key = (image_side, codebook_size, num_samples)
    with _made_lock:
        if key not in _made:
            folder = tempfile.mkdtemp(prefix="collab_kit_synthetic_")
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            make_synthetic_shards(folder, num_samples, image_side, codebook_size)
            _made[key] = folder
        return _made[key]
