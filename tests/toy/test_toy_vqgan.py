"""The toy VQGAN shipped with the package: 64x64 pictures <-> 8x8 codes at its stated held-out PSNR; its training
runs."""

import json
import os

import pytest
import torch

from collab_kit.data import synthetic
from collab_kit.model.vqgan import CHECKPOINT_NAME, CONFIG_NAME
from collab_kit.model.vqgan_files import load_vqgan
from collab_kit.toy.vqgan import (
    HELD_OUT_COUNT,
    HELD_OUT_SEED,
    METRICS_NAME,
    TOY_VQGAN_CONFIG,
    TOY_VQGAN_DIR,
    ToyVQGANMissing,
    edge_pixels,
    evaluate_toy_vqgan,
    load_toy_vqgan,
    main,
    scenes_to_tensor,
    toy_vqgan_metrics,
    training_scenes,
)

PSNR_FLOOR_DB = 25.0  # what the shipped model must state at least: flat-coloured pictures come back sharp
PSNR_SLACK_DB = 0.5  # 64 held-out pictures measured here against the 256 of the stated figure
MAX_SHIPPED_BYTES = 10 * 1024 * 1024


@pytest.fixture(scope="module")
def shipped():
    return load_toy_vqgan()


def test_the_shipped_vqgan_maps_64x64_pictures_to_8x8_codes_and_back(shipped):
    assert not shipped.training and shipped.config == TOY_VQGAN_CONFIG
    assert (shipped.image_size, shipped.downsampling_factor, shipped.grid_size) == (64, 8, 8)
    images = scenes_to_tensor(synthetic.scenes(4, seed=HELD_OUT_SEED))
    codes = shipped.encode(images)
    assert codes.shape == (4, 64) and codes.dtype == torch.int64
    assert 0 <= codes.min() and codes.max() < shipped.codebook_size == 512
    assert torch.equal(shipped.encode(images), codes)  # deterministic
    decoded = shipped.decode(codes)
    assert decoded.shape == (4, 3, 64, 64) and 0 <= decoded.min() and decoded.max() <= 1


def test_the_shipped_vqgan_reaches_its_stated_psnr_on_held_out_pictures(shipped):
    stated = toy_vqgan_metrics()
    assert stated["held_out_seed"] == HELD_OUT_SEED and stated["held_out"] == HELD_OUT_COUNT
    assert stated["psnr_db"] >= PSNR_FLOOR_DB, stated
    assert stated["color_match"] >= 0.95, stated

    measured = evaluate_toy_vqgan(shipped, count=64)  # the first 64 of the stated figure's 256 pictures
    assert measured["psnr_db"] >= stated["psnr_db"] - PSNR_SLACK_DB, (measured, stated)
    # a reconstruction keeps what the caption says: the shape's colour is still the one covering most
    assert measured["color_match"] >= 0.95, measured
    assert measured["codes_used"] >= 64, "a handful of codes for 64 varied pictures means a collapsed codebook"
    # what a transformer drawing these codes can score at most: the shape read back from the pixels
    for aspect in ("shape", "place", "size"):
        assert measured[f"{aspect}_match"] >= stated[f"{aspect}_match"] - 0.1, (aspect, measured, stated)
    assert (stated["place_match"], stated["size_match"]) == (1.0, 1.0), stated


def test_the_edge_mask_marks_the_pixels_on_both_sides_of_a_colour_edge_and_nothing_else():
    plain = synthetic.Scene("square", "red", "large", "center", "sand")
    pixels = scenes_to_tensor([plain])
    edges = edge_pixels(pixels)[0, 0]
    red = (pixels[0] == torch.tensor(synthetic.COLORS["red"]).view(3, 1, 1) / 255).all(0)
    # the square's border pixels and the background pixels beside them: two rings, nothing in the flat parts
    side = int(red.sum().sqrt())
    assert int(edges.sum()) == (4 * side - 4) + (4 * (side + 2) - 4)
    assert not edges[0].any() and not edges[32, 30:34].any()
    flat = torch.full((1, 3, 8, 8), 0.5)
    assert edge_pixels(flat).sum() == 0


def test_the_shipped_files_are_small_and_complete():
    names = sorted(os.listdir(TOY_VQGAN_DIR))
    assert names == sorted([CHECKPOINT_NAME, CONFIG_NAME, METRICS_NAME])
    assert sum(os.path.getsize(os.path.join(TOY_VQGAN_DIR, name)) for name in names) < MAX_SHIPPED_BYTES


def test_training_never_sees_the_held_out_pictures():
    held_out = set(synthetic.scenes(HELD_OUT_COUNT, seed=HELD_OUT_SEED))
    # the world has ~59k scenes, so an unfiltered stream of this length would meet several held-out ones
    trained = [scene for step in range(200) for scene in training_scenes(16, step, seed=0, excluded=held_out)]
    assert len(trained) == 3200 and not held_out.intersection(trained)
    assert training_scenes(16, 5, seed=0, excluded=held_out) == training_scenes(16, 5, seed=0, excluded=held_out)
    assert training_scenes(16, 5, seed=0, excluded=held_out) != training_scenes(16, 5, seed=1, excluded=held_out)


def test_a_short_training_run_writes_a_loadable_model_and_its_metrics(tmp_path, capsys):
    folder = tmp_path / "vqgan"
    assert main(["--output", str(folder), "--steps", "3", "--batch-size", "2", "--held-out", "8", "--no-progress"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("toy vqgan: psnr=") and "held_out=8" in line and "steps=3" in line

    assert sorted(os.listdir(folder)) == sorted([CHECKPOINT_NAME, CONFIG_NAME, METRICS_NAME])
    with open(folder / METRICS_NAME) as f:
        metrics = json.load(f)
    assert metrics == toy_vqgan_metrics(str(folder))
    assert {"psnr_db", "color_match", "codes_used", "held_out", "held_out_seed", "steps"} <= set(metrics)
    assert (metrics["held_out"], metrics["held_out_seed"], metrics["steps"]) == (8, HELD_OUT_SEED, 3)

    model = load_toy_vqgan(str(folder))
    assert model.config == TOY_VQGAN_CONFIG and not model.training
    again = evaluate_toy_vqgan(load_vqgan(folder), count=8)
    assert again["psnr_db"] == pytest.approx(metrics["psnr_db"], abs=1e-3)  # the saved model is the measured one


def test_missing_weights_say_how_to_train_them(tmp_path):
    with pytest.raises(ToyVQGANMissing, match="collab-kit toy train-vqgan --output"):
        load_toy_vqgan(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="collab-kit toy train-vqgan --output"):
        toy_vqgan_metrics(str(tmp_path))
