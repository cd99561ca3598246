"""From a prompt to a grid: sample codes, decode them with the VQGAN, keep what CLIP ranks best."""

import pytest
import torch

from collab_kit.config import get_preset
from collab_kit.data.tokenizers import ByteCaptionTokenizer
from collab_kit.images.generate import draw_images, encode_prompt, generate_images, prompt_sheet
from collab_kit.model.checkpoint import save_checkpoint
from collab_kit.model.clip_rank import tiny_random_clip
from collab_kit.model.transformer import TextToImageTransformer
from collab_kit.model.vqgan import TINY_VQGAN_CONFIG, build_vqgan, images_to_pil
from collab_kit.model.vqgan_files import save_vqgan


@pytest.fixture(scope="module")
def pieces():
    """The tiny preset's model and the tiny VQGAN agree: 4 x 4 codes from a codebook of 32."""
    torch.manual_seed(0)
    model = TextToImageTransformer(get_preset("tiny").model).eval()
    return model, build_vqgan(TINY_VQGAN_CONFIG).eval(), tiny_random_clip(seed=0)


def test_the_grid_holds_the_images_clip_ranks_best(pieces):
    model, vqgan, ranker = pieces
    drawn = draw_images("a red circle", 6, model=model, vqgan=vqgan, seed=3, batch_size=4, progress=False)
    assert drawn.shape == (6, 3, 16, 16) and 0 <= drawn.min() and drawn.max() <= 1
    grid = generate_images(
        "a red circle", n=6, keep=4, model=model, vqgan=vqgan, ranker=ranker, seed=3, batch_size=4, progress=False
    )
    assert grid.size == (2 * 16, 2 * 16)  # 4 images, 2 x 2
    # the same seed draws the same 6 images; the grid shows CLIP's best 4 of them, best first
    scores = ranker.score("a red circle", drawn)
    best = scores.argsort(descending=True)[:4]
    assert grid.info["clip_scores"] == pytest.approx(scores[best].tolist(), abs=1e-5)
    tiles = [grid.crop((x, y, x + 16, y + 16)) for y in (0, 16) for x in (0, 16)]
    expected = images_to_pil(drawn[best])
    assert [tile.tobytes() for tile in tiles] == [image.tobytes() for image in expected]
    assert [image.tobytes() for image in grid.info["images"]] == [image.tobytes() for image in expected]


def test_a_prompt_sheet_puts_each_prompt_above_its_row(pieces):
    import numpy as np

    model, vqgan, ranker = pieces
    grids = [
        generate_images(prompt, n=4, keep=3, model=model, vqgan=vqgan, ranker=ranker, seed=1, columns=3, progress=False)
        for prompt in ("a red circle", "a rather longer prompt about a blue square")
    ]
    sheet = np.asarray(prompt_sheet(grids, scale=2, font_size=14))
    line, row = 14 + 8, 2 * 16  # title band and enlarged row heights
    assert sheet.shape[0] == 2 * (line + row + 6)
    for index, grid in enumerate(grids):
        top = index * (line + row + 6)
        title = sheet[top : top + line]
        assert (title < 128).any()  # the prompt is written in the band above the row
        pictures = sheet[top + line : top + line + row, : 3 * 32]
        enlarged = np.asarray(grid.resize((96, 32), resample=0))
        assert np.array_equal(pictures, enlarged)
    # the longer prompt is wider than its row of 3 pictures, and the sheet makes room for it
    assert sheet.shape[1] > 96 and (sheet[line + row + 6 : 2 * line + row + 6, 96:] < 128).any()
    with pytest.raises(ValueError, match="one prompt per grid"):
        prompt_sheet(grids, prompts=["only one"])


def test_sampling_settings_matter_and_a_seed_repeats(pieces):
    model, vqgan, _ = pieces

    def draw(**kwargs):
        return draw_images("a blue square", 4, model=model, vqgan=vqgan, progress=False, **kwargs)

    assert torch.equal(draw(seed=1), draw(seed=1))
    assert not torch.equal(draw(seed=1), draw(seed=2))
    greedy = draw(temperature=0)
    assert torch.equal(greedy[0], greedy[3])  # greedy decoding draws one image, whatever the seed
    assert torch.equal(draw(seed=5, top_k=1), greedy)


def test_pieces_load_from_folders_and_a_progress_bar_counts_codes(pieces, tmp_path, capsys):
    model, vqgan, ranker = pieces
    save_checkpoint(model, get_preset("tiny"), str(tmp_path / "model"))
    save_vqgan(vqgan, str(tmp_path / "vqgan"))
    ranker.save_pretrained(str(tmp_path / "clip"))
    from_folders = generate_images(
        "a green star",
        n=3,
        keep=2,
        model=str(tmp_path / "model"),
        vqgan=str(tmp_path / "vqgan"),
        ranker=str(tmp_path / "clip"),
        seed=4,
        columns=2,
    )
    in_memory = generate_images(
        "a green star", n=3, keep=2, model=model, vqgan=vqgan, ranker=ranker, seed=4, columns=2, progress=False
    )
    assert from_folders.tobytes() == in_memory.tobytes() and from_folders.size == (32, 16)
    assert "drawing 3 images" in capsys.readouterr().err  # 3 images x 16 codes


def test_mismatches_and_bad_arguments_are_explained(pieces):
    model, vqgan, ranker = pieces
    other = TextToImageTransformer(get_preset("tiny", model=dict(image_side=5)).model)
    with pytest.raises(ValueError, match="the VQGAN decodes 4x4 codes from 32"):
        generate_images("x", n=2, keep=1, model=other, vqgan=vqgan, ranker=ranker, progress=False)
    with pytest.raises(ValueError, match="keep=5"):
        generate_images("x", n=4, keep=5, model=model, vqgan=vqgan, ranker=ranker, progress=False)
    with pytest.raises(ValueError, match="non-empty string"):
        encode_prompt("  ", ByteCaptionTokenizer(), model.config)
    assert encode_prompt("ab", ByteCaptionTokenizer(), model.config) == [97 + 3, 98 + 3, 1] + [0] * 5
