"""The VQGAN tokenizer: codes of the right shape and meaning, checkpoints that round-trip, clear errors.

Every model here is built from a config (tiny ones, and the paper's on the meta device): no weights
can be downloaded on the machines the tests run on.
"""

import argparse
import copy
import json
import os
import shutil

import pytest
import safetensors.torch
import torch
import yaml
from PIL import Image

from collab_kit.model.vqgan import (
    CHECKPOINT_NAME,
    CONFIG_NAME,
    GUMBEL_TARGET,
    PAPER_VQGAN_CONFIG,
    TINY_VQGAN_CONFIG,
    VQ_TARGET,
    build_vqgan,
    images_to_pil,
    pil_to_tensor,
)
from collab_kit.model.vqgan_files import load_vqgan, save_vqgan

TINY_VQ_CONFIG = dict(copy.deepcopy(TINY_VQGAN_CONFIG), target=VQ_TARGET)
CONFIGS = {"gumbel": TINY_VQGAN_CONFIG, "vq": TINY_VQ_CONFIG}


def make_model(kind: str = "gumbel", seed: int = 0):
    torch.manual_seed(seed)
    model = build_vqgan(CONFIGS[kind]).eval()
    if kind == "vq":
        # taming draws the codebook in [-1/n, 1/n], not where the encoder's vectors lie: take the codebook
        # from encoded images (2 images x 4x4 positions = 32 codes) so that encoding other images varies
        with torch.no_grad():
            z = model.quant_conv(model.encoder(images(seed=99) * 2 - 1))
            model.quantize.embedding.weight.copy_(z.permute(0, 2, 3, 1).reshape(32, -1))
    return model


def images(batch=2, height=16, width=16, seed=0):
    return torch.rand(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["gumbel", "vq"])
def test_encode_decode_shapes_ranges_and_determinism(kind):
    model = make_model(kind)
    assert model.downsampling_factor == 4 and model.codebook_size == 32 and model.image_size == 16
    assert model.grid_size == 4 and model.is_gumbel == (kind == "gumbel")
    x = images(batch=3)
    codes = model.encode(x)
    assert codes.shape == (3, 16) and codes.dtype == torch.int64
    assert 0 <= codes.min() and codes.max() < 32
    assert len(codes.unique()) > 1, "a random encoder should not map every position to one code"
    assert torch.equal(model.encode(x), codes)  # no Gumbel noise at inference
    assert torch.equal(model.encode(x[1:2]), codes[1:2])  # an image's codes do not depend on its batch

    decoded = model.decode(codes)
    assert decoded.shape == (3, 3, 16, 16) and decoded.dtype == torch.float32
    assert 0 <= decoded.min() and decoded.max() <= 1
    assert torch.equal(model.decode(codes), decoded)
    assert torch.equal(model.decode(model.encode(x)), decoded)


@pytest.mark.parametrize("kind", ["gumbel", "vq"])
def test_rectangular_images_and_grid_forms(kind):
    model = make_model(kind)
    codes = model.encode(images(height=16, width=32))
    assert codes.shape == (2, 4 * 8)
    flat = model.decode(codes, grid=(4, 8))
    assert flat.shape == (2, 3, 16, 32)
    assert torch.equal(model.decode(codes.view(2, 4, 8)), flat)  # [B, h, w] is the same grid, row by row
    assert torch.equal(model.decode(codes.int(), grid=(4, 8)), flat)  # any integer dtype


def test_gumbel_encode_is_the_argmax_of_the_quantizer_logits_in_raster_order():
    model = make_model("gumbel")
    x = images(height=16, width=32)
    with torch.no_grad():
        logits = model.quantize.proj(model.quant_conv(model.encoder(x * 2 - 1)))  # [B, K, h, w]
    codes = model.encode(x).view(2, 4, 8)
    assert torch.equal(codes, logits.argmax(dim=1))
    assert len(codes.unique()) > 1


def test_vq_encode_is_the_nearest_code_in_raster_order():
    # put the encoder's own vectors into the codebook at known indices: each position's nearest code
    # (at distance 0) is then known, and so is the order in which encode must list them
    model = make_model("vq")
    x = images(batch=2, height=16, width=16)
    with torch.no_grad():
        z = model.quant_conv(model.encoder(x * 2 - 1))  # [2, 8, 4, 4]: 32 positions, 32 codes
        positions = z.permute(0, 2, 3, 1).reshape(32, 8)  # image by image, row by row
        permutation = torch.randperm(32, generator=torch.Generator().manual_seed(1))
        model.quantize.embedding.weight[permutation] = positions
    assert torch.equal(model.encode(x), permutation.view(2, 16))


def test_decode_looks_codes_up_in_the_codebook():
    model = make_model("gumbel")
    codes = torch.zeros(1, 16, dtype=torch.long)
    codes[0, 5] = 7
    decoded = model.decode(codes)

    changed = codes.clone()
    changed[0, 5] = 8
    assert not torch.allclose(model.decode(changed), decoded), "one other code must change the image"

    with torch.no_grad():
        model.codebook[20] += 1.0  # a code the grid does not use
    assert torch.equal(model.decode(codes), decoded)
    with torch.no_grad():
        model.codebook[7] += 1.0  # the code at one position
    assert not torch.allclose(model.decode(codes), decoded)


@pytest.mark.parametrize("kind", ["gumbel", "vq"])
def test_save_load_round_trip(tmp_path, kind):
    model = make_model(kind, seed=0)
    x = images()
    codes, decoded = model.encode(x), model.decode(model.encode(x))
    folder = tmp_path / "vqgan"
    save_vqgan(model, folder)
    assert sorted(os.listdir(folder)) == sorted([CHECKPOINT_NAME, CONFIG_NAME])  # no staging files left
    with open(folder / CONFIG_NAME) as f:
        assert yaml.safe_load(f) == {"model": model.config}
    assert set(torch.load(folder / CHECKPOINT_NAME, weights_only=True)) == {"state_dict"}

    torch.manual_seed(1)  # other initial weights: only loading can make the codes equal
    loaded = load_vqgan(str(folder))
    assert not loaded.training and loaded.config == model.config
    assert torch.equal(loaded.encode(x), codes)
    assert torch.equal(loaded.decode(codes), decoded)

    save_vqgan(make_model(kind, seed=2), folder)  # overwriting replaces both files
    assert not torch.equal(load_vqgan(folder).encode(x), codes)


def write_taming_layout(folder, state_dict, config, **extra):
    """A checkpoint as taming releases them: checkpoints/last.ckpt (Lightning) and configs/model.yaml."""
    os.makedirs(folder / "checkpoints"), os.makedirs(folder / "configs")
    torch.save({"state_dict": state_dict, **extra}, folder / "checkpoints" / "last.ckpt")
    with open(folder / "configs" / "model.yaml", "w") as f:
        yaml.safe_dump({"model": config}, f)


def lightning_state_dict(model):
    state_dict = dict(model.state_dict())
    # what taming's training adds: the discriminator and LPIPS of the loss
    state_dict["loss.discriminator.main.0.weight"] = torch.randn(64, 3, 4, 4)
    state_dict["loss.perceptual_loss.lin0.model.1.weight"] = torch.randn(1, 64, 1, 1)
    return state_dict


def test_load_taming_lightning_checkpoint(tmp_path):
    model = make_model("gumbel")
    x = images()
    write_taming_layout(
        tmp_path,
        lightning_state_dict(model),
        TINY_VQGAN_CONFIG,
        global_step=1234,
        epoch=3,
        optimizer_states=[{"state": {}, "param_groups": [{"lr": 4.5e-6}]}],
    )
    torch.manual_seed(1)
    for location in (tmp_path, tmp_path / "checkpoints" / "last.ckpt"):  # folder, or the file (../configs)
        loaded = load_vqgan(location)
        assert torch.equal(loaded.encode(x), model.encode(x))
        assert torch.equal(loaded.decode(model.encode(x)), model.decode(model.encode(x)))


class HyperParameters(dict):
    """A dict subclass, like Lightning's AttributeDict: the safe loader cannot fill one."""


class WritesAFile:
    """Unpickling this calls shutil.copyfile: what a malicious checkpoint could do with worse functions."""

    def __init__(self, source, destination):
        self.source, self.destination = source, destination

    def __reduce__(self):
        return shutil.copyfile, (self.source, self.destination)


def test_lightning_objects_load_without_running_their_code(tmp_path):
    model = make_model("gumbel")
    marker = tmp_path / "made_by_unpickling"
    # taming's checkpoints key their callbacks' states by the callback class and pickle other objects
    write_taming_layout(
        tmp_path,
        lightning_state_dict(model),
        TINY_VQGAN_CONFIG,
        callbacks={argparse.Namespace: {"best_model_score": torch.tensor(0.5)}},
        hyper_parameters=argparse.Namespace(n_embed=32),
        sneaky=WritesAFile(str(tmp_path / "configs" / "model.yaml"), str(marker)),
    )
    loaded = load_vqgan(tmp_path)
    assert torch.equal(loaded.encode(images()), model.encode(images()))
    assert not marker.exists(), "the safe loader must not call what the checkpoint names"

    loaded = load_vqgan(tmp_path, trust_checkpoint=True)  # plain unpickling: it runs the checkpoint's code
    assert marker.exists() and torch.equal(loaded.encode(images()), model.encode(images()))


def test_objects_the_safe_loader_refuses_need_trust(tmp_path):
    model = make_model("gumbel")
    write_taming_layout(
        tmp_path, lightning_state_dict(model), TINY_VQGAN_CONFIG, hyper_parameters=HyperParameters(n_embed=32)
    )
    with pytest.raises(ValueError, match="If you trust its source.*trust_checkpoint=True.*HyperParameters"):
        load_vqgan(tmp_path)
    loaded = load_vqgan(tmp_path, trust_checkpoint=True)
    assert torch.equal(loaded.encode(images()), model.encode(images()))


def test_safetensors_file_with_explicit_config(tmp_path):
    model = make_model("vq")
    path = tmp_path / "vqgan.safetensors"
    safetensors.torch.save_file(model.state_dict(), path)
    with open(tmp_path / "other.yaml", "w") as f:
        yaml.safe_dump(TINY_VQ_CONFIG, f)  # without the model: section
    for config in (TINY_VQ_CONFIG, str(tmp_path / "other.yaml")):
        loaded = load_vqgan(path, config=config)
        assert torch.equal(loaded.encode(images()), model.encode(images()))


def test_checkpoints_that_do_not_fit_are_clear_errors(tmp_path):
    state_dict = make_model("gumbel").state_dict()
    del state_dict["decoder.conv_out.weight"]
    torch.save({"state_dict": state_dict}, tmp_path / "missing.ckpt")
    with pytest.raises(ValueError, match=r"missing \['decoder.conv_out.weight'\]"):
        load_vqgan(tmp_path / "missing.ckpt", config=TINY_VQGAN_CONFIG)

    torch.save(make_model("gumbel").state_dict(), tmp_path / "plain.pt")  # a bare state dict is fine...
    load_vqgan(tmp_path / "plain.pt", config=TINY_VQGAN_CONFIG)
    with pytest.raises(ValueError, match="missing.*quantize.embedding.weight.*unexpected.*quantize.embed.weight"):
        load_vqgan(tmp_path / "plain.pt", config=TINY_VQ_CONFIG)  # ...but not under another quantizer
    wider = copy.deepcopy(TINY_VQGAN_CONFIG)
    wider["params"]["n_embed"] = 64
    with pytest.raises(ValueError, match="(?s)does not fit its config.*size mismatch"):
        load_vqgan(tmp_path / "plain.pt", config=wider)

    torch.save({"state_dict": [1, 2]}, tmp_path / "odd.ckpt")
    with pytest.raises(ValueError, match="not a VQGAN checkpoint"):
        load_vqgan(tmp_path / "odd.ckpt", config=TINY_VQGAN_CONFIG)
    os.makedirs(tmp_path / "empty_folder")
    with pytest.raises(FileNotFoundError, match="last.ckpt"):
        load_vqgan(tmp_path / "empty_folder")
    with pytest.raises(FileNotFoundError, match="Hub repository id"):
        load_vqgan(tmp_path / "nowhere" / "vqgan.ckpt")


def test_paper_config_on_the_meta_device(tmp_path):
    with torch.device("meta"):
        model = build_vqgan()
    assert model.config == PAPER_VQGAN_CONFIG and model.config["target"] == GUMBEL_TARGET
    assert model.downsampling_factor == 8 and model.codebook_size == 8192 and model.image_size == 256
    assert model.grid_size == 32 and tuple(model.codebook.shape) == (8192, 256)
    codes = model.encode(torch.empty(2, 3, 256, 256, device="meta"))
    assert codes.shape == (2, 32 * 32) and codes.dtype == torch.int64
    assert model.decode(codes).shape == (2, 3, 256, 256)

    # the same config read from a taming YAML with its model: section
    with open(tmp_path / "model.yaml", "w") as f:
        yaml.safe_dump({"model": PAPER_VQGAN_CONFIG}, f)
    with torch.device("meta"):
        assert build_vqgan(str(tmp_path / "model.yaml")).config == PAPER_VQGAN_CONFIG


def test_bad_configs_are_clear_errors():
    with pytest.raises(ValueError, match="supported are taming.models.vqgan.GumbelVQ, taming.models.vqgan.VQModel"):
        build_vqgan(dict(TINY_VQGAN_CONFIG, target="taming.models.vqgan.VQSegmentationModel"))
    for key, value, message in [
        ("z_channels", 16, "z_channels == embed_dim"),
        ("ch", 8, "multiple of 32"),
        ("double_z", True, "double_z must be False"),
    ]:
        config = copy.deepcopy(TINY_VQGAN_CONFIG)
        config["params"]["ddconfig"][key] = value
        with pytest.raises(ValueError, match=message):
            build_vqgan(config)
    with pytest.raises(ValueError, match="lack n_embed"):
        build_vqgan({"target": VQ_TARGET, "params": {"ddconfig": {}, "embed_dim": 8}})


def test_bad_inputs_say_what_is_expected():
    model = make_model("gumbel")
    bad_images = [
        (torch.rand(2, 1, 16, 16), r"expected images as a float tensor \[batch, 3, height, width\].*\(2, 1, 16, 16\)"),
        (torch.rand(3, 16, 16), r"\[batch, 3, height, width\]"),
        ((torch.rand(2, 3, 16, 16) * 255).to(torch.uint8), "expected float images.*torch.uint8"),
        (torch.rand(2, 3, 16, 18), "multiples of the downsampling factor 4, got 16x18"),
        (torch.rand(2, 3, 16, 16) * 2 - 1, r"expected image values in \[0, 1\]"),
    ]
    for bad, message in bad_images:
        with pytest.raises(ValueError, match=message):
            model.encode(bad)
    bad_codes = [
        (torch.full((1, 16), 32), r"values in \[0, 32\), got values in \[32, 32\]"),
        (torch.full((1, 16), -1), r"values in \[0, 32\), got values in \[-1, -1\]"),
        (torch.zeros(1, 16), "got dtype torch.float32"),
        (torch.zeros(16, dtype=torch.long), r"\[batch, h \* w\] or \[batch, h, w\].*\(16,\)"),
        (torch.zeros(1, 15, dtype=torch.long), r"15 codes per image do not make a square grid: pass grid=\(h, w\)"),
    ]
    for bad, message in bad_codes:
        with pytest.raises(ValueError, match=message):
            model.decode(bad)
    with pytest.raises(ValueError, match=r"grid=\(4, 3\) holds 12 codes, got 16"):
        model.decode(torch.zeros(1, 16, dtype=torch.long), grid=(4, 3))


def test_pil_helpers_round_trip():
    model = make_model("gumbel")
    decoded = model.decode(model.encode(images()))
    pictures = images_to_pil(decoded)
    assert len(pictures) == 2 and pictures[0].size == (16, 16) and pictures[0].mode == "RGB"
    back = pil_to_tensor(pictures)
    assert back.shape == (2, 3, 16, 16) and (back - decoded).abs().max() <= 0.5 / 255 + 1e-6

    # a 40x20 grayscale picture: shorter side to 16, center square kept, three channels
    wide = Image.linear_gradient("L").resize((40, 20))
    tensor = pil_to_tensor(wide, size=16)
    assert tensor.shape == (1, 3, 16, 16) and 0 <= tensor.min() and tensor.max() <= 1
    assert torch.equal(tensor[:, 0], tensor[:, 1])
    assert model.encode(tensor).shape == (1, 16)
    with pytest.raises(ValueError, match="different sizes"):
        pil_to_tensor([wide, Image.new("RGB", (8, 8))])


def test_load_from_a_hub_repository(hub_server, tmp_path):
    # the real huggingface_hub client, in a subprocess, downloads from the stand-in Hub on 127.0.0.1
    model = make_model("gumbel")
    save_vqgan(model, tmp_path / "repo")
    hub_server.add_repo("collab/tiny-vqgan", str(tmp_path / "repo"))
    os.makedirs(tmp_path / "weights_only")
    shutil.copy(tmp_path / "repo" / CHECKPOINT_NAME, tmp_path / "weights_only" / "vqgan.ckpt")
    hub_server.add_repo("collab/weights-only", str(tmp_path / "weights_only"))

    output = hub_server.run_python(f"""
        import json, torch
        from collab_kit.model.vqgan import TINY_VQGAN_CONFIG
        from collab_kit.model.vqgan_files import load_vqgan
        x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
        model = load_vqgan("collab/tiny-vqgan")
        torch.save(model.decode(model.encode(x)), {str(tmp_path / "decoded.pt")!r})
        print(json.dumps(dict(codes=model.encode(x).tolist())))
        # no model.yaml in the repository: the config is given, and the checkpoint has another name
        model = load_vqgan("collab/weights-only", config=TINY_VQGAN_CONFIG, filename="vqgan.ckpt")
        print(json.dumps(dict(codes=model.encode(x).tolist())))
        try:
            load_vqgan("collab/no-such-repo")
        except Exception as e:
            print(json.dumps(dict(error=type(e).__name__)))
    """)
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    x = images()
    assert lines[0]["codes"] == lines[1]["codes"] == model.encode(x).tolist()
    # another process may sum convolutions in another order (thread counts): equal up to float rounding
    assert torch.allclose(
        torch.load(tmp_path / "decoded.pt", weights_only=True), model.decode(model.encode(x)), rtol=0, atol=1e-5
    )
    assert lines[2]["error"] == "RepositoryNotFoundError"
    assert any(f"/collab/tiny-vqgan/resolve/main/{CONFIG_NAME}" in request for request in hub_server.requests)


def test_an_untrained_vqgan_gives_codes_that_follow_the_picture():
    from collab_kit.data.synthetic import Scene, draw
    from collab_kit.model.vqgan import untrained_vqgan

    vqgan = untrained_vqgan(grid_size=8, codebook_size=256, seed=0)
    assert (vqgan.grid_size, vqgan.codebook_size, vqgan.image_size) == (8, 256, 32)
    again = untrained_vqgan(grid_size=8, codebook_size=256, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(vqgan.state_dict().values(), again.state_dict().values()))

    def codes(color, shape, background):
        scene = Scene(shape=shape, color=color, size="large", position="center", background=background)
        return vqgan.encode(pil_to_tensor(draw(scene, 32)))[0]

    red_square = codes("red", "square", "dark grey")
    assert torch.equal(red_square, codes("red", "square", "dark grey"))
    assert not torch.equal(red_square, codes("green", "square", "dark grey"))
    assert not torch.equal(red_square, codes("red", "cross", "dark grey"))
