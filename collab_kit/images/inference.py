"""Inference from a checkpoint: load everything a model needs to draw, then draw a sheet of pictures per prompt.

What notebooks/inference.ipynb calls. ``load_for_inference`` turns one checkpoint location (a folder, a
monitor's folder of checkpoints, or a Hub model repository id) into the four pieces that drawing needs:
the model, the VQGAN that turns its codes into pixels, the caption tokenizer it was trained with, and
the CLIP that ranks what it draws. ``draw_prompts`` then draws N pictures per prompt and keeps CLIP's
best few, as the paper's demo showed the best 4 of 128 (section 3.4):

    pieces = load_for_inference("demo_out/model")             # or "user/dalle-run", revision="..."
    result = draw_prompts(pieces, ["a large red circle in the center"], n=32, keep=4, seed=0)
    result.sheet.save("samples.png"); result.summary()["per_prompt"][0]["kept_scores"]

Which VQGAN and CLIP go with a checkpoint follows from its run configuration:

- the toy world (``data.tokenizer == "toy"``, the ``toy`` preset of ``make demo``): the toy VQGAN and toy
  CLIP shipped in ``collab_kit/toy/assets``, so everything works offline;
- any other run: the VQGAN its data was encoded with (``vqgan=``, a folder or Hub repo id; for the paper's
  32x32 codes of 8192, taming's ``vqgan_gumbel_f8``) and OpenAI's CLIP ViT-B/32 from the Hub
  (``clip=`` to use another). A run on the kit's synthetic data (``tiny`` / ``small`` presets), which no
  VQGAN encoded, is drawn with an untrained VQGAN of its code grid: the pictures then show codes, not images.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence

import torch
from PIL import Image
from tqdm.auto import tqdm

from collab_kit.config import RunConfig, SettingFileMissing, SettingProblem
from collab_kit.data.tokenizers import caption_tokenizer
from collab_kit.images.generate import check_vqgan_fits, generate_images, prompt_sheet
from collab_kit.model.checkpoint import load_checkpoint
from collab_kit.model.clip_rank import DEFAULT_CLIP, ClipRanker
from collab_kit.model.sampling import PAPER_TOP_K, TOY_TEMPERATURE, TOY_TOP_K
from collab_kit.model.vqgan import PAPER_VQGAN_CONFIG, untrained_vqgan
from collab_kit.model.vqgan_files import load_vqgan
from collab_kit.toy.clip import load_toy_clip
from collab_kit.toy.vqgan import load_toy_vqgan

logger = logging.getLogger(__name__)

NO_CLIP = "none"  # clip="none" (or False): keep the first pictures drawn, unranked
SHEET_TILE_PIXELS = 128  # small pictures are enlarged on the sheet to about this size (nearest neighbour)


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` (or None): the GPU if there is one, else the CPU; anything else as ``torch.device`` reads it."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a device: use 'auto', 'cpu', 'cuda' or 'cuda:0'") from e
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}, but this machine has no CUDA GPU: use 'auto' or 'cpu'")
    return resolved


@dataclasses.dataclass
class InferencePieces:
    """Everything drawing needs, loaded for one checkpoint (see :func:`load_for_inference`)."""

    model: torch.nn.Module  # collab_kit.model.transformer.TextToImageTransformer, in eval mode
    vqgan: torch.nn.Module  # collab_kit.model.vqgan.VQGAN: codes -> pixels
    tokenizer: object  # the caption tokenizer the model was trained with: encode(caption, length)
    ranker: object | None  # collab_kit.model.clip_rank.ClipRanker, or None to keep pictures unranked
    config: RunConfig  # the run's configuration, as saved in the checkpoint
    metadata: dict  # what the checkpoint's writer recorded (global epoch, loss, ...)
    location: str
    revision: str | None
    device: torch.device
    suggested_top_k: int | None  # what top_k="auto" means for this model
    suggested_temperature: float = 1.0  # what temperature="auto" means for this model

    @property
    def toy_world(self) -> bool:
        return self.config.data.tokenizer == "toy"

    def describe(self) -> str:
        """One line: what was loaded, from where, and onto which device."""
        parameters = sum(p.numel() for p in self.model.parameters())
        facts = ", ".join(
            f"{key} {value}" for key, value in self.metadata.items() if isinstance(value, (int, float, str))
        )
        side, codes = self.config.model.image_side, self.config.model.codebook_size
        toy = "toy " if self.toy_world else ""
        clip = "no CLIP (unranked)" if self.ranker is None else f"{toy}CLIP"
        return (
            f"{self.location}{'@' + self.revision if self.revision else ''}: preset {self.config.preset}, "
            f"{parameters / 1e6:.1f}M parameters, {side}x{side} codes of {codes}"
            f"{' (' + facts + ')' if facts else ''}; {toy}VQGAN of {self.vqgan.image_size}px pictures, "
            f"{clip}; on {self.device}"
        )


def _checkpoint_error(location: str, error: Exception) -> SettingFileMissing:
    where = "" if os.path.isabs(location) else f" (relative paths start from {os.getcwd()})"
    return SettingFileMissing(
        f"could not load the checkpoint {location!r}: {error}\nPass CHECKPOINT = a checkpoint folder holding "
        f"model.safetensors and config.json{where}, such as demo_out/model that `make demo` writes; a monitor's "
        f"folder of epoch-NNNNNN checkpoints; or a Hub model repository id such as 'user/dalle-run' (with REVISION "
        f"for a branch, tag or commit)"
    )


def load_for_inference(
    location: str, revision: str | None = None, *, vqgan=None, clip=None, device: str | torch.device | None = "auto"
) -> InferencePieces:
    """Load a checkpoint and the VQGAN, caption tokenizer and CLIP that go with it.

    :param location: a checkpoint folder (``save_checkpoint``'s), a monitor's folder of ``epoch-NNNNNN``
      checkpoints (the newest that loads), or a Hub model repository id such as ``user/dalle-run``
    :param revision: the Hub revision (branch, tag or commit); None for the latest. Ignored for folders
    :param vqgan: None for the checkpoint's own (see the module's docstring), or a VQGAN location
      (``collab_kit.model.vqgan_files.load_vqgan``: folder, file or Hub repo id) or a built VQGAN
    :param clip: None for the checkpoint's own (toy CLIP, or OpenAI's ViT-B/32), a CLIP name or folder
      (``ClipRanker.from_pretrained``), a built ClipRanker, or ``"none"`` / False to rank nothing
    :param device: ``"auto"`` (the GPU if there is one), ``"cpu"``, ``"cuda"``, ...
    :raises FileNotFoundError: with what to pass, when nothing loads from ``location``
    """

    if not isinstance(location, (str, os.PathLike)) or not os.fspath(location).strip():
        raise SettingProblem(
            f"no checkpoint given (CHECKPOINT={location!r}): pass a checkpoint folder such as "
            f"demo_out/model (`make demo` writes it) or a Hub model repository id such as 'user/dalle-run'"
        )
    location = os.fspath(location).strip()
    device = resolve_device(device)
    try:
        model, config, metadata = load_checkpoint(location, revision)
    except FileNotFoundError as e:
        raise _checkpoint_error(location, e) from e
    model = model.to(device).eval()
    toy_world = config.data.tokenizer == "toy"
    side, codebook = config.model.image_side, config.model.codebook_size

    tokenizer = caption_tokenizer(config.data.tokenizer, config.model.pad_token_id)
    vqgan = _load_vqgan(vqgan, toy_world, side, codebook, device)
    ranker = _load_clip(clip, toy_world, device)
    check_vqgan_fits(config.model, vqgan)
    suggested_top_k = min(TOY_TOP_K if toy_world else PAPER_TOP_K, codebook)
    pieces = InferencePieces(
        model=model,
        vqgan=vqgan,
        tokenizer=tokenizer,
        ranker=ranker,
        config=config,
        metadata=metadata,
        location=location,
        revision=revision,
        device=device,
        suggested_top_k=suggested_top_k,
        suggested_temperature=TOY_TEMPERATURE if toy_world else 1.0,
    )
    logger.info(f"loaded {pieces.describe()}")
    return pieces


def _load_vqgan(vqgan, toy_world: bool, side: int, codebook: int, device: torch.device):
    if vqgan is not None and not isinstance(vqgan, (str, os.PathLike)):
        return vqgan.to(device).eval()  # a built VQGAN
    if vqgan is not None and os.fspath(vqgan).strip():
        return load_vqgan(os.fspath(vqgan).strip(), map_location=device)
    if toy_world:
        return load_toy_vqgan(map_location=device)
    paper = PAPER_VQGAN_CONFIG["params"]
    if codebook == paper["n_embed"]:
        raise ValueError(
            f"this checkpoint draws {side}x{side} codes of {codebook}, as the paper's run: pass VQGAN "
            f"(vqgan=) the VQGAN its data was encoded with, taming's vqgan_gumbel_f8 (a folder, file or "
            f"Hub repo id; see collab_kit.model.vqgan_files.load_vqgan)"
        )
    logger.warning(
        f"no VQGAN given for a model of {side}x{side} codes of {codebook}: decoding with an untrained "
        f"VQGAN of that grid (the kit's synthetic data was encoded by none); pass vqgan= for real pictures"
    )
    return untrained_vqgan(side, codebook).to(device)


def _load_clip(clip, toy_world: bool, device: torch.device):
    if clip is False or (isinstance(clip, str) and clip.strip().lower() == NO_CLIP):
        return None
    if isinstance(clip, ClipRanker):
        clip.model.to(device)
        return clip
    if clip is not None and os.fspath(clip).strip():
        return ClipRanker.from_pretrained(os.fspath(clip).strip(), device=device)
    if toy_world:
        return load_toy_clip(device=str(device))
    return ClipRanker.from_pretrained(DEFAULT_CLIP, device=device)


@dataclasses.dataclass
class InferenceResult:
    """What :func:`draw_prompts` drew: one grid per prompt (best first), the sheet of them all, and the settings."""

    prompts: list[str]
    grids: list[Image.Image]  # each: generate_images' grid, with info["clip_scores"] and info["candidate_scores"]
    sheet: Image.Image  # every grid below its prompt
    settings: dict[str, object]  # n, keep, top_k, top_p, temperature, seed, scale, tile size, checkpoint

    def summary(self) -> dict:
        """A JSON-serializable account: the settings, the sheet's size, each prompt's seed and CLIP scores."""
        per_prompt = [
            dict(
                prompt=prompt,
                seed=self.settings["seed"] + index,
                kept_scores=grid.info["clip_scores"],
                candidate_scores=grid.info["candidate_scores"],
            )
            for index, (prompt, grid) in enumerate(zip(self.prompts, self.grids))
        ]
        return dict(self.settings, prompts=list(self.prompts), sheet_size=list(self.sheet.size), per_prompt=per_prompt)

    def save_sheet(self, path: str) -> str:
        """Write the sheet as a PNG (folders are made); returns the path."""
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        self.sheet.save(path, format="PNG")
        return path

    def save_summary(self, path: str, **extra) -> str:
        """Write :meth:`summary` (and ``extra`` fields, e.g. ``sheet_path=``) as JSON; returns the path."""
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            json.dump(dict(self.summary(), **extra), f, indent=2)
        return path

    def score_lines(self) -> list[str]:
        """One line per prompt: the kept pictures' CLIP scores, beside the best, median and worst of all drawn."""
        lines = []
        for prompt, grid in zip(self.prompts, self.grids):
            kept, candidates = grid.info["clip_scores"], grid.info["candidate_scores"]
            if kept is None:
                lines.append(f"{prompt!r}: the first {len(grid.info['images'])} pictures drawn (not ranked)")
                continue
            ordered = sorted(candidates)
            lines.append(
                f"{prompt!r}: kept {' '.join(f'{s:.3f}' for s in kept)} | all {len(candidates)}: best "
                f"{ordered[-1]:.3f}, median {ordered[len(ordered) // 2]:.3f}, worst {ordered[0]:.3f}"
            )
        return lines


def draw_prompts(
    pieces: InferencePieces,
    prompts: Sequence[str],
    n: int = 32,
    keep: int = 4,
    *,
    top_k: str | int | None = "auto",
    top_p: float | None = None,
    temperature: float | str = "auto",
    seed: int = 0,
    batch_size: int = 32,
    scale: int | None = None,
    progress: bool = True,
) -> InferenceResult:
    """Draw ``n`` pictures per prompt, keep CLIP's best ``keep`` (best first), and lay them out on one sheet.

    Prompt ``i`` is drawn with seed ``seed + i``: the same settings and seed give the same sheet.

    :param pieces: from :func:`load_for_inference`
    :param prompts: what to draw, one row of the sheet each
    :param n: pictures drawn per prompt (the paper: 128)
    :param keep: pictures kept per prompt (the paper: 4)
    :param top_k: sample among the k most likely codes; ``"auto"``: the model's suggestion
      (``pieces.suggested_top_k``: the paper's 256, or 32 of the toy world's 512); None: no limit
    :param top_p: sample among the most likely codes whose probabilities add up to p (the paper's other
      choice: 0.75); None: no limit. With both, a code must pass both filters
    :param temperature: divides the logits: below 1 safer, above 1 more varied; 0 is greedy; ``"auto"``: the model's
      suggestion (``pieces.suggested_temperature``: 1 for the paper's model, 0.5 for the toy world's)
    :param seed: the first prompt's seed
    :param batch_size: pictures sampled at once (memory grows with it)
    :param scale: enlarge the pictures on the sheet this many times; None: to about 128 pixels
    :param progress: progress bars
    """

    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
        raise SettingProblem(
            f"PROMPTS={prompts!r}: expected a list of non-empty strings, such as ['a large red circle in the center']"
        )
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SettingProblem(f"CANDIDATES={n!r}: expected the number of pictures to draw per prompt, at least 1")
    if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= n:
        raise SettingProblem(f"KEEP={keep!r}: expected the number of pictures to keep, from 1 to CANDIDATES={n}")
    if top_k == "auto":
        top_k = pieces.suggested_top_k
    if temperature == "auto":
        temperature = pieces.suggested_temperature
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise SettingProblem(f"TEMPERATURE={temperature!r}: expected 'auto' or a number >= 0 (0: the likeliest code)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise SettingProblem(f"TOP_K={top_k!r}: expected 'auto', None (no limit) or a positive number of codes")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise SettingProblem(f"TOP_P={top_p!r}: expected None (no limit) or a probability in (0, 1], e.g. 0.75")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise SettingProblem(f"SEED={seed!r}: expected an integer")
    tile = pieces.vqgan.image_size
    scale = scale if scale is not None else max(1, SHEET_TILE_PIXELS // tile)
    grids = []
    for index, prompt in enumerate(tqdm(prompts, desc="drawing", unit="prompt", disable=not progress)):
        grids.append(
            generate_images(
                prompt,
                n=n,
                keep=keep,
                model=pieces.model,
                vqgan=pieces.vqgan,
                ranker=pieces.ranker,
                tokenizer=pieces.tokenizer,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                batch_size=batch_size,
                seed=seed + index,
                columns=keep,
                progress=False,
            )
        )
    settings = dict(
        checkpoint=pieces.location,
        revision=pieces.revision,
        preset=pieces.config.preset,
        candidates=n,
        keep=keep,
        top_k=top_k,
        top_p=top_p,
        temperature=temperature,
        seed=seed,
        ranked=pieces.ranker is not None,
        tile_size=[tile, tile],
        scale=scale,
    )
    return InferenceResult(
        prompts=prompts, grids=grids, sheet=prompt_sheet(grids, prompts, scale=scale), settings=settings
    )
