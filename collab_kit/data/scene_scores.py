"""What a toy picture shows, measured on its pixels with no model: its shape, place and size against its caption.

``color_match`` (collab_kit.data.synthetic) asks whether a picture has the prompted colour; a blob of that colour
anywhere passes it. These scores look at the object itself. The object is the largest connected patch of the
picture's dominant named colour (``main_color`` of ``nearest_named``, as ``dominant_color`` reads it, so blurry
decoded pictures work too):

- ``place``: the place (of the 5) nearest to the centre of the object's bounding box; chance 1/5.
- ``size``: small or large, from the box's larger side; chance 1/2.
- ``shape``: the shape (of the 5) whose drawing, centred and sized on the box, overlaps the object best (the
  intersection over union of the two masks), if it overlaps at least ``SHAPE_MIN_OVERLAP``: a shapeless smear is
  no shape, not a circle; chance 1/5. The cross is the one shape with hollows, and the one a small drawing confuses
  with another: a decoded small cross's hollows half fill, and it overlaps a diamond's drawing as well as its own. So
  an object that fills less than ``CROSS_MAX_SOLIDITY`` of its convex hull may be a cross and no diamond, one that
  fills more may be anything but a cross.

Shown by tests/data/test_scene_scores.py: every drawn scene scores right, blurred too, a round blob asked to be a
square, a triangle, a diamond or a cross never scores as one, and small crosses and diamonds through the toy VQGAN
read as themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from collab_kit.data.synthetic import COLORS, IMAGE_SIZE, NAMED, POSITIONS, SHAPES, SIZES, main_color, nearest_named

CHANCE = {"shape": 1 / len(SHAPES), "place": 1 / len(POSITIONS), "size": 1 / len(SIZES), "color": 1 / len(COLORS)}
# a box side at most this many pixels is a small shape: small shapes are 15-19 pixels wide, large ones 29-35
SMALL_SIDE_LIMIT = 24
# every drawn scene overlaps its own shape's drawing by 0.80 at least, sharp, blurred or noisy
SHAPE_MIN_OVERLAP = 0.7
# share of its convex hull an object fills: toy VQGAN reconstructions of small crosses 0.75-0.85 (5th-95th
# percentile), of every other shape 0.85 or more (small triangles from 0.80); drawn crosses 0.71. With it, 93% of
# reconstructions read as their scene's shape, small crosses 104 of 109; without it, 86% and 25 of 109
CROSS_MAX_SOLIDITY = 0.85


@dataclass(frozen=True)
class Reading:
    """What a picture shows; None where it shows no object."""

    color: str | None
    shape: str | None
    place: str | None
    size: str | None


@dataclass(frozen=True)
class Asked:
    """What a caption asks for ("a small red circle at the top left")."""

    color: str | None
    shape: str | None
    place: str | None
    size: str | None


def asked(prompt: str) -> Asked:
    """The colour, shape, place and size a toy caption names (None for what it does not name)."""
    text = " ".join(prompt.lower().replace(",", " ").split())
    words = text.split()
    place = next((name for name in POSITIONS if name in text), None)
    return Asked(
        color=next((word for word in words if word in COLORS), None),
        shape=next((word for word in words if word in SHAPES), None),
        place=place,
        size=next((word for word in words if word in SIZES), None),
    )


def _largest_patch(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected patch of ``mask`` (a flood fill: 64 x 64 pictures need nothing faster)."""
    labels = np.zeros(mask.shape, dtype=np.int32)
    sizes, height, width = [0], *mask.shape
    for start in zip(*np.nonzero(mask)):
        if labels[start]:
            continue
        label, stack, count = len(sizes), [start], 0
        labels[start] = label
        while stack:
            y, x = stack.pop()
            count += 1
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < height and 0 <= nx < width and mask[ny, nx] and not labels[ny, nx]:
                    labels[ny, nx] = label
                    stack.append((ny, nx))
        sizes.append(count)
    return labels == int(np.argmax(sizes)) if len(sizes) > 1 else np.zeros_like(mask)


def _cross(o, a, b) -> int:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def solidity(mask: np.ndarray) -> float:
    """The share of its convex hull that ``mask`` fills (1 for a convex object): the hull of its pixels' corners
    (Andrew's monotone chain) and its area by the shoelace formula."""
    ys, xs = np.nonzero(mask)
    corners = sorted({(int(x) + dx, int(y) + dy) for x, y in zip(xs, ys) for dx in (0, 1) for dy in (0, 1)})

    def chain(points):
        kept: list = []
        for point in points:
            while len(kept) >= 2 and _cross(kept[-2], kept[-1], point) <= 0:
                kept.pop()
            kept.append(point)
        return kept[:-1]

    hull = np.array(chain(corners) + chain(corners[::-1]), dtype=float)
    x, y = hull[:, 0], hull[:, 1]
    area = 0.5 * abs(float(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1))))
    return float(mask.sum()) / area if area else 1.0


def template(shape: str, box: tuple[int, int, int, int], side: int) -> np.ndarray:
    """The mask of ``shape`` drawn as the toy world draws it, filling ``box`` (x0, y0, x1, y1) on a side x side
    canvas."""
    x0, y0, x1, y1 = box
    canvas = Image.new("1", (side, side), 0)
    pen = ImageDraw.Draw(canvas)
    cx, cy, rx, ry = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2
    if shape in ("circle", "square"):
        (pen.ellipse if shape == "circle" else pen.rectangle)([x0, y0, x1, y1], fill=1)
    elif shape == "triangle":
        pen.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=1)
    elif shape == "diamond":
        pen.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=1)
    elif shape == "cross":
        arm_x, arm_y = max(2, rx // 3), max(2, ry // 3)  # as draw(): arms a third of the half-width
        pen.rectangle([x0, cy - arm_y, x1, cy + arm_y], fill=1)
        pen.rectangle([cx - arm_x, y0, cx + arm_x, y1], fill=1)
    else:
        raise ValueError(f"shape={shape!r} is not known: choose one of {', '.join(SHAPES)}")
    return np.asarray(canvas, dtype=bool)


def read_picture(image) -> Reading:
    """The colour, shape, place and size of the object a toy picture shows (a PIL image or an [H, W, 3] array)."""
    nearest = nearest_named(image)
    side = nearest.shape[0]
    color = main_color(nearest)
    if color is None:
        return Reading(color=None, shape=None, place=None, size=None)
    patch = _largest_patch(nearest == color)
    ys, xs = np.nonzero(patch)
    box = (int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max()))
    scale = IMAGE_SIZE / side  # the places and sizes are the 64-pixel world's
    centre = np.array([(box[0] + box[2]) / 2, (box[1] + box[3]) / 2]) * scale
    place = min(POSITIONS, key=lambda name: float(np.sum((np.array(POSITIONS[name]) - centre) ** 2)))
    largest_side = (max(box[2] - box[0], box[3] - box[1]) + 1) * scale
    size = "small" if largest_side <= SMALL_SIDE_LIMIT else "large"

    def overlap(shape: str) -> float:
        drawn = template(shape, box, side)
        return float((drawn & patch).sum() / max(1, (drawn | patch).sum()))

    hollow = solidity(patch) < CROSS_MAX_SOLIDITY
    shape = max((name for name in SHAPES if name != ("diamond" if hollow else "cross")), key=overlap)
    return Reading(
        color=NAMED[color], shape=shape if overlap(shape) >= SHAPE_MIN_OVERLAP else None, place=place, size=size
    )


def scene_scores(images: Sequence, prompts: Sequence[str]) -> dict[str, float]:
    """The share of ``images`` that show what their prompt asks, per aspect: color, shape, place and size.

    An aspect a prompt does not name is left out of that aspect's share. Chance levels: ``CHANCE``.

    :param images: PIL images (or arrays), one per prompt
    :param prompts: toy captions ("a large blue square at the top right")
    """
    if len(images) != len(prompts) or not images:
        raise ValueError(
            f"expected one prompt per image and at least one image, got {len(images)} images and {len(prompts)} prompts"
        )
    readings = [read_picture(image) for image in images]
    wanted = [asked(prompt) for prompt in prompts]
    scores = {}
    for aspect in ("color", "shape", "place", "size"):
        pairs = [(getattr(r, aspect), getattr(w, aspect)) for r, w in zip(readings, wanted) if getattr(w, aspect)]
        scores[aspect] = sum(got == want for got, want in pairs) / len(pairs) if pairs else float("nan")
    return scores


def picture_marks(image, prompt: str) -> dict[str, bool]:
    """For one picture, whether each aspect its prompt names is what it shows (for a caption under the picture)."""
    reading, wanted = read_picture(image), asked(prompt)
    return {
        aspect: getattr(reading, aspect) == getattr(wanted, aspect)
        for aspect in ("color", "shape", "place", "size")
        if getattr(wanted, aspect)
    }
