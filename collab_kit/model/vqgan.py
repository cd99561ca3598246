"""The image tokenizer: a VQGAN (Esser et al. 2021) that turns images into grids of codes and back.

The paper's model reads an image as 32x32 = 1024 codes from a codebook of 8192: a 256x256 image
through taming-transformers' Gumbel VQGAN with downsampling factor f=8 (``vqgan_gumbel_f8``). This
module rebuilds that network from taming's own building blocks (``taming.modules``: Encoder,
Decoder, GumbelQuantize, VectorQuantizer2) under the same submodule names as taming's ``GumbelVQ``
and ``VQModel``, so their checkpoints load as they are, without PyTorch Lightning, torchvision or
the training losses that ``taming.models`` needs.

    model = load_vqgan("path/to/vqgan_gumbel_f8")   # or a Hub repo id, or a .ckpt / .safetensors
    codes = model.encode(images)                    # [B, 3, 256, 256] in [0, 1] -> int64 [B, 1024]
    images = model.decode(codes)                    # -> [B, 3, 256, 256] in [0, 1]

A checkpoint folder (what ``save_vqgan`` writes and ``load_vqgan`` reads) is laid out as taming's
released models are, flat or with taming's subfolders:

    folder/
        last.ckpt     (or checkpoints/last.ckpt)  {"state_dict": {name: tensor}} as Lightning saves it
        model.yaml    (or configs/model.yaml)     {"model": {"target": ..., "params": {...}}}

Loading and saving checkpoints (folders, files, the Hub; the safe loader) is collab_kit.model.vqgan_files.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from PIL import Image
from taming.modules.diffusionmodules.model import Decoder, Encoder
from taming.modules.vqvae.quantize import GumbelQuantize, VectorQuantizer2

logger = logging.getLogger(__name__)

CHECKPOINT_NAME, CONFIG_NAME = "last.ckpt", "model.yaml"  # the names in taming's released models
GUMBEL_TARGET, VQ_TARGET = "taming.models.vqgan.GumbelVQ", "taming.models.vqgan.VQModel"
SUPPORTED_TARGETS = (GUMBEL_TARGET, VQ_TARGET)
IGNORED_PREFIXES = ("loss.",)  # the discriminator and LPIPS of training: not part of the tokenizer

ConfigLike = None | dict | str | os.PathLike

# taming's vqgan_gumbel_f8 (configs/model.yaml of the released model): 256x256 -> 32x32 codes of 8192.
# Only ddconfig, n_embed and embed_dim shape the network; the rest is kept so the dict stays a
# complete taming config (the temperature schedule and loss matter to training only).
PAPER_VQGAN_CONFIG: dict[str, Any] = {
    "target": GUMBEL_TARGET,
    "params": {
        "kl_weight": 1.0e-08,
        "embed_dim": 256,
        "n_embed": 8192,
        "monitor": "val/rec_loss",
        "temperature_scheduler_config": {
            "target": "taming.lr_scheduler.LambdaWarmUpCosineScheduler",
            "params": {
                "warm_up_steps": 0,
                "max_decay_steps": 1000001,
                "lr_start": 0.9,
                "lr_max": 0.9,
                "lr_min": 1.0e-06,
            },
        },
        "ddconfig": {
            "double_z": False,
            "z_channels": 256,
            "resolution": 256,
            "in_channels": 3,
            "out_ch": 3,
            "ch": 128,
            "ch_mult": [1, 1, 2, 4],
            "num_res_blocks": 2,
            "attn_resolutions": [32],
            "dropout": 0.0,
        },
        "lossconfig": {"target": "taming.modules.losses.vqperceptual.DummyLoss"},
    },
}

# for tests: f=4 (three levels), 16x16 -> 4x4 codes of 32, one attention block at 8x8 so that path
# runs too. Channels stay multiples of 32 because taming normalizes with GroupNorm(32 groups).
TINY_VQGAN_CONFIG: dict[str, Any] = {
    "target": GUMBEL_TARGET,
    "params": {
        "embed_dim": 8,
        "n_embed": 32,
        "ddconfig": {
            "double_z": False,
            "z_channels": 8,
            "resolution": 16,
            "in_channels": 3,
            "out_ch": 3,
            "ch": 32,
            "ch_mult": [1, 1, 2],
            "num_res_blocks": 1,
            "attn_resolutions": [8],
            "dropout": 0.0,
        },
        "lossconfig": {"target": "taming.modules.losses.vqperceptual.DummyLoss"},
    },
}


class VQGAN(torch.nn.Module):
    """taming's GumbelVQ / VQModel for inference: images <-> codes, with the same parameter names.

    :param config: a taming-style model config ``{"target": ..., "params": {...}}``, see ``build_vqgan``
    """

    def __init__(self, config: dict):
        super().__init__()
        self.config = _plain(_check_config(config))
        params = self.config["params"]
        ddconfig, n_embed, embed_dim = params["ddconfig"], params["n_embed"], params["embed_dim"]
        self.is_gumbel = self.config["target"] == GUMBEL_TARGET

        # taming's Decoder prints the latent shape on construction: keep stdout clean, log it instead
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            self.encoder = Encoder(**ddconfig)
            self.decoder = Decoder(**ddconfig)
        logger.debug(printed.getvalue().strip())
        self.quant_conv = torch.nn.Conv2d(ddconfig["z_channels"], embed_dim, 1)
        self.post_quant_conv = torch.nn.Conv2d(embed_dim, ddconfig["z_channels"], 1)
        if self.is_gumbel:
            # GumbelVQ feeds quant_conv's output (embed_dim channels) to a projection built for
            # z_channels inputs; _check_config made sure the two agree
            self.quantize = GumbelQuantize(
                ddconfig["z_channels"],
                embed_dim,
                n_embed=n_embed,
                kl_weight=params.get("kl_weight", 1e-8),
                temp_init=1.0,
            )
        else:
            self.quantize = VectorQuantizer2(n_embed, embed_dim, beta=0.25)

    @property
    def downsampling_factor(self) -> int:
        """Image pixels per code along each side (8 in the paper): one halving per level but the last."""
        return 2 ** (len(self.config["params"]["ddconfig"]["ch_mult"]) - 1)

    @property
    def codebook_size(self) -> int:
        """The number of distinct codes (8192 in the paper)."""
        return self.config["params"]["n_embed"]

    @property
    def image_size(self) -> int:
        """The side of the square images the model was trained on (256 in the paper)."""
        return self.config["params"]["ddconfig"]["resolution"]

    @property
    def grid_size(self) -> int:
        """The side of the code grid of an ``image_size`` image (32 in the paper: 1024 codes)."""
        return self.image_size // self.downsampling_factor

    @property
    def codebook(self) -> torch.Tensor:
        """The code vectors, ``[codebook_size, embed_dim]``: what ``decode`` looks codes up in."""
        return self.quantize.embed.weight if self.is_gumbel else self.quantize.embedding.weight

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images to codes, deterministically.

        :param images: float ``[B, 3, H, W]`` with values in [0, 1]; H and W multiples of ``downsampling_factor``
        :returns: int64 ``[B, (H / f) * (W / f)]``, the code grid in raster order (row by row)
        """
        self._check_images(images)
        parameter = self.quant_conv.weight
        x = images.to(device=parameter.device, dtype=parameter.dtype) * 2 - 1  # taming works in [-1, 1]
        z = self.quant_conv(self.encoder(x))  # [B, embed_dim, h, w]
        if self.is_gumbel:
            # the most likely code; GumbelQuantize.forward would draw a Gumbel sample around it instead
            codes = self.quantize.proj(z).argmax(dim=1)
        else:
            codes = _nearest_code(z, self.quantize.embedding.weight)
        return codes.flatten(1)  # [B, h, w] -> [B, h * w], row by row

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """Codes to images.

        :param codes: integer ``[B, h * w]`` in raster order, or ``[B, h, w]``, values in [0, codebook_size)
        :param grid: ``(h, w)`` of flat codes; by default the grid is square
        :returns: float ``[B, 3, h * f, w * f]`` with values in [0, 1]
        """
        codes = self._check_codes(codes, grid)  # [B, h, w]
        z_q = F.embedding(codes.to(self.codebook.device), self.codebook)  # [B, h, w, embed_dim]
        x = self.decoder(self.post_quant_conv(z_q.permute(0, 3, 1, 2)))
        return ((x + 1) / 2).clamp(0, 1)

    def _check_images(self, images: torch.Tensor):
        in_channels, f = self.config["params"]["ddconfig"]["in_channels"], self.downsampling_factor
        if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != in_channels:
            shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(
                f"expected images as a float tensor [batch, {in_channels}, height, width] "
                f"with values in [0, 1], got {shape}"
            )
        if not images.is_floating_point():
            raise ValueError(
                f"expected float images with values in [0, 1], got {images.dtype} "
                f"(divide uint8 pixels by 255, or use pil_to_tensor)"
            )
        if images.shape[2] % f or images.shape[3] % f:
            raise ValueError(
                f"expected height and width that are multiples of the downsampling factor {f}, "
                f"got {images.shape[2]}x{images.shape[3]}"
            )
        # catch images already in taming's [-1, 1]: they would encode without error, to the wrong codes
        if images.device.type != "meta" and images.numel() and (images.min() < -1e-3 or images.max() > 1 + 1e-3):
            raise ValueError(
                f"expected image values in [0, 1], got [{images.min():.3g}, {images.max():.3g}] "
                f"(the conversion to taming's [-1, 1] happens inside encode)"
            )

    def _check_codes(self, codes: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
        """Validate codes and return them as an int64 grid ``[B, h, w]``."""
        expected = f"integer codes [batch, h * w] or [batch, h, w] with values in [0, {self.codebook_size})"
        if not isinstance(codes, torch.Tensor) or codes.ndim not in (2, 3):
            shape = tuple(codes.shape) if isinstance(codes, torch.Tensor) else type(codes).__name__
            raise ValueError(f"expected {expected}, got {shape}")
        if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
            raise ValueError(f"expected {expected}, got dtype {codes.dtype}")
        if codes.ndim == 2:
            length = codes.shape[1]
            if grid is None:
                side = round(length**0.5)
                if side * side != length:
                    raise ValueError(f"{length} codes per image do not make a square grid: pass grid=(h, w)")
                grid = (side, side)
            if grid[0] * grid[1] != length:
                raise ValueError(f"grid={tuple(grid)} holds {grid[0] * grid[1]} codes, got {length} per image")
            codes = codes.reshape(codes.shape[0], *grid)
        elif grid is not None and tuple(grid) != tuple(codes.shape[1:]):
            raise ValueError(f"grid={tuple(grid)} does not match codes of shape {tuple(codes.shape)}")
        if codes.device.type != "meta" and codes.numel() and (codes.min() < 0 or codes.max() >= self.codebook_size):
            raise ValueError(f"expected {expected}, got values in [{int(codes.min())}, {int(codes.max())}]")
        return codes.long()


def _nearest_code(z: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """The index of the nearest codebook vector (Euclidean) to each position of ``z`` [B, d, h, w] -> [B, h, w]."""
    flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
    # |z - e|^2 = |z|^2 - 2 z.e + |e|^2, as VectorQuantizer2 computes it: no [N, K, d] tensor in memory
    distances = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ codebook.t() + codebook.pow(2).sum(1)
    return distances.argmin(dim=1).reshape(z.shape[0], z.shape[2], z.shape[3])


# ---------------------------------------------------------------------------------------------
# configs


def _plain(value):
    """A deep copy made of dicts, lists and scalars only (YAML's safe dumper refuses tuples)."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return copy.deepcopy(value)


def _read_config(config: ConfigLike) -> dict:
    """A taming-style dict from a dict or a YAML path; the top-level ``model:`` section is optional."""
    if config is None:
        return copy.deepcopy(PAPER_VQGAN_CONFIG)
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            loaded = yaml.safe_load(f)
        if not isinstance(loaded, dict):
            raise ValueError(f"{os.fspath(config)!r} holds no taming model config (a mapping with target and params)")
        config = loaded
    if not isinstance(config, dict):
        raise TypeError(f"expected a config dict or a path to a YAML file, got {type(config).__name__}")
    if "model" in config and "target" not in config:
        return config["model"]
    return config


def _check_config(config: dict) -> dict:
    if not isinstance(config, dict) or "target" not in config or not isinstance(config.get("params"), dict):
        raise ValueError(
            'expected a taming model config {"target": ..., "params": {...}}, '
            f"got keys {sorted(config) if isinstance(config, dict) else type(config).__name__}"
        )
    if config["target"] not in SUPPORTED_TARGETS:
        raise ValueError(f"unsupported VQGAN target {config['target']!r}: supported are {', '.join(SUPPORTED_TARGETS)}")
    params = config["params"]
    missing = [key for key in ("ddconfig", "n_embed", "embed_dim") if key not in params]
    if missing:
        raise ValueError(f"the VQGAN config's params lack {', '.join(missing)}")
    for key in ("remap", "colorize_nlabels"):  # both change the state dict; no released tokenizer uses them
        if params.get(key) is not None:
            raise ValueError(f"params.{key} is not supported by collab_kit.model.vqgan (got {params[key]!r})")
    ddconfig = params["ddconfig"]
    missing = [
        key
        for key in (
            "ch",
            "ch_mult",
            "num_res_blocks",
            "attn_resolutions",
            "in_channels",
            "out_ch",
            "resolution",
            "z_channels",
        )
        if key not in ddconfig
    ]
    if missing:
        raise ValueError(f"the VQGAN config's ddconfig lacks {', '.join(missing)}")
    if ddconfig.get("double_z", True):
        # taming's Encoder defaults to double_z=True (a KL autoencoder's mean and variance): a VQGAN has one z
        raise ValueError("ddconfig.double_z must be False for a VQGAN (taming's Encoder defaults to True)")
    if ddconfig["ch"] % 32:
        raise ValueError(
            f"ddconfig.ch must be a multiple of 32 (taming's GroupNorm has 32 groups), got {ddconfig['ch']}"
        )
    if config["target"] == GUMBEL_TARGET and ddconfig["z_channels"] != params["embed_dim"]:
        raise ValueError(
            f"a GumbelVQ needs ddconfig.z_channels == embed_dim (its quantizer projects quant_conv's "
            f"output), got {ddconfig['z_channels']} and {params['embed_dim']}"
        )
    return config


def build_vqgan(config: ConfigLike = None) -> VQGAN:
    """A VQGAN with freshly initialized weights, from a taming config.

    :param config: ``{"target": ..., "params": {...}}`` as in taming's YAML ``model:`` section, the same
      wrapped in ``{"model": ...}``, or a path to such a YAML file; by default ``PAPER_VQGAN_CONFIG``.
      Targets: ``taming.models.vqgan.GumbelVQ`` (Gumbel quantizer) and ``taming.models.vqgan.VQModel``.
    """
    return VQGAN(_read_config(config))


def untrained_vqgan(grid_size: int, codebook_size: int, seed: int = 0) -> VQGAN:
    """A small VQGAN with random weights whose code grid is ``grid_size`` (f=4, images of 4 x grid_size pixels).

    For the demo and tests, where no trained tokenizer can be downloaded: its codes are not a good
    image code, but they follow the picture (a color, a shape give the same codes every time), so a
    model trained on them has something real to learn.
    """
    config = copy.deepcopy(TINY_VQGAN_CONFIG)
    config["params"]["n_embed"] = codebook_size
    config["params"]["ddconfig"].update(resolution=4 * grid_size, attn_resolutions=[])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_vqgan(config).eval()


# ---------------------------------------------------------------------------------------------
# PIL images <-> tensors


def pil_to_tensor(images: Image.Image | Sequence[Image.Image], size: int | None = None) -> torch.Tensor:
    """PIL images to a float batch ``[B, 3, H, W]`` in [0, 1], what ``VQGAN.encode`` takes.

    :param images: one image or a list of images of the same size (any mode: converted to RGB)
    :param size: if given, resize the shorter side to ``size`` (bicubic) and crop the center square,
      as images are prepared for the paper's 256x256 tokenizer
    """
    if isinstance(images, Image.Image):
        images = [images]
    tensors = []
    for image in images:
        image = image.convert("RGB")
        if size is not None:
            scale = size / min(image.size)
            width, height = max(size, round(image.width * scale)), max(size, round(image.height * scale))
            image = image.resize((width, height), Image.Resampling.BICUBIC)
            left, top = (width - size) // 2, (height - size) // 2
            image = image.crop((left, top, left + size, top + size))
        tensors.append(torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255)  # HWC uint8 -> CHW
    if len({tuple(tensor.shape) for tensor in tensors}) > 1:
        raise ValueError("images of different sizes cannot form one batch: pass size= to crop them alike")
    return torch.stack(tensors)


def images_to_pil(images: torch.Tensor) -> list[Image.Image]:
    """A float batch ``[B, 3, H, W]`` in [0, 1] (what ``VQGAN.decode`` returns) to RGB PIL images."""
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"expected images as a float tensor [batch, 3, height, width] in [0, 1], got {shape}")
    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()
    return [Image.fromarray(image.numpy()) for image in pixels]
