"""The toy world: procedurally drawn, captioned shapes, where every part of the real pipeline can run offline.

Nothing real can be downloaded here (LAION, the VQGAN, CLIP), so the kit carries a small world of
its own: 64x64 pictures of one shape (circle, square, triangle, diamond, cross) in one of 8 named
colours, small or large, at one of 5 places, on a plain neutral background, captioned the way
people would say it: "a small red circle at the top left". The same seed always draws the same
pictures. Because the caption says everything that matters in the picture, a model's drawing can be
checked by eye and by number (``dominant_color``: which named colour covers most of the picture
besides its background).

``ToyTokenizer`` is the world's word-level caption tokenizer (built with ``tokenizers``).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 64

# the 8 named colours a caption can ask for; they are far from each other and from the backgrounds
COLORS: Dict[str, tuple] = {
    "red": (220, 40, 40), "orange": (245, 140, 30), "yellow": (235, 215, 40), "green": (40, 170, 70),
    "cyan": (40, 200, 210), "blue": (50, 80, 220), "purple": (140, 60, 170), "pink": (240, 130, 190),
}
# plain backgrounds, never named in captions: a light and a dark grey, and a sand
BACKGROUNDS: Dict[str, tuple] = {"light grey": (200, 200, 200), "dark grey": (70, 70, 70), "sand": (225, 210, 175)}
SHAPES = ("circle", "square", "triangle", "diamond", "cross")
SIZES = {"small": 9, "large": 17}  # half the shape's width, in pixels
# where a shape's centre lies (x, y), as a caption says it
POSITIONS = {"top left": (17, 17), "top right": (47, 17), "bottom left": (17, 47), "bottom right": (47, 47),
             "center": (32, 32)}
JITTER = 3  # pixels a centre may move, so no two pictures of one caption are quite alike


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
    return Scene(shape=pick(SHAPES), color=pick(list(COLORS)), size=pick(list(SIZES)),
                 position=pick(list(POSITIONS)), background=pick(list(BACKGROUNDS)),
                 offset=tuple(int(v) for v in rng.integers(-JITTER, JITTER + 1, size=2)))


def scenes(count: int, seed: int = 0) -> List[Scene]:
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


def write_toy_images(folder: str, count: int, seed: int = 0) -> str:
    """``count`` pictures as PNG files plus ``captions.jsonl``: what ``collab-kit preprocess`` reads. Returns the folder."""
    from collab_kit.data import write_captioned_images

    return write_captioned_images(folder, pictures(count, seed))


# ---------------------------------------------------------------------------------------------
# what a picture shows, measured on its pixels (no model)


def dominant_color(image, background_share: float = 0.0) -> Optional[str]:
    """The named colour covering most of ``image`` besides its background, or None if there is none.

    Every pixel is assigned to the nearest of the named colours and the backgrounds (in RGB); the
    background is the class of the border pixels. Works on decoded (blurry) pictures too.

    :param image: a PIL image or an array ``[H, W, 3]`` of 0..255
    """
    pixels = np.asarray(image, dtype=np.float32).reshape(-1, 3) if not isinstance(image, np.ndarray) else \
        image.astype(np.float32).reshape(-1, 3)
    names = list(COLORS) + list(BACKGROUNDS)
    palette = np.array([*COLORS.values(), *BACKGROUNDS.values()], dtype=np.float32)
    nearest = ((pixels[:, None, :] - palette[None]) ** 2).sum(-1).argmin(1)
    side = int(round(np.sqrt(len(pixels))))
    grid = nearest.reshape(side, -1)
    border = np.concatenate([grid[0], grid[-1], grid[:, 0], grid[:, -1]])
    background = np.bincount(border, minlength=len(names)).argmax()
    counts = np.bincount(nearest, minlength=len(names))[: len(COLORS)].astype(float)
    if background < len(COLORS):
        counts[background] = 0
    if counts.max() <= background_share * len(nearest) or counts.max() == 0:
        return None
    return names[int(counts.argmax())]


def prompt_color(prompt: str) -> Optional[str]:
    """The named colour a caption asks for ("a small red circle ..." -> "red"), or None if it names none."""
    words = prompt.lower().replace(",", " ").split()
    named = [word for word in words if word in COLORS]
    return named[0] if named else None


def color_match(images: Sequence, prompts: Sequence[str]) -> float:
    """The share of ``images`` whose dominant colour (``dominant_color``) is the colour of their prompt.

    Chance is 1/8 for a drawing that ignores the prompt. :param images: PIL images (or arrays), one per prompt
    """
    if len(images) != len(prompts) or not images:
        raise ValueError(f"expected one prompt per image and at least one image, got {len(images)} images and "
                         f"{len(prompts)} prompts")
    wanted = [prompt_color(prompt) for prompt in prompts]
    if None in wanted:
        raise ValueError(f"the prompt {prompts[wanted.index(None)]!r} names none of the colours {list(COLORS)}")
    return sum(dominant_color(image) == color for image, color in zip(images, wanted)) / len(images)


# ---------------------------------------------------------------------------------------------
# the world's caption tokenizer


class ToyTokenizer:
    """Word-level tokenizer of the toy world's captions (``tokenizers``' WordLevel model).

    Ids: 0 = pad, 1 = end of caption, 2 = unknown word, then the world's words in sorted order.
    ``encode(caption, length)`` / ``decode(ids)`` as collab_kit.data.ByteCaptionTokenizer.
    """

    pad_token, eos_token, unk_token = "[PAD]", "[EOS]", "[UNK]"
    pad_token_id, eos_token_id, unk_token_id = 0, 1, 2

    def __init__(self, words: Optional[Sequence[str]] = None):
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel
        from tokenizers.normalizers import Lowercase
        from tokenizers.pre_tokenizers import WhitespaceSplit

        words = sorted(set(words if words is not None else world_words()))
        vocab = {self.pad_token: 0, self.eos_token: 1, self.unk_token: 2}
        vocab.update({word: index + 3 for index, word in enumerate(words)})
        self.tokenizer = Tokenizer(WordLevel(vocab, unk_token=self.unk_token))
        self.tokenizer.normalizer = Lowercase()
        self.tokenizer.pre_tokenizer = WhitespaceSplit()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, caption: str, length: int) -> List[int]:
        ids = self.tokenizer.encode(caption).ids[: length - 1] + [self.eos_token_id]
        return ids + [self.pad_token_id] * (length - len(ids))

    def decode(self, ids: Sequence[int]) -> str:
        words = []
        for token in ids:
            if token == self.eos_token_id:
                break
            if token != self.pad_token_id:
                words.append(self.tokenizer.id_to_token(int(token)))
        return " ".join(words)

    def save(self, path: str) -> str:
        self.tokenizer.save(path)
        return path

    @classmethod
    def load(cls, path: str) -> "ToyTokenizer":
        from tokenizers import Tokenizer

        tokenizer = cls.__new__(cls)
        tokenizer.tokenizer = Tokenizer.from_file(path)
        return tokenizer


def world_words() -> List[str]:
    """Every word a toy caption can use."""
    words = {"a", "at", "the", "in", *SHAPES, *COLORS, *SIZES}
    for position in POSITIONS:
        words.update(position.split())
    return sorted(words)


# ---------------------------------------------------------------------------------------------
# the toy dataset: the world's pictures through the real preprocessing path, cached on first use


def default_cache_dir() -> str:
    """Where made datasets are kept: ``$COLLAB_KIT_CACHE`` or ``~/.cache/collab_kit``."""
    return os.environ.get("COLLAB_KIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "collab_kit")


def prepare_toy_dataset(num_samples: int = 4096, seed: int = 0, cache_dir: Optional[str] = None, vqgan=None,
                        rows_per_shard: int = 1024, progress: bool = True) -> str:
    """Shards of ``num_samples`` toy pictures made by ``collab_kit.preprocess`` (VQGAN codes, Brotli, parquet).

    Made once per (samples, seed, VQGAN) in the cache folder and reused; an interrupted run is resumed
    (preprocess skips finished shards). Returns the shards' folder.

    :param vqgan: the tokenizer (default: the shipped toy VQGAN, collab_kit.toy_vqgan.load_toy_vqgan)
    """
    import hashlib

    from collab_kit.preprocess import preprocess

    if vqgan is None:
        from collab_kit.toy_vqgan import load_toy_vqgan

        vqgan = load_toy_vqgan()
    fingerprint = hashlib.sha256()
    for name, tensor in sorted(vqgan.state_dict().items()):
        fingerprint.update(name.encode())
        fingerprint.update(tensor.detach().cpu().numpy().tobytes())
    folder = os.path.join(cache_dir or default_cache_dir(), "toy",
                          f"{num_samples}-seed{seed}-vqgan{fingerprint.hexdigest()[:12]}")
    shards = os.path.join(folder, "shards")
    done_marker = os.path.join(folder, "complete")
    if os.path.exists(done_marker):
        return shards
    pictures_folder = os.path.join(folder, "pictures")
    if not os.path.exists(os.path.join(pictures_folder, "captions.jsonl")):
        write_toy_images(pictures_folder, num_samples, seed)
    preprocess(pictures_folder, shards, vqgan, rows_per_shard=rows_per_shard, batch_size=256, progress=progress)
    with open(done_marker, "w") as f:
        f.write("preprocess finished\n")
    shutil.rmtree(pictures_folder, ignore_errors=True)  # the shards hold all a volunteer reads
    return shards
