"""CLIP scoring: keep the best k of n generated images for a prompt.

The paper generated 128 images per prompt and kept the 4 that CLIP ViT-B/32 found closest to the
prompt (section 3.4). ``ClipRanker`` does that with transformers' ``CLIPModel``:

    ranker = ClipRanker.from_pretrained("openai/clip-vit-base-patch32")   # or a local folder
    best, scores, order = ranker.rank("a red circle on a blue square", images, keep=4)

The images are preprocessed here, in torch, the way CLIP was trained (shortest side resized to the
model's input size with antialiased bicubic interpolation, center crop, CLIP's mean and std),
rather than by ``CLIPImageProcessor``: this keeps generated tensors on their device, works in
batches, and needs neither torchvision nor PIL (PIL images are accepted too, when PIL is there).

Without the Internet, ``tiny_random_clip()`` builds a CLIP of the same architecture with tiny sizes
and random weights, and a tokenizer made in memory: tests and the CPU demo use it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Union, cast

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer, CLIPConfig, CLIPModel, CLIPTextConfig, CLIPTokenizer, CLIPVisionConfig

logger = logging.getLogger(__name__)

DEFAULT_CLIP = "openai/clip-vit-base-patch32"  # the paper's CLIP ViT-B/32
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # the statistics of CLIP's training images
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

Images = Union[torch.Tensor, Sequence[Union[torch.Tensor, Image.Image]]]  # noqa: UP007 (a runtime alias)


class ClipRanker:
    """Scores images against a prompt with CLIP and keeps the best ones.

    :param model: a ``transformers.CLIPModel`` (its dtype and device are used as they are)
    :param tokenizer: the tokenizer that goes with the model's text encoder
    """

    def __init__(self, model: CLIPModel, tokenizer):
        self.model, self.tokenizer = model.eval(), tokenizer
        # CLIPConfig turns its sub-config dicts into configs; CLIP's image size is one int
        self.image_size = cast(int, cast(CLIPVisionConfig, model.config.vision_config).image_size)
        self.max_text_length = cast(CLIPTextConfig, model.config.text_config).max_position_embeddings

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str = DEFAULT_CLIP,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> ClipRanker:
        """Load a CLIP model and its tokenizer from the Hugging Face Hub or a local folder.

        :param name_or_path: a Hub repository id (default: the paper's CLIP ViT-B/32) or a folder written by
          :meth:`save_pretrained` (or by ``save_pretrained`` of a CLIPModel and its tokenizer)
        :param device: where to run CLIP; by default the GPU if there is one, else the CPU
        :param dtype: the parameters' dtype, e.g. ``torch.float16`` on a GPU; by default float32
        """
        device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
        try:
            model = CLIPModel.from_pretrained(name_or_path, dtype=dtype if dtype is not None else torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        except OSError as e:  # transformers' way of saying "not found" / "not reachable"
            raise OSError(
                f"could not load CLIP from {name_or_path!r} ({e}). Pass a Hub repository id such as "
                f"{DEFAULT_CLIP!r} (needs the Internet or a filled cache) or a local folder written by "
                f"ClipRanker.save_pretrained; tiny_random_clip() needs neither"
            ) from e
        ranker = cls(model.to(device), tokenizer)  # type: ignore[arg-type]  # @wraps(Module.to) mistypes .to
        num_parameters = sum(p.numel() for p in model.parameters())
        logger.info(f"loaded CLIP {name_or_path} ({num_parameters / 1e6:.1f}M parameters) on {device}")
        return ranker

    def save_pretrained(self, folder: str) -> str:
        """Write the model and the tokenizer to ``folder``, for :meth:`from_pretrained` (or a Hub upload)."""
        self.model.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        return folder

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def score(self, prompt: str, images: Images, batch_size: int = 32) -> torch.Tensor:
        """The cosine similarity between the prompt and each image, float32 ``[n]`` on the CPU, in [-1, 1].

        These are CLIP's logits divided by its ``logit_scale.exp()`` (100 for the OpenAI models): the scale
        changes no ranking, and cosines can be compared between models.

        :param prompt: the text the images were generated from
        :param images: float ``[n, 3, H, W]`` in [0, 1] (or uint8 in [0, 255]) on any device, or a list of
          PIL images (or of ``[3, H, W]`` tensors); any size, they are resized and center-cropped to the
          model's input
        :param batch_size: images encoded at a time: memory grows with it, so 128 images need not fit at once
        """
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} is not allowed: expected a positive number of images")
        num_images = _check_images(images)
        text = self.tokenizer(prompt, truncation=True, max_length=self.max_text_length, return_tensors="pt")
        text_embedding = _pooled(self.model.get_text_features(**text.to(self.device))).float()
        text_embedding = F.normalize(text_embedding, dim=-1)

        scores = []
        for start in range(0, num_images, batch_size):
            pixels = self.preprocess(images[start : start + batch_size])
            image_embedding = _pooled(self.model.get_image_features(pixel_values=pixels)).float()
            scores.append((F.normalize(image_embedding, dim=-1) @ text_embedding.T).squeeze(-1).cpu())
        return torch.cat(scores)

    def rank(
        self, prompt: str, images: Images, keep: int = 4, batch_size: int = 32
    ) -> tuple[Images, torch.Tensor, torch.Tensor]:
        """Keep the ``keep`` images closest to the prompt, best first.

        :param prompt: the text the images were generated from
        :param images: as in :meth:`score`
        :param keep: how many images to keep (the paper: 4 of 128)
        :param batch_size: images encoded at a time
        :returns: ``(kept_images, kept_scores, order)``: the kept images (a tensor ``images[order[:keep]]``, or
          a list for a list), their scores ``[keep]`` in descending order, and ``order``, the indices of all
          ``n`` images from best to worst (equal scores keep their input order)
        """
        num_images = _check_images(images)
        if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= num_images:
            raise ValueError(
                f"keep={keep!r} is not allowed: expected a number of images from 1 to {num_images} "
                f"(the number of images given)"
            )
        scores = self.score(prompt, images, batch_size=batch_size)
        kept_scores, order = torch.sort(scores, descending=True, stable=True)
        best = order[:keep]
        kept_images: Images
        if isinstance(images, torch.Tensor):
            kept_images = images[best.to(images.device)]
        else:
            kept_images = [images[i] for i in best.tolist()]
        return kept_images, kept_scores[:keep], order

    def preprocess(self, images: Images) -> torch.Tensor:
        """Images -> CLIP's input: ``[n, 3, S, S]`` normalized, on the model's device and dtype (S: its image size)."""
        if isinstance(images, torch.Tensor):
            pixels = self._resize_and_crop(_as_unit_float(images.to(self.device)))
        else:  # the images of a list may differ in size: each is resized on its own
            pixels = torch.cat([self._resize_and_crop(_one_image(image, self.device)) for image in images])
        mean = torch.tensor(CLIP_MEAN, device=pixels.device).view(1, 3, 1, 1)
        std = torch.tensor(CLIP_STD, device=pixels.device).view(1, 3, 1, 1)
        return ((pixels - mean) / std).to(self.model.dtype)

    def _resize_and_crop(self, pixels: torch.Tensor) -> torch.Tensor:
        size = self.image_size
        height, width = pixels.shape[-2:]
        if (height, width) != (size, size):
            # the shortest side becomes `size`, as in CLIP's own preprocessing; max() guards float round-off
            scale = size / min(height, width)
            new_height, new_width = max(size, int(height * scale)), max(size, int(width * scale))
            # antialias: generated images are often much larger than 224 and would alias when shrunk
            pixels = F.interpolate(
                pixels.float(), size=(new_height, new_width), mode="bicubic", align_corners=False, antialias=True
            )
            # bicubic overshoots at edges; PIL clips to [0, 255], so clip too, and PIL and tensors agree
            pixels = pixels.clamp(0.0, 1.0)
            top, left = int(round((new_height - size) / 2.0)), int(round((new_width - size) / 2.0))
            pixels = pixels[..., top : top + size, left : left + size]
        return pixels.float()


def _pooled(output) -> torch.Tensor:
    # transformers 5 returns a model output whose pooler_output is the projected embedding; 4.x a tensor
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def _check_images(images: Images) -> int:
    """The number of images, after checking their shape; raises with what to do otherwise."""
    if isinstance(images, torch.Tensor):
        if images.ndim != 4 or images.shape[1] != 3:
            hint = " (one image: pass images[None])" if images.ndim == 3 else ""
            hint = hint or (
                " (grayscale: images.expand(-1, 3, -1, -1); RGBA: images[:, :3])"
                if images.ndim == 4 and images.shape[1] in (1, 4)
                else ""
            )
            raise ValueError(
                f"images must be a batch [n, 3, height, width] of RGB images with 3 channels, "
                f"got shape {list(images.shape)}{hint}"
            )
        if images.shape[0] == 0:
            raise ValueError("no images to score: got a batch of 0 images")
        return images.shape[0]
    if isinstance(images, (str, bytes)) or not isinstance(images, Sequence):
        raise TypeError(
            f"images must be a tensor [n, 3, height, width] or a list of images, got {type(images).__name__}"
        )
    if len(images) == 0:
        raise ValueError("no images to score: got an empty list")
    return len(images)


def _as_unit_float(images: torch.Tensor) -> torch.Tensor:
    if images.dtype == torch.uint8:
        return images.float() / 255.0
    if not images.is_floating_point():
        raise TypeError(f"images must be float in [0, 1] or uint8 in [0, 255], got {images.dtype}")
    low, high = images.min().item(), images.max().item()
    if low < -1e-3 or high > 1 + 1e-3:
        raise ValueError(
            f"images must lie in [0, 1], got values in [{low:.3f}, {high:.3f}]; "
            f"images decoded to [-1, 1] (as a VQGAN decodes) become [0, 1] with (images + 1) / 2"
        )
    return images.float()


def _one_image(image, device: torch.device) -> torch.Tensor:
    """An image of a list -> float ``[1, 3, H, W]`` in [0, 1] on ``device``.

    A PIL image is converted to RGB (grayscale and RGBA too); a tensor must be ``[3, H, W]``.
    """
    if isinstance(image, torch.Tensor):
        if image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(
                f"each image of a list must be [3, height, width] with 3 channels, got shape {list(image.shape)}"
            )
        return _as_unit_float(image[None].to(device))

    if not isinstance(image, Image.Image):
        raise TypeError(
            f"a list of images must hold PIL images or [3, height, width] tensors, got a {type(image).__name__} in it"
        )
    array = np.asarray(image.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1)[None].to(device).float() / 255.0


def tiny_tokenizer(max_length: int = 32) -> CLIPTokenizer:
    """A CLIP tokenizer made in memory: CLIP's byte-level BPE without merges, so words are spelled byte by byte.

    The vocabulary is the 256 byte symbols, the same with CLIP's end-of-word mark ``</w>``, then
    ``<|startoftext|>`` (512) and ``<|endoftext|>`` (513, also padding): 514 tokens, any text encodes.

    :param max_length: the longest token sequence (the text encoder's positions)
    """

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    vocab.update({symbol + "</w>": len(symbols) + i for i, symbol in enumerate(symbols)})
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    # vocab and merges as objects: transformers 5 builds the tokenizer from them (file names would be ignored)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)
    if tokenizer("a")["input_ids"] != [vocab["<|startoftext|>"], vocab["a</w>"], vocab["<|endoftext|>"]]:
        raise RuntimeError(
            "this version of transformers built CLIPTokenizer without the given vocabulary; "
            "tiny_tokenizer needs transformers >= 5"
        )
    return tokenizer


def tiny_random_clip(seed: int = 0, device: str | torch.device | None = None) -> ClipRanker:
    """A CLIP with the architecture of ViT-B/32 at toy sizes and random weights, plus :func:`tiny_tokenizer`.

    Its scores mean nothing, but it runs every line that a real CLIP runs, offline and in a blink:
    hidden size 32, 2 layers, 32x32 images in 8x8 patches. The global torch RNG is left as it was.

    :param seed: the seed of the random weights: the same seed gives the same model
    :param device: where to put it (default: the CPU)
    """
    tokenizer = tiny_tokenizer(max_length=32)
    special = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=32,
            **special,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=16,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(config)
    return ClipRanker(model.to(device or "cpu"), tokenizer)  # type: ignore[arg-type]  # @wraps(Module.to) mistypes .to
