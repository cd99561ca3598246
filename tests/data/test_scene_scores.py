"""collab_kit.data.scene_scores on hand-made pictures: each drawn scene reads as itself (sharp, blurred, noisy), a
smear is no shape, a round blob of the right colour, asked to be something else, never passes as that shape, and
small crosses and diamonds keep their shapes through the toy VQGAN."""

import itertools

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFilter

from collab_kit.data.scene_scores import CHANCE, CROSS_MAX_SOLIDITY, asked, picture_marks, read_picture, scene_scores
from collab_kit.data.scene_scores import solidity as solidity_of
from collab_kit.data.synthetic import BACKGROUNDS, COLORS, POSITIONS, SHAPES, SIZES, Scene, draw
from collab_kit.data.synthetic import scenes as world_scenes
from collab_kit.model.vqgan import images_to_pil
from collab_kit.toy.vqgan import load_toy_vqgan, scenes_to_tensor

MOVED = 3  # pixels a hand-made shape is moved off its place: a model's drawing is seldom exactly there

EVERY_SCENE = [
    Scene(shape=shape, color=color, size=size, position=position, background=background, offset=offset)
    for (shape, size, position), color, background, offset in zip(
        itertools.product(SHAPES, SIZES, POSITIONS),
        itertools.cycle(COLORS),
        itertools.cycle(BACKGROUNDS),
        itertools.cycle([(0, 0), (MOVED, -MOVED), (-MOVED, MOVED), (MOVED, MOVED)]),
    )
]


def blob(color: str, position: str, radius: int = 12) -> Image.Image:
    """A soft round patch of ``color`` at ``position``: what a model that learnt only colours draws."""
    image = Image.new("RGB", (64, 64), BACKGROUNDS["light grey"])
    x, y = POSITIONS[position]
    ImageDraw.Draw(image).ellipse([x - radius, y - radius, x + radius, y + radius], fill=COLORS[color])
    return image.filter(ImageFilter.GaussianBlur(2))


def test_a_caption_says_what_it_asks():
    wanted = asked("a large blue square at the top right")
    assert (wanted.color, wanted.shape, wanted.place, wanted.size) == ("blue", "square", "top right", "large")
    assert asked("a cyan cross in the center").place == "center" and asked("a cross").color is None


@pytest.mark.parametrize("scene", EVERY_SCENE, ids=lambda scene: scene.caption.replace(" ", "_"))
def test_every_drawn_scene_reads_as_itself(scene):
    noise = np.random.default_rng(0).normal(0, 20, (64, 64, 3))
    noisy = np.clip(np.asarray(draw(scene), dtype=np.float32) + noise, 0, 255)
    for picture in (draw(scene), draw(scene).filter(ImageFilter.GaussianBlur(1)), noisy):
        reading = read_picture(picture)
        assert (reading.color, reading.shape, reading.place, reading.size) == (
            scene.color,
            scene.shape,
            scene.position,
            scene.size,
        )


def test_a_smear_is_no_shape_at_all():
    smear = Image.new("RGB", (64, 64), BACKGROUNDS["sand"])
    pen = ImageDraw.Draw(smear)
    for box in ([8, 30, 40, 44], [30, 10, 44, 40], [36, 36, 58, 50]):  # three overlapping strokes, as a model smears
        pen.ellipse(box, fill=COLORS["green"])
    reading = read_picture(smear.filter(ImageFilter.GaussianBlur(2)))
    assert reading.color == "green" and reading.shape is None


def test_a_blob_of_the_right_colour_at_the_right_place_is_no_square_triangle_diamond_or_cross():
    prompts = [f"a small red {shape} at the top left" for shape in SHAPES if shape != "circle"]
    pictures = [blob("red", "top left") for _ in prompts]
    scores = scene_scores(pictures, prompts)
    assert scores["color"] == scores["place"] == 1.0 and scores["shape"] == 0.0
    assert picture_marks(pictures[0], prompts[0]) == {"color": True, "shape": False, "place": True, "size": True}


def test_a_filled_square_is_solid_and_a_drawn_cross_is_hollow():
    square = np.zeros((20, 20), dtype=bool)
    square[5:15, 5:15] = True
    cross = (np.asarray(draw(Scene("cross", "red", "large", "center", "sand"))) == COLORS["red"]).all(axis=-1)
    assert solidity_of(square) == 1.0 and solidity_of(cross) < CROSS_MAX_SOLIDITY


def test_small_crosses_and_diamonds_through_the_toy_vqgan_read_as_themselves():
    # a small shape spans 2 or 3 of the VQGAN's 8-pixel codes: its reconstruction rounds the cross's hollows
    small = [scene for scene in world_scenes(400, seed=7) if scene.size == "small"]
    wanted = [scene for scene in small if scene.shape in ("cross", "diamond")]
    vqgan = load_toy_vqgan().eval()
    with torch.no_grad():
        decoded = images_to_pil(vqgan.decode(vqgan.encode(scenes_to_tensor(wanted))))
    read = [read_picture(picture).shape for picture in decoded]
    crosses = [got for got, scene in zip(read, wanted) if scene.shape == "cross"]
    diamonds = [got for got, scene in zip(read, wanted) if scene.shape == "diamond"]
    assert len(crosses) >= 20 and len(diamonds) >= 20
    assert crosses.count("cross") >= 0.85 * len(crosses), crosses
    assert diamonds.count("cross") <= 0.1 * len(diamonds), diamonds


def test_scores_over_pictures_that_ignore_their_prompts_are_near_chance():
    rng = np.random.default_rng(0)
    scenes = [EVERY_SCENE[i] for i in rng.permutation(len(EVERY_SCENE))]
    pictures = [draw(scene) for scene in EVERY_SCENE]  # each picture under another scene's caption
    scores = scene_scores(pictures, [scene.caption for scene in scenes])
    for aspect in ("shape", "place"):
        assert scores[aspect] < 2.5 * CHANCE[aspect], (aspect, scores)


def test_an_empty_picture_reads_as_nothing_and_a_wrong_count_is_refused():
    assert read_picture(Image.new("RGB", (64, 64), BACKGROUNDS["sand"])).shape is None
    with pytest.raises(ValueError, match="one prompt per image"):
        scene_scores([blob("red", "center")], [])
