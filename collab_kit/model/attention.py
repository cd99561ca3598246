"""Where each position may look: the attention layouts of the decoder, computed axially.

A sequence is ``T`` caption tokens followed by an ``S x S`` grid of image codes in raster order
(position ``T + r * S + c`` holds the code of row ``r``, column ``c``). In every layer a caption token
sees the caption tokens up to itself, and an image position sees the whole caption. What an image
position sees of the image depends on the layer's kind (DALL-E, Ramesh et al. 2021, appendix B.1):

- ``row``: the codes of its own row up to itself;
- ``column``: the codes of its own column up to itself;
- ``conv``: the codes up to itself (in raster order) inside a ``k x k`` window centred on it;
- ``full``: every position up to itself (a plain causal transformer; for comparisons).

``Layout.dense_mask`` writes these rules down as an ``n x n`` boolean matrix: it is the definition,
used by the cached generation loop and by tests. ``Layout.attend`` computes the same attention without
the ``n x n`` matrix: the image is reshaped into rows (or columns, or bands of rows for ``conv``) and
each group of queries attends only to the caption plus its own group, so a layer costs
``O(n * (T + S))`` instead of ``O(n^2)`` (``O(n * (T + k * S / 2))`` for conv).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from collab_kit.config import ATTENTION_KINDS


@dataclass(frozen=True)
class Layout:
    """The shape of a sequence: caption length, image side, and the width of the conv window.

    :param text_length: caption tokens T
    :param image_side: the image is image_side x image_side codes
    :param conv_kernel_size: odd width k of the window a ``conv`` layer sees
    """

    text_length: int
    image_side: int
    conv_kernel_size: int = 11

    @property
    def length(self) -> int:
        return self.text_length + self.image_side**2

    def dense_mask(self, kind: str, device=None) -> torch.Tensor:
        """``allowed[i, j]``: may position ``i`` attend to position ``j``? (bool ``[n, n]``)"""
        return _dense_mask(self, kind, str(torch.device(device or "cpu")))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str) -> torch.Tensor:
        """Attention of ``kind`` over a whole sequence, computed group by group.

        :param q: ``[batch, heads, n, head_size]``, and so are ``k`` and ``v``
        :returns: ``[batch, heads, n, head_size]``, equal to masked attention with ``dense_mask(kind)``
        """
        _check_kind(kind)
        if kind == "full":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        T, S = self.text_length, self.image_side
        caption = F.scaled_dot_product_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], is_causal=True)

        # [batch, heads, row, column, head_size]; a column layer swaps the axes so its groups are columns
        qi, ki, vi = (t[:, :, T:].unflatten(2, (S, S)) for t in (q, k, v))
        if kind == "column":
            qi, ki, vi = (t.transpose(2, 3) for t in (qi, ki, vi))
        if kind == "conv":  # each row's queries look at a band: the rows above it (half a window) and its own
            ki, vi = self._band_of_rows(ki), self._band_of_rows(vi)
        # every image query sees the whole caption and its own group: one softmax over [caption; group].
        # The caption's scores are one large matmul for all queries (no copy of the caption per group).
        caption_keys, caption_values = k[:, :, :T], v[:, :, :T]
        qi = qi * q.shape[-1] ** -0.5
        to_caption = (qi.flatten(2, 3) @ caption_keys.transpose(-1, -2)).unflatten(2, (S, S))
        to_group = (qi @ ki.transpose(-1, -2)).masked_fill(~self._group_mask(kind, q.device), float("-inf"))
        weights = torch.softmax(torch.cat([to_caption, to_group], dim=-1), dim=-1)
        image = (weights[..., :T].flatten(2, 3) @ caption_values).unflatten(2, (S, S)) + weights[..., T:] @ vi
        if kind == "column":
            image = image.transpose(2, 3)
        return torch.cat([caption, image.flatten(2, 3)], dim=2)

    def _band_of_rows(self, grid: torch.Tensor) -> torch.Tensor:
        """``[b, h, S, S, d]`` -> ``[b, h, S, (half + 1) * S, d]``: row r gets rows r - half .. r, zeros above row 0."""
        half = self.conv_kernel_size // 2
        padded = F.pad(grid, (0, 0, 0, 0, half, 0))  # `half` rows of zeros above the image
        bands = padded.unfold(2, half + 1, 1)  # [b, h, S, S, d, half + 1]
        return bands.permute(0, 1, 2, 5, 3, 4).flatten(3, 4)

    def _group_mask(self, kind: str, device) -> torch.Tensor:
        return _group_mask(self, kind, str(torch.device(device)))


def _check_kind(kind: str) -> None:
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention kind {kind!r} is not known: choose one of {', '.join(ATTENTION_KINDS)}")


@lru_cache(maxsize=64)
def _dense_mask(layout: Layout, kind: str, device: str) -> torch.Tensor:
    _check_kind(kind)
    T, S, half = layout.text_length, layout.image_side, layout.conv_kernel_size // 2
    position = torch.arange(layout.length, device=device)
    is_image = position >= T
    row, column = (position - T).div(S, rounding_mode="floor"), (position - T) % S
    causal = position[:, None] >= position[None, :]
    if kind == "row":
        related = row[:, None] == row[None, :]
    elif kind == "column":
        related = column[:, None] == column[None, :]
    elif kind == "conv":
        related = ((row[:, None] - row[None, :]).abs() <= half) & ((column[:, None] - column[None, :]).abs() <= half)
    else:
        related = torch.ones_like(causal)
    # caption keys are visible to every later position; image keys only to related image positions
    return causal & (~is_image[None, :] | (is_image[:, None] & is_image[None, :] & related))


@lru_cache(maxsize=64)
def _group_mask(layout: Layout, kind: str, device: str) -> torch.Tensor:
    """Which keys of its group each image query of ``attend`` sees (the caption is always visible).

    ``[S, S]`` for rows and columns (query i of a line sees items 0..i of its line);
    ``[S, S, (half + 1) * S]`` for conv (it depends on the row: bands of the top rows reach above the image).
    """
    S, half = layout.image_side, layout.conv_kernel_size // 2
    index = torch.arange(S, device=device)
    if kind in ("row", "column"):
        return index[:, None] >= index[None, :]
    # conv: query (r, c); band key (b, c') is row r - half + b, column c'
    band_row = torch.arange(half + 1, device=device)
    key_row = index[:, None] - half + band_row[None, :]  # [r, b]
    in_window = (index[:, None] - index[None, :]).abs() <= half  # [c, c']
    # rows above r are wholly before it; in row r only columns up to c come before it
    earlier = (band_row[:, None, None] < half) | (index[None, None, :] <= index[None, :, None])  # [b, c, c']
    allowed = (key_row >= 0)[:, :, None, None] & in_window[None, None] & earlier[None]  # [r, b, c, c']
    return allowed.permute(0, 2, 1, 3).flatten(2, 3)  # [r, c, b * S + c']
