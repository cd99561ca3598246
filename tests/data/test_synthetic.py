"""The toy world: deterministic captioned pictures, its word tokenizer, colours measured on pixels."""

import json

import numpy as np
import pytest

from collab_kit.data.synthetic import (
    BACKGROUNDS,
    COLORS,
    POSITIONS,
    SHAPES,
    SIZES,
    Scene,
    dominant_color,
    draw,
    make_synthetic_images,
    pictures,
    scenes,
    world_words,
)
from collab_kit.data.tokenizers import ToyTokenizer


def test_the_same_seed_draws_the_same_pictures_and_another_seed_others():
    first = [(np.asarray(image), caption) for image, caption in pictures(20, seed=4)]
    again = [(np.asarray(image), caption) for image, caption in pictures(20, seed=4)]
    other = [(np.asarray(image), caption) for image, caption in pictures(20, seed=5)]
    assert all(np.array_equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(first, again))
    assert [c for _, c in first] != [c for _, c in other]
    assert first[0][0].shape == (64, 64, 3) and first[0][0].dtype == np.uint8


def test_a_picture_holds_exactly_its_caption():
    for scene in scenes(200, seed=1):
        pixels = np.asarray(draw(scene)).reshape(-1, 3)
        colors = {tuple(p) for p in pixels}
        assert colors == {COLORS[scene.color], BACKGROUNDS[scene.background]}, scene
        share = (pixels == COLORS[scene.color]).all(1).mean()
        assert (0.02 < share < 0.12) if scene.size == "small" else (0.08 < share < 0.4), (scene, share)
        # the shape's centre of mass lies in the caption's part of the picture
        ys, xs = np.nonzero((np.asarray(draw(scene)) == COLORS[scene.color]).all(-1))
        x, y = POSITIONS[scene.position]
        assert abs(xs.mean() - x) < 9 and abs(ys.mean() - y) < 9, scene  # a triangle sits low by r / 3
        assert dominant_color(draw(scene)) == scene.color
    assert Scene("circle", "red", "small", "center", "sand").caption == "a small red circle in the center"
    assert Scene("cross", "pink", "large", "top left", "sand").caption == "a large pink cross at the top left"


def test_the_world_has_every_combination():
    seen = scenes(3000, seed=0)
    for attribute, values in (
        ("shape", SHAPES),
        ("color", COLORS),
        ("size", SIZES),
        ("position", POSITIONS),
        ("background", BACKGROUNDS),
    ):
        assert {getattr(s, attribute) for s in seen} == set(values), attribute


def test_the_tokenizer_round_trips_every_caption(tmp_path):
    tokenizer = ToyTokenizer()
    assert tokenizer.vocab_size == 3 + len(world_words())
    for scene in scenes(300, seed=2):
        ids = tokenizer.encode(scene.caption, 12)
        assert len(ids) == 12 and tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == scene.caption
    ids = tokenizer.encode("A Small RED unicorn", 6)
    assert ids[3] == tokenizer.unk_token_id and tokenizer.decode(ids) == "a small red [UNK]"
    assert tokenizer.encode("a small red circle in the center", 4)[-1] == tokenizer.eos_token_id  # cut, then eos
    loaded = ToyTokenizer.load(tokenizer.save(str(tmp_path / "tokenizer.json")))
    assert loaded.encode("a large blue square at the top right", 10) == tokenizer.encode(
        "a large blue square at the top right", 10
    )


def test_dominant_colour_reads_blurry_pictures_and_knows_when_there_is_none():
    scene = Scene("square", "orange", "large", "center", "dark grey")
    pixels = np.asarray(draw(scene)).astype(float)
    noisy = np.clip(pixels + np.random.default_rng(0).normal(0, 20, pixels.shape), 0, 255)
    assert dominant_color(noisy.astype(np.uint8)) == "orange"
    empty = np.full((64, 64, 3), BACKGROUNDS["sand"], dtype=np.uint8)
    assert dominant_color(empty) is None


def test_color_match_counts_pictures_in_their_prompts_colour():
    from collab_kit.data.synthetic import color_match, prompt_color

    drawn = list(pictures(40, seed=5))
    images, captions = [image for image, _ in drawn], [caption for _, caption in drawn]
    assert prompt_color("a small Red circle at the top left") == "red" and prompt_color("a circle") is None
    assert color_match(images, captions) == 1.0
    # the same pictures asked for in the next colour: none matches
    colours = list(COLORS)
    shifted = [
        caption.replace(f" {prompt_color(caption)} ", f" {colours[(colours.index(prompt_color(caption)) + 1) % 8]} ")
        for caption in captions
    ]
    assert color_match(images, shifted) == 0.0
    assert color_match(images[:4], captions[:2] + shifted[2:4]) == 0.5
    with pytest.raises(ValueError, match="names none of the colours"):
        color_match(images[:1], ["a large circle"])
    with pytest.raises(ValueError, match="one prompt per image"):
        color_match(images[:2], captions[:1])


def test_toy_images_are_written_for_preprocess(tmp_path):
    folder = make_synthetic_images(str(tmp_path / "toy"), 5, seed=3)
    entries = [json.loads(line) for line in open(f"{folder}/captions.jsonl")]
    assert [e["caption"] for e in entries] == [caption for _, caption in pictures(5, seed=3)]
    assert sorted(p.name for p in (tmp_path / "toy").glob("*.png")) == [e["file"] for e in entries]


def test_the_toy_preset_fits_the_toy_world():
    from collab_kit.config import get_preset

    config = get_preset("toy")
    tokenizer = ToyTokenizer()
    assert config.data.tokenizer == "toy" and config.model.text_vocab_size == tokenizer.vocab_size
    assert config.model.pad_token_id == tokenizer.pad_token_id
    longest = max((scene.caption for scene in scenes(2000, seed=0)), key=lambda c: len(c.split()))
    assert len(longest.split()) + 1 <= config.model.text_length  # every caption and its end fit


def test_the_toy_dataset_is_made_by_preprocess_once_and_streamed_with_the_toy_tokenizer(tmp_path):
    import os

    from collab_kit.data.shards import shard_metadata
    from collab_kit.data.stream import ShardStream
    from collab_kit.model.vqgan import untrained_vqgan
    from collab_kit.toy.dataset import prepare_toy_dataset

    vqgan = untrained_vqgan(grid_size=8, codebook_size=512)
    shards = prepare_toy_dataset(40, seed=1, cache_dir=str(tmp_path), vqgan=vqgan, rows_per_shard=16, progress=False)
    names = sorted(os.listdir(shards))
    assert names == ["shard-00000.parquet", "shard-00001.parquet", "shard-00002.parquet"]
    # its captions are in the toy world's words: the shards say so, and a run of another tokenizer turns them away
    assert shard_metadata(os.path.join(shards, names[0])) == dict(
        format=2, codebook_size=512, image_side=8, tokenizer="toy"
    )
    stamps = [os.stat(os.path.join(shards, name)).st_mtime_ns for name in names]
    # the second call finds the finished dataset in the cache and writes nothing
    assert prepare_toy_dataset(40, seed=1, cache_dir=str(tmp_path), vqgan=vqgan, progress=False) == shards
    assert [os.stat(os.path.join(shards, name)).st_mtime_ns for name in names] == stamps
    assert not os.path.exists(os.path.join(os.path.dirname(shards), "pictures"))  # the shards are all it keeps
    # another VQGAN is another dataset
    other = untrained_vqgan(grid_size=8, codebook_size=512, seed=1)
    assert (
        prepare_toy_dataset(40, seed=1, cache_dir=str(tmp_path), vqgan=other, rows_per_shard=16, progress=False)
        != shards
    )

    tokenizer = ToyTokenizer()
    stream = iter(ShardStream(shards, 12, 64, tokenizer=tokenizer, codebook_size=512, shuffle_buffer=8))
    captions = sorted(tokenizer.decode(next(stream)["text_tokens"].tolist()) for _ in range(40))
    assert captions == sorted(caption for _, caption in pictures(40, seed=1))


def test_two_processes_that_want_the_toy_dataset_make_it_once(tmp_path):
    """Two makers at once (here two threads; a lock file is per open file, so they exclude each other as two processes
    would): the second waits for the first and finds the dataset complete, with the first's shards untouched."""
    import os
    import threading

    from collab_kit.model.vqgan import untrained_vqgan
    from collab_kit.toy.dataset import prepare_toy_dataset

    vqgan = untrained_vqgan(grid_size=8, codebook_size=512)
    results, errors = [], []

    def make():
        try:
            shards = prepare_toy_dataset(
                40, seed=2, cache_dir=str(tmp_path), vqgan=vqgan, rows_per_shard=16, progress=False
            )
            results.append(
                (shards, {name: os.stat(os.path.join(shards, name)).st_mtime_ns for name in sorted(os.listdir(shards))})
            )
        except BaseException as error:  # noqa: B902 (reported below, in the test's thread)
            errors.append(error)

    makers = [threading.Thread(target=make) for _ in range(2)]
    for maker in makers:
        maker.start()
    for maker in makers:
        maker.join(timeout=120)
    assert not errors and len(results) == 2, errors
    (first, first_files), (second, second_files) = results
    assert first == second and first_files == second_files and len(first_files) == 3
