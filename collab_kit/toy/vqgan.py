"""The toy world's image tokenizer: a tiny taming VQGAN (f=8) trained on the toy pictures, shipped with the package.

The paper's tokenizer cannot be downloaded here, and an untrained one gives codes that cannot be
drawn back into pictures. This module trains a small VQGAN of taming's own modules (``VQModel``
with ``VectorQuantizer2``, see ``collab_kit.model.vqgan``) on ``collab_kit.data.synthetic`` pictures: 64x64 pictures
to 8x8 = 64 codes of a codebook of 512, and back. Its weights (a few MB) ship in
``collab_kit/toy/assets/vqgan``, so nothing is trained at demo time:

    vqgan = load_toy_vqgan()                        # eval mode, from the shipped files
    codes = vqgan.encode(pil_to_tensor(images))     # [B, 3, 64, 64] in [0, 1] -> int64 [B, 64]
    toy_vqgan_metrics()["psnr_db"]                  # its held-out reconstruction PSNR, as trained

Training (``collab-kit toy train-vqgan --output FOLDER``, 18 to 25 minutes on one CPU core) uses a
reconstruction loss (L1 + L2, each pixel on a colour edge weighted ``1 + EDGE_WEIGHT``) and the quantizer's
codebook / commitment loss only: the discriminator and LPIPS of taming's training need downloads and are
not needed for flat-coloured pictures. Codes that no picture uses are moved onto encoder outputs now and then,
so the whole codebook is used.
The held-out pictures (``synthetic.scenes(count, seed=HELD_OUT_SEED)``) are never trained on: training
draws from other seeds and skips any scene that the held-out set contains.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from collab_kit.data import synthetic
from collab_kit.data.scene_scores import scene_scores
from collab_kit.errors import CollabKitError
from collab_kit.model.vqgan import CHECKPOINT_NAME, CONFIG_NAME, VQ_TARGET, VQGAN, build_vqgan, images_to_pil
from collab_kit.model.vqgan_files import load_vqgan, save_vqgan

logger = logging.getLogger(__name__)

TOY_VQGAN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "vqgan")
METRICS_NAME = "metrics.json"

# 64x64 -> 8x8 codes: four ch_mult levels halve the side three times (f=8, as the paper's tokenizer).
# ch=32 is the least taming's GroupNorm (32 groups) allows; the full-resolution layers cost most of
# the time, the deeper ones most of the weights (about 1.1M parameters: 4.3 MB in float32). 512 codes
# cover a patch's two colours (8 shape colours x 3 backgrounds) and where the edge between them runs.
TOY_VQGAN_CONFIG = {
    "target": VQ_TARGET,
    "params": {
        "embed_dim": 32,
        "n_embed": 512,
        "ddconfig": {
            "double_z": False,
            "z_channels": 32,
            "resolution": synthetic.IMAGE_SIZE,
            "in_channels": 3,
            "out_ch": 3,
            "ch": 32,
            "ch_mult": [1, 1, 2, 2],
            "num_res_blocks": 1,
            "attn_resolutions": [],
            "dropout": 0.0,
        },
        "lossconfig": {"target": "taming.modules.losses.vqperceptual.DummyLoss"},
    },
}

HELD_OUT_SEED = 999  # the held-out pictures: synthetic.scenes(HELD_OUT_COUNT, seed=HELD_OUT_SEED)
HELD_OUT_COUNT = 256
# training batch `step` of run `seed` draws synthetic.scenes(batch_size, seed=TRAIN_SEED_BASE * (seed + 1) + step):
# seeds of a million and up, far from HELD_OUT_SEED and from the seeds the toy dataset uses
TRAIN_SEED_BASE = 1_000_000

# about 0.4 s a step at batch 8 on one core (the time per picture is the same at batch 8, 16 or 24, and
# more, smaller steps learn more from the same pictures): 18 minutes alone, 25 beside other work. The shipped model is
# this default.
DEFAULT_STEPS = 2400
DEFAULT_BATCH_SIZE = 8
DEFAULT_LR = 2e-3
# the reconstruction error of a pixel on a colour edge counts 1 + EDGE_WEIGHT times: the edges are a few percent of a
# picture, and an even loss buys its PSNR in the flat parts while it rounds the corners that tell a shape (with 8: the
# held-out shape_match of reconstructions 0.70 -> 0.85, PSNR 28.9 -> 30.0 dB)
EDGE_WEIGHT = 8.0


class ToyVQGANMissing(CollabKitError, FileNotFoundError):
    """The shipped toy VQGAN is not where it should be."""


# ---------------------------------------------------------------------------------------------
# the shipped model


def load_toy_vqgan(folder: str | None = None, map_location="cpu") -> VQGAN:
    """The toy VQGAN shipped with the package (or trained into ``folder``), in eval mode.

    :param folder: a folder written by ``train_toy_vqgan``; by default ``TOY_VQGAN_DIR``
    :param map_location: the device to load it to
    """
    folder = folder or TOY_VQGAN_DIR
    missing = [name for name in (CHECKPOINT_NAME, CONFIG_NAME) if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        raise ToyVQGANMissing(
            f"the toy VQGAN is missing from {folder} (no {', '.join(missing)}): train it with "
            f"`collab-kit toy train-vqgan --output {folder}` (18 to 25 minutes on one CPU core)"
        )
    return load_vqgan(folder, map_location=map_location)


def toy_vqgan_metrics(folder: str | None = None) -> dict:
    """What training measured on the held-out pictures (``metrics.json``): ``psnr_db``, ``color_match``, ...

    :param folder: a folder written by ``train_toy_vqgan``; by default ``TOY_VQGAN_DIR``
    """
    path = os.path.join(folder or TOY_VQGAN_DIR, METRICS_NAME)
    if not os.path.isfile(path):
        raise ToyVQGANMissing(
            f"no {METRICS_NAME} in {folder or TOY_VQGAN_DIR}: train the toy VQGAN with "
            f"`collab-kit toy train-vqgan --output {folder or TOY_VQGAN_DIR}`"
        )
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------
# pictures and measures


def scenes_to_tensor(scenes: Sequence[synthetic.Scene]) -> torch.Tensor:
    """Draw ``scenes`` as a float batch ``[B, 3, 64, 64]`` in [0, 1], what ``VQGAN.encode`` takes."""
    pixels = np.stack([np.asarray(synthetic.draw(scene)) for scene in scenes])  # [B, H, W, 3] uint8
    return torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255


def psnr_db(reconstructions: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """The PSNR of each reconstruction (peak 1: images in [0, 1]), in dB, ``[B]``; capped at 100 dB when exact."""
    mse = (reconstructions.float() - images.float()).pow(2).flatten(1).mean(1)
    return 10 * torch.log10(1 / mse.clamp_min(1e-10))


@torch.no_grad()
def evaluate_toy_vqgan(
    model: VQGAN, count: int = HELD_OUT_COUNT, seed: int = HELD_OUT_SEED, batch_size: int = 64
) -> dict:
    """Reconstruct ``count`` held-out pictures, ``decode(encode(x))``, and measure them against ``x``.

    :param model: the VQGAN (put in eval mode for the measure, then back as it was)
    :param count: how many pictures of ``synthetic.scenes(count, seed)``; the first ``n`` of them are those of a smaller
      count
    :param seed: their seed (the held-out one by default)
    :param batch_size: pictures per forward pass
    :returns: ``psnr_db`` (mean over pictures of each one's PSNR), ``color_match`` (share of reconstructions
      whose ``synthetic.dominant_color`` is the caption's colour), ``shape_match``, ``place_match`` and
      ``size_match`` (collab_kit.data.scene_scores: the most a model that draws these codes can score),
      ``codes_used`` (distinct codes among them), ``held_out`` (count) and ``held_out_seed``
    """
    was_training = model.training
    model.eval()
    scenes = synthetic.scenes(count, seed=seed)
    psnrs, matches, used, drawn = [], 0, set(), []
    try:
        for start in range(0, count, batch_size):
            batch = scenes[start : start + batch_size]
            images = scenes_to_tensor(batch)
            codes = model.encode(images)
            reconstructions = model.decode(codes).cpu()
            psnrs.append(psnr_db(reconstructions, images))
            used.update(codes.unique().tolist())
            for scene, picture in zip(batch, images_to_pil(reconstructions)):
                matches += synthetic.dominant_color(picture) == scene.color
                drawn.append(picture)
    finally:
        model.train(was_training)
    read = scene_scores(drawn, [scene.caption for scene in scenes])
    return dict(
        psnr_db=round(float(torch.cat(psnrs).mean()), 3),
        color_match=round(matches / count, 4),
        shape_match=round(read["shape"], 4),
        place_match=round(read["place"], 4),
        size_match=round(read["size"], 4),
        codes_used=len(used),
        held_out=count,
        held_out_seed=seed,
    )


# ---------------------------------------------------------------------------------------------
# training


def training_scenes(batch_size: int, step: int, seed: int, excluded: set) -> list[synthetic.Scene]:
    """The scenes of training batch ``step``: ``synthetic.scenes`` of a training seed, held-out scenes left out.

    The world holds 1,200 distinct scenes, so a training stream would meet
    held-out ones by chance; those are dropped and the batch is filled up from the same seed.
    """
    rng = np.random.default_rng(TRAIN_SEED_BASE * (seed + 1) + step)
    scenes = []
    while len(scenes) < batch_size:
        scene = synthetic.random_scene(rng)
        if scene not in excluded:
            scenes.append(scene)
    return scenes


def initialize_for_training(model: VQGAN) -> VQGAN:
    """Re-initialize ``model``'s convolutions so that a small taming VQGAN trains fast from scratch.

    PyTorch's default convolution init shrinks the signal layer by layer, and taming's residual
    blocks then start far from the identity: a tiny model spends its first hundreds of steps
    predicting the average picture. He-normal weights, zero biases and a zero last convolution in
    every residual block (each block starts as the identity, as in Goyal et al. 2017) let the
    colours through from the first steps. Only the initial weights change, not the network.
    """
    # lazy: taming-transformers' blocks load only when this model is built
    from taming.modules.diffusionmodules.model import ResnetBlock

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                torch.nn.init.zeros_(module.bias)
        for module in model.modules():
            if isinstance(module, ResnetBlock):
                torch.nn.init.zeros_(module.conv2.weight)
    return model


def _learning_rate(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then a cosine down to lr / 20."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def _restart_codes(codebook: torch.Tensor, dead: torch.Tensor, z: torch.Tensor, generator: torch.Generator) -> int:
    """Move the ``dead`` codes onto encoder outputs ``z`` [N, d] picked at random (a little noise keeps them apart).

    A code no output is nearest to gets no gradient and would stay dead for good: on an encoder
    output it is nearest to something at once.
    """
    indices = dead.nonzero().flatten()
    if len(indices) == 0:
        return 0
    picks = torch.randint(len(z), (len(indices),), generator=generator)
    noise = torch.randn(len(indices), z.shape[1], generator=generator) * z.std() * 0.01
    codebook[indices] = z[picks] + noise
    return len(indices)


def train_toy_vqgan(
    output_folder: str | os.PathLike,
    steps: int = DEFAULT_STEPS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
    lr: float = DEFAULT_LR,
    progress: bool = True,
    config: dict | None = None,
    held_out: int = HELD_OUT_COUNT,
    restart_every: int = 20,
) -> dict:
    """Train the toy VQGAN from scratch on toy pictures, measure it on held-out ones, save it with its metrics.

    Loss: L1 + L2 between pictures and their reconstructions (in taming's [-1, 1]), edges weighted
    (``edge_pixels``), plus the quantizer's codebook and commitment loss (``VectorQuantizer2`` with beta 0.25,
    weighted as in VQ-VAE). The weights start as ``initialize_for_training`` says, the codebook on encoder
    outputs of the first batch, and every ``restart_every`` steps, for the first 80% of training, the codes no
    picture used meanwhile are moved onto encoder outputs. Adam, linear warm-up, cosine decay to lr / 20.

    :param output_folder: where ``last.ckpt``, ``model.yaml`` (``save_vqgan``) and ``metrics.json`` go
    :param steps: optimizer steps
    :param batch_size: pictures per step, fresh ones every step
    :param seed: the weights' and the training pictures' seed (the held-out pictures never change)
    :param lr: the peak learning rate
    :param progress: show a progress bar
    :param config: the taming config; by default ``TOY_VQGAN_CONFIG`` (a ``VQModel``: the restarts need its codebook)
    :param held_out: how many held-out pictures to measure on
    :param restart_every: steps between dead-code restarts
    :returns: the metrics written to ``metrics.json``: ``psnr_db``, ``color_match``, ``codes_used``, ``held_out``,
      ``held_out_seed``, ``steps``, ``batch_size``, ``seed``, ``lr``, ``train_seconds``
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be positive, got steps={steps}, batch_size={batch_size}")
    config = copy.deepcopy(config or TOY_VQGAN_CONFIG)
    if config.get("target") != VQ_TARGET:
        raise ValueError(f"train_toy_vqgan trains a {VQ_TARGET} (nearest-code quantizer), got {config.get('target')!r}")
    output_folder = os.fspath(output_folder)
    excluded = set(synthetic.scenes(held_out, seed=HELD_OUT_SEED))

    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        torch.manual_seed(seed)
        model = initialize_for_training(build_vqgan(config)).train()
        # taming's VectorQuantizer2 weighs the commitment term 1 and the codebook term beta by default
        # ("legacy", a bug kept for old checkpoints); the fixed weighting moves codes 4x faster than the
        # encoder is pulled to them. Only the training loss changes: the attribute is not saved.
        model.quantize.legacy = False
        generator = torch.Generator().manual_seed(seed)
        codebook = model.codebook
        # Adam's usual betas: taming's (0.5, 0.9) suit its GAN loss, which is not used here
        optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.99))
        warmup = max(1, min(100, steps // 10))
        restart_until = int(steps * 0.8)  # the last steps leave the codebook alone: the decoder settles on it
        usage = torch.zeros(model.codebook_size, dtype=torch.long)
        restarted = 0
        started = time.perf_counter()
        bar = tqdm(range(steps), desc="toy vqgan", unit="step", disable=not progress, dynamic_ncols=True)
        for step in bar:
            x = scenes_to_tensor(training_scenes(batch_size, step, seed, excluded)) * 2 - 1  # taming's [-1, 1]
            z = model.quant_conv(model.encoder(x))
            if step == 0:
                # taming starts the codebook near zero, where one code is nearest to everything: start it
                # on encoder outputs instead, so that every code is in use from the first step
                _restart_codes(
                    codebook.data,
                    torch.ones(model.codebook_size, dtype=torch.bool),
                    z.detach().permute(0, 2, 3, 1).reshape(-1, z.shape[1]),
                    generator,
                )
            loss, y, indices = _optimize_on(model, optimizer, x, z, _learning_rate(step, steps, lr, warmup))
            usage += torch.bincount(indices.flatten(), minlength=model.codebook_size)
            if (step + 1) % restart_every == 0:
                in_use = int((usage > 0).sum())
                if step < restart_until:
                    restarted += _restart_codes(
                        codebook.data, usage == 0, z.detach().permute(0, 2, 3, 1).reshape(-1, z.shape[1]), generator
                    )
                usage.zero_()
                # the batch's PSNR is free: the training reconstruction is decode(encode(x)) exactly
                batch_psnr = float(psnr_db(((y.detach() + 1) / 2).clamp(0, 1), (x + 1) / 2).mean())
                bar.set_postfix(loss=f"{loss.item():.4f}", psnr=f"{batch_psnr:.1f}dB", codes=in_use)
                if (step + 1) % max(restart_every, steps // 10 // restart_every * restart_every) == 0:
                    logger.info(
                        f"step {step + 1}/{steps}: loss={loss.item():.4f} batch_psnr={batch_psnr:.2f}dB "
                        f"codes_in_use={in_use}/{model.codebook_size} restarted_so_far={restarted}"
                    )
        bar.close()
        train_seconds = time.perf_counter() - started

    model.eval()
    metrics = evaluate_toy_vqgan(model, count=held_out)
    metrics.update(
        codebook_size=model.codebook_size,
        steps=steps,
        batch_size=batch_size,
        seed=seed,
        lr=lr,
        train_seconds=round(train_seconds, 1),
        codes_restarted=restarted,
        torch_threads=torch.get_num_threads(),
    )
    _save_with_metrics(model, output_folder, metrics)
    return metrics


def _optimize_on(
    model: VQGAN, optimizer: torch.optim.Optimizer, x: torch.Tensor, z: torch.Tensor, lr: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Adam step on pictures ``x`` whose encoder output is ``z``: quantize, decode, L1 + L2 against ``x`` plus the
    quantizer's codebook and commitment loss. Returns (the loss, the reconstruction, the codes chosen)."""
    z_q, codebook_loss, (_, _, indices) = model.quantize(z)
    y = model.decoder(model.post_quant_conv(z_q))
    weight = 1 + EDGE_WEIGHT * edge_pixels(x)
    error = (y - x).abs() + (y - x).pow(2)
    loss = (error * weight).sum() / (weight.sum() * x.shape[1]) + codebook_loss
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss, y, indices


def edge_pixels(x: torch.Tensor) -> torch.Tensor:
    """1 where a pixel of ``x`` [B, 3, H, W] has a neighbour (3 x 3) of another colour, else 0: ``[B, 1, H, W]``."""
    spread = F.max_pool2d(x, 3, stride=1, padding=1) + F.max_pool2d(-x, 3, stride=1, padding=1)
    return (spread.amax(dim=1, keepdim=True) > 1e-3).float()


def _save_with_metrics(model: VQGAN, output_folder: str, metrics: dict) -> None:
    """The model as ``load_toy_vqgan`` reads it, with what training measured beside it (``metrics.json``)."""
    save_vqgan(model, output_folder)
    with open(os.path.join(output_folder, METRICS_NAME), "w") as f:
        json.dump(metrics, f, indent=2)
        f.write("\n")
    logger.info(f"toy VQGAN saved to {output_folder}: {summary_line(metrics)}")


def summary_line(metrics: dict) -> str:
    """One line of what training reached, as ``collab-kit toy train-vqgan`` prints it."""
    return (
        f"toy vqgan: psnr={metrics['psnr_db']:.2f}dB color_match={metrics['color_match']:.3f} "
        f"codes_used={metrics['codes_used']}/{metrics['codebook_size']} held_out={metrics['held_out']} "
        f"(seed {metrics['held_out_seed']}) steps={metrics['steps']} batch={metrics['batch_size']} "
        f"time={metrics['train_seconds']:.0f}s"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``collab-kit toy train-vqgan``: train the toy VQGAN, save it, print its held-out PSNR in one line."""
    parser = argparse.ArgumentParser(prog="collab-kit toy train-vqgan", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--output",
        required=True,
        help=f"the folder to write last.ckpt, model.yaml and metrics.json to "
        f"(the shipped model lives in {TOY_VQGAN_DIR})",
    )
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps (default: {DEFAULT_STEPS})")
    parser.add_argument(
        "--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help=f"pictures per step (default: {DEFAULT_BATCH_SIZE})"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights' and training pictures' seed (default: 0)")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"peak learning rate (default: {DEFAULT_LR})")
    parser.add_argument(
        "--held-out",
        type=int,
        default=HELD_OUT_COUNT,
        help=f"held-out pictures to measure on (default: {HELD_OUT_COUNT})",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    metrics = train_toy_vqgan(
        args.output,
        steps=args.steps,
        batch_size=args.batch_size,
        seed=args.seed,
        lr=args.lr,
        progress=not args.no_progress,
        held_out=args.held_out,
    )
    print(summary_line(metrics), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main())
