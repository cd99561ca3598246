"""Choosing the next image code: temperature, top-k and top-p (nucleus) filtering of logits.

The paper found that limiting sampling to the 256 most likely codes, or to the smallest set of
codes whose probabilities add up to 0.75, greatly improves the images (section 3.4). These
functions work on any ``[..., vocabulary]`` logits; the cached generation loop of the model uses them.
"""

from __future__ import annotations

import torch

PAPER_TOP_K = 256
# the toy world's: the 32 most likely of its 512 codes. The paper's 256 of 8192 is a smaller share still; with
# 256 of 512 the rare unlikely code scatters stray colour over the toy pictures
TOY_TOP_K = 32
PAPER_TOP_P = 0.75
# the toy world's temperature: its model, trained for minutes, is unsure of a shape's edge codes, and sampling each at
# full temperature frays the outline. 0.5 drew the prompted shape in 0.69 of the kept pictures, 1.0 in 0.50; on a later
# demo's model, over 3 seeds, 0.35 in 0.71, 0.25 in 0.66 and 0.5 in 0.63
TOY_TEMPERATURE = 0.35


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of the last dimension, set the others to -inf.

    Ties at the k-th value are all kept, so the result never depends on the order of equal logits.
    """
    if k <= 0:
        raise ValueError(f"top_k={k} is not allowed: expected a positive number of codes to keep")
    if k >= logits.shape[-1]:
        return logits
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely entries whose probabilities add up to at least ``p``.

    The most likely entry is always kept, so even a tiny ``p`` leaves something to sample.
    """
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p={p} is not allowed: expected a probability in (0, 1]")
    if p == 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probabilities = torch.softmax(sorted_logits.float(), dim=-1)
    # an entry is dropped when the entries before it already reach p
    mass_before = torch.cumsum(probabilities, dim=-1) - probabilities
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token per row of ``logits`` ``[batch, vocabulary]``.

    :param temperature: divides the logits; 0 means greedy (the most likely token)
    :param top_k: keep only the k most likely tokens (the paper: 256)
    :param top_p: keep only the most likely tokens whose probabilities reach p (the paper: 0.75)
    :param generator: a torch.Generator, for reproducible samples
    :returns: int64 ``[batch]``
    """
    if temperature < 0:
        raise ValueError(f"temperature={temperature} is not allowed: expected a number >= 0 (0 = greedy)")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_image_codes(
    model,
    text_tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    progress=None,
) -> torch.Tensor:
    """Sample the image codes of a batch of captions, one code at a time.

    :param model: a collab_kit.model.transformer.TextToImageTransformer
    :param text_tokens: int64 ``[batch, text_length]``: one caption per image to draw (repeat a caption
      to draw several images of it)
    :param temperature: 0 means greedy; otherwise logits are divided by it
    :param top_k: sample among the k most likely codes (the paper: 256)
    :param top_p: sample among the most likely codes whose probabilities reach p (the paper: 0.75)
    :param use_cache: keep every layer's keys and values (each step then costs one position); without it
      every step runs the whole sequence again (the reference the cache is tested against)
    :param generator: a torch.Generator, for reproducible samples
    :param progress: a callable ``progress(steps_done)`` called after every code (e.g. a tqdm bar's update)
    :returns: int64 ``[batch, image_side ** 2]`` codes in raster order
    """
    config = model.config
    was_training = model.training
    model.eval()
    try:
        codes = text_tokens.new_zeros(text_tokens.shape[0], config.image_length)
        if use_cache:
            logits, cache = model.start_decoding(text_tokens)
        for step in range(config.image_length):
            if not use_cache:
                # codes after `step` are still zeros: causal masks make them invisible to this prediction
                logits = model(text_tokens, codes, compute_loss=False).image_logits[:, step]
            codes[:, step] = sample_next(logits, temperature, top_k, top_p, generator)
            if use_cache and step + 1 < config.image_length:
                logits = model.continue_decoding(codes[:, step], cache)
            if progress is not None:
                progress(1)
        return codes
    finally:
        model.train(was_training)
