"""CLIP ranking with a real (tiny, random) CLIPModel: scores, the kept images, inputs, loading, errors."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from collab_kit.model.clip_rank import ClipRanker, tiny_random_clip, tiny_tokenizer

PROMPT = "a red circle above a blue square"


@pytest.fixture(scope="module")
def ranker() -> ClipRanker:
    return tiny_random_clip(seed=0)


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    """12 images of 40x48 (not the model's 32x32: they are resized and cropped), values k / 255 like real ones."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (12, 3, 40, 48), generator=generator, dtype=torch.uint8).float() / 255


def test_the_tiny_tokenizer_really_tokenizes():
    tokenizer = tiny_tokenizer()
    red, blue = tokenizer("a red circle")["input_ids"], tokenizer("a blue square")["input_ids"]
    assert red != blue and red[0] == tokenizer.bos_token_id and red[-1] == tokenizer.eos_token_id
    assert tokenizer.unk_token_id not in red[1:-1]
    assert tokenizer.decode(red, skip_special_tokens=True) == "a red circle"


def test_scores_are_one_finite_cosine_per_image_whatever_the_batch_size(ranker, images):
    scores = ranker.score(PROMPT, images, batch_size=5)  # batches of 5, 5, 2
    assert scores.shape == (12,) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all() and (scores.abs() <= 1 + 1e-5).all()
    assert torch.allclose(scores, ranker.score(PROMPT, images, batch_size=64), atol=1e-5)
    assert not torch.allclose(scores, ranker.score("a green triangle", images), atol=1e-4)
    assert torch.equal(tiny_random_clip(seed=0).score(PROMPT, images), ranker.score(PROMPT, images))


def test_rank_keeps_the_best_images_best_first(ranker, images):
    scores = ranker.score(PROMPT, images)
    kept_images, kept_scores, order = ranker.rank(PROMPT, images, keep=4)
    assert sorted(order.tolist()) == list(range(12))
    assert torch.allclose(kept_scores, torch.sort(scores, descending=True).values[:4], atol=1e-6)
    assert (kept_scores[:-1] >= kept_scores[1:]).all()
    assert torch.equal(kept_images, images[order[:4]])
    assert torch.allclose(scores[order[:4]], kept_scores, atol=1e-6)

    # a list in, a list out: the very same objects
    as_list = list(images)
    kept_list, _, list_order = ranker.rank(PROMPT, as_list, keep=4)
    assert torch.equal(list_order, order) and all(a is as_list[i] for a, i in zip(kept_list, order[:4].tolist()))


def test_the_ranking_does_not_depend_on_the_order_of_the_images(ranker, images):
    _, kept_scores, order = ranker.rank(PROMPT, images, keep=4)
    permutation = torch.randperm(12, generator=torch.Generator().manual_seed(1))
    _, shuffled_kept_scores, shuffled_order = ranker.rank(PROMPT, images[permutation], keep=4)
    assert permutation[shuffled_order[:4]].tolist() == order[:4].tolist()
    assert torch.allclose(shuffled_kept_scores, kept_scores, atol=1e-6)


def test_pil_images_and_tensors_give_the_same_scores(ranker, images):
    as_uint8 = (images * 255).round().to(torch.uint8)
    pil_images = [Image.fromarray(image.permute(1, 2, 0).numpy()) for image in as_uint8]
    from_pil = ranker.score(PROMPT, pil_images, batch_size=5)
    assert torch.allclose(from_pil, ranker.score(PROMPT, images), atol=1e-5)
    assert torch.allclose(from_pil, ranker.score(PROMPT, as_uint8), atol=1e-5)
    # images of different sizes and modes in one list: each is resized and converted on its own
    mixed = [pil_images[0], pil_images[1].resize((64, 32)), pil_images[2].convert("L"), pil_images[3].convert("RGBA")]
    assert torch.isfinite(ranker.score(PROMPT, mixed)).all()


def test_the_preprocessing_is_clips_own_within_one_8_bit_level():
    """Against transformers' PIL CLIP processor (the reference: resize the short side, bicubic, center crop)."""
    reference = pytest.importorskip("transformers.models.clip.image_processing_pil_clip").CLIPImageProcessorPil(
        size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}
    )
    ranker = tiny_random_clip()
    ranker.image_size = 224  # ViT-B/32's input, on the tiny model: preprocess only
    smooth = torch.nn.functional.interpolate(
        torch.rand(1, 3, 30, 45, generator=torch.Generator().manual_seed(2)), size=(300, 450), mode="bilinear"
    )
    image = Image.fromarray((smooth[0] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())
    expected = torch.from_numpy(reference(image, return_tensors="np")["pixel_values"])
    ours = ranker.preprocess([image])
    assert ours.shape == expected.shape == (1, 3, 224, 224)
    # PIL rounds the resized image to 8 bits; one level is 1 / 255 / std ~ 0.015 after normalization
    assert (ours - expected).abs().max() < 0.02 and (ours - expected).abs().mean() < 0.006


def test_clip_round_trips_through_a_local_folder(ranker, images, tmp_path):
    folder = ranker.save_pretrained(str(tmp_path / "tiny-clip"))
    loaded = ClipRanker.from_pretrained(folder, device="cpu")
    assert loaded.image_size == 32 and loaded.tokenizer(PROMPT)["input_ids"] == ranker.tokenizer(PROMPT)["input_ids"]
    # the weights come back bit for bit; the scores only to float precision: on a busy machine the math libraries may
    # split a sum over fewer threads, in another order (seen once: equal to 4 decimals, not to the last bit)
    saved, reloaded = ranker.model.state_dict(), loaded.model.state_dict()
    assert saved.keys() == reloaded.keys() and all(torch.equal(saved[name], reloaded[name]) for name in saved)
    assert torch.allclose(loaded.score(PROMPT, images), ranker.score(PROMPT, images), rtol=0, atol=1e-5)


def test_clip_loads_from_a_hub_repository(ranker, images, tmp_path, hub_server):
    """transformers' own from_pretrained, in a fresh process, downloads the tiny CLIP from the stand-in Hub."""
    commit = hub_server.add_repo("someone/tiny-clip", ranker.save_pretrained(str(tmp_path / "tiny-clip")))
    torch.save(images, tmp_path / "images.pt")
    stdout = hub_server.run_python(f"""
        import json, torch
        from collab_kit.model.clip_rank import ClipRanker
        ranker = ClipRanker.from_pretrained("someone/tiny-clip", device="cpu")
        images = torch.load({str(tmp_path / "images.pt")!r}, weights_only=True)
        print(json.dumps(ranker.score({PROMPT!r}, images).tolist()))
    """)
    scores = torch.tensor(json.loads(stdout.strip().splitlines()[-1]))
    assert torch.allclose(scores, ranker.score(PROMPT, images), atol=1e-6)
    seen = hub_server.requests
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        assert any(r.startswith("GET /someone/tiny-clip/resolve/") and r.endswith(f"/{name}") for r in seen), name
    assert any(r.startswith("GET cdn:/lfs/") for r in seen)  # model.safetensors, through the "CDN"
    assert commit and hub_server.unserved == []


def test_bad_inputs_say_what_to_do(ranker, images):
    with pytest.raises(ValueError, match="keep=13 is not allowed: expected a number of images from 1 to 12"):
        ranker.rank(PROMPT, images, keep=13)
    with pytest.raises(ValueError, match="keep=0 is not allowed"):
        ranker.rank(PROMPT, images, keep=0)
    with pytest.raises(ValueError, match=r"3 channels, got shape \[12, 1, 40, 48\] \(grayscale"):
        ranker.score(PROMPT, images[:, :1])
    with pytest.raises(ValueError, match=r"3 channels, got shape \[3, 40, 48\] \(one image: pass images\[None\]\)"):
        ranker.score(PROMPT, images[0])
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\].*\(images \+ 1\) / 2"):
        ranker.score(PROMPT, images * 2 - 1)
    with pytest.raises(ValueError, match="no images to score"):
        ranker.rank(PROMPT, [], keep=1)
    with pytest.raises(TypeError, match="prompt must be a str"):
        ranker.score(["two", "prompts"], images)
    with pytest.raises(TypeError, match="must hold PIL images or \\[3, height, width\\] tensors, got a ndarray"):
        ranker.score(PROMPT, [np.zeros((32, 32, 3), dtype=np.uint8)])
    with pytest.raises(ValueError, match=r"each image of a list must be \[3, height, width\]"):
        ranker.score(PROMPT, [images[0, :1]])
    with pytest.raises(OSError, match=r"(?s)could not load CLIP from .* tiny_random_clip\(\) needs neither"):
        ClipRanker.from_pretrained("someone/not-in-the-offline-cache")
