"""Choosing the next image code: temperature, top-k and top-p (nucleus) filtering of logits.

The paper found that limiting sampling to the 256 most likely codes, or to the smallest set of
codes whose probabilities add up to 0.75, greatly improves the images (section 3.4). These
functions work on any ``[..., vocabulary]`` logits; the cached generation loop of the model uses them.
"""
from __future__ import annotations

from typing import Optional

import torch

PAPER_TOP_K = 256
PAPER_TOP_P = 0.75


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


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
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
