"""The DALL-E-like decoder of the paper (section 3.1): one transformer over [caption tokens; image codes].

A sample is a caption of ``text_length`` tokens followed by ``image_side ** 2`` VQGAN codes read in
raster order. The model predicts every next token: caption tokens from the caption so far, image
codes from the whole caption and the codes its layers may see. What that is depends on the layer:

- Attention layouts (collab_kit.model.attention): layers repeat the masks row, column, row, row, and the last
  layer sees a convolution-like window. They are computed axially (rows, columns, bands of rows), not
  as a dense n x n masked matrix.
- Positions: rotary embeddings (Su et al. 2021). Half of every head turns with the row of an image
  code and half with its column, so attention scores depend on the 2D offset between two codes; a
  caption token at t turns both halves by t, and the image starts after the caption.
- Sharing: with ``share_layer_groups`` the layers that play the same part of the pattern are one
  block (Lan et al. 2020): the paper's 64 layers store 5 blocks, about 8x fewer parameters for the
  same compute. Input and output embeddings are tied (Press and Wolf 2016).
- Reversible residual layers (collab_kit.model.reversible): activations are recomputed in backward, so
  training memory does not grow with depth.
- Feed-forward: GEGLU (Shazeer 2020) with an inner width of 4 x hidden, as in the original run.
- No dropout: the paper's run trains on far more data than the model can memorise.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from collab_kit.config import ModelConfig
from collab_kit.model.attention import Layout
from collab_kit.model.reversible import run_plain, run_reversible


def rotary_tables(config: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` ``[sequence_length, head_size]`` (float32) of the 2D rotary embedding."""
    quarter = config.head_size // 4  # frequencies per axis; each turns a pair of features
    inverse_frequency = 10000.0 ** (-torch.arange(quarter, device=device, dtype=torch.float32) / quarter)
    T, S = config.text_length, config.image_side
    position = torch.arange(config.sequence_length, device=device)
    image = (position - T).clamp_min(0)
    # caption token t: (t, t); image code (r, c): (T + r, T + c)
    along_rows = torch.where(position < T, position, T + image.div(S, rounding_mode="floor")).float()
    along_columns = torch.where(position < T, position, T + image % S).float()
    angles = torch.cat([along_rows[:, None] * inverse_frequency, along_columns[:, None] * inverse_frequency], dim=1)
    angles = torch.cat([angles, angles], dim=1)  # feature i and feature i + head_size / 2 form a pair
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn each pair (x[i], x[i + d/2]) of ``x [..., length, d]`` by its position's angle."""
    first, second = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-second, first], dim=-1) * sin.to(x.dtype)


@dataclass
class KVCache:
    """Keys and values of the positions decoded so far, one pair of ``[batch, heads, n, head_size]`` per layer."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    length: int = 0  # positions filled


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [batch, length, hidden]`` -> q, k, v ``[batch, heads, length, head_size]``, positions applied."""
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        return self.out(y.transpose(1, 2).flatten(2))

    def forward(self, x, cos, sin, layout: Layout, kind: str) -> torch.Tensor:
        return self.merge(layout.attend(*self.project(x, cos, sin), kind))

    def forward_cached(self, x, cos, sin, mask, keys, values, start: int) -> torch.Tensor:
        """Attention of new positions ``start..`` over themselves and the cached ones before them."""
        q, k, v = self.project(x, cos, sin)
        end = start + x.shape[1]
        keys[:, :, start:end], values[:, :, start:end] = k, v
        return self.merge(F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], attn_mask=mask))


class GEGLU(nn.Module):
    """Feed-forward ``down(value * gelu(gate))``: the gated variant the original run used."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        inner = config.ffn_multiplier * config.hidden_size
        self.up = nn.Linear(config.hidden_size, 2 * inner)  # value and gate
        self.down = nn.Linear(inner, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.up(x).chunk(2, dim=-1)
        return self.down(value * F.gelu(gate))


class Block(nn.Module):
    """One layer's weights: pre-norm attention (the ``f`` of a reversible layer) and feed-forward (``g``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.hidden_size)
        self.attention = Attention(config)
        self.ffn_norm = nn.LayerNorm(config.hidden_size)
        self.ffn = GEGLU(config)

    def attend(self, x, cos, sin, layout: Layout, kind: str) -> torch.Tensor:
        return self.attention(self.attention_norm(x), cos, sin, layout, kind)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.ffn_norm(x))


@dataclass
class ModelOutput:
    loss: torch.Tensor | None
    text_loss: torch.Tensor | None
    image_loss: torch.Tensor | None
    text_logits: torch.Tensor  # [batch, text_length - 1, text_vocab]: predictions of caption tokens 1..
    image_logits: torch.Tensor  # [batch, image_length, codebook]: predictions of every image code


class TextToImageTransformer(nn.Module):
    """Decoder-only transformer over [caption tokens; image codes] with the next-token loss on both.

    :param config: the model's shape (collab_kit.config.ModelConfig)
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.layout = Layout(config.text_length, config.image_side, config.conv_kernel_size)
        self.plan = config.layer_plan()  # (block, attention kind) of every layer
        self.text_embedding = nn.Embedding(config.text_vocab_size, config.hidden_size)
        self.image_embedding = nn.Embedding(config.codebook_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(1 + max(b for b, _ in self.plan)))
        self.final_norm = nn.LayerNorm(config.hidden_size)
        self.apply(self._init_weights)
        # scaled init of the residual projections keeps the residual stream's variance flat with depth (GPT-2);
        # depth is the number of layers a sample goes through, shared or not
        for name, param in self.named_parameters():
            if name.endswith(("attention.out.weight", "ffn.down.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.num_layers))

    @staticmethod
    def _init_weights(module: nn.Module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def layers(self, cos: torch.Tensor, sin: torch.Tensor):
        """The ``(f, g)`` pair of every layer, in order: shared blocks appear once per use."""
        blocks = cast("Sequence[Block]", self.blocks)  # the stubs type ModuleList items as Module
        return [
            (
                functools.partial(blocks[b].attend, cos=cos, sin=sin, layout=self.layout, kind=kind),
                blocks[b].feed_forward,
            )
            for b, kind in self.plan
        ]

    def forward(self, text_tokens: torch.Tensor, image_codes: torch.Tensor, compute_loss: bool = True) -> ModelOutput:
        """
        :param text_tokens: int64 [batch, text_length], caption tokens padded with pad_token_id
        :param image_codes: int64 [batch, image_length], VQGAN codes in raster order
        :param compute_loss: also return the mean next-token cross-entropy (caption pads are not predicted)
        """
        cfg = self.config
        if text_tokens.shape[1:] != (cfg.text_length,) or image_codes.shape[1:] != (cfg.image_length,):
            raise ValueError(
                f"expected text_tokens [batch, {cfg.text_length}] and image_codes "
                f"[batch, {cfg.image_length}], got {tuple(text_tokens.shape)} and "
                f"{tuple(image_codes.shape)}"
            )
        x = torch.cat([self.text_embedding(text_tokens), self.image_embedding(image_codes)], dim=1)
        cos, sin = rotary_tables(cfg, x.device)
        # both streams of the reversible layers start from the embeddings; their mean is the output
        run = run_reversible if cfg.reversible and torch.is_grad_enabled() else run_plain
        x1, x2 = run(x, x, self.layers(cos, sin))
        x = self.final_norm((x1 + x2) / 2)
        # position i predicts token i + 1; the last image code predicts nothing
        text_hidden, image_hidden = x[:, : cfg.text_length - 1], x[:, cfg.text_length - 1 : -1]
        text_logits = text_hidden @ self.text_embedding.weight.t()  # tied input / output embeddings
        image_logits = image_hidden @ self.image_embedding.weight.t()

        loss = text_loss = image_loss = None
        if compute_loss:
            text_targets = text_tokens[:, 1:].masked_fill(text_tokens[:, 1:] == cfg.pad_token_id, -100)
            text_loss_sum = F.cross_entropy(
                text_logits.flatten(0, 1).float(), text_targets.flatten(), ignore_index=-100, reduction="sum"
            )
            image_loss_sum = F.cross_entropy(image_logits.flatten(0, 1).float(), image_codes.flatten(), reduction="sum")
            num_text = (text_targets != -100).sum().clamp_min(1)
            text_loss, image_loss = text_loss_sum / num_text, image_loss_sum / image_codes.numel()
            loss = (text_loss_sum + image_loss_sum) / (num_text + image_codes.numel())
        return ModelOutput(loss, text_loss, image_loss, text_logits, image_logits)

    # generation: the caption once, then one image code at a time, reusing the keys and values computed so far

    @torch.no_grad()
    def start_decoding(self, text_tokens: torch.Tensor) -> tuple[torch.Tensor, KVCache]:
        """Read the caption; returns the logits of the first image code ``[batch, codebook]`` and the cache."""
        cfg = self.config
        if text_tokens.shape[1:] != (cfg.text_length,):
            raise ValueError(f"expected text_tokens [batch, {cfg.text_length}], got {tuple(text_tokens.shape)}")
        weight = self.image_embedding.weight
        shape = (text_tokens.shape[0], cfg.num_heads, cfg.sequence_length, cfg.head_size)
        cos, sin = rotary_tables(cfg, weight.device)
        cache = KVCache(
            keys=[weight.new_empty(shape) for _ in self.plan],
            values=[weight.new_empty(shape) for _ in self.plan],
            cos=cos,
            sin=sin,
        )
        return self._decode(self.text_embedding(text_tokens), cache), cache

    @torch.no_grad()
    def continue_decoding(self, codes: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Append one image code per sample (``[batch]``); returns the logits of the next one."""
        if cache.length >= self.config.sequence_length - 1:  # the last code predicts nothing
            raise ValueError("every image code is already decoded: start_decoding again for a new image")
        return self._decode(self.image_embedding(codes[:, None]), cache)

    def _decode(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        start, end = cache.length, cache.length + x.shape[1]
        cos, sin = cache.cos[start:end], cache.sin[start:end]
        x1 = x2 = x
        blocks = cast("Sequence[Block]", self.blocks)  # the stubs type ModuleList items as Module
        for i, (b, kind) in enumerate(self.plan):
            block, mask = blocks[b], self.layout.dense_mask(kind, x.device)[start:end, :end]
            x1 = x1 + block.attention.forward_cached(
                block.attention_norm(x2), cos, sin, mask, cache.keys[i], cache.values[i], start
            )
            x2 = x2 + block.feed_forward(x1)
        cache.length = end
        last = self.final_norm((x1[:, -1] + x2[:, -1]) / 2)
        return last @ self.image_embedding.weight.t()


def model_seed(run_id: str) -> int:
    """The seed of a run's initial parameters: every peer (volunteers, anchors) builds the same ones, so that averaged
    gradients keep them equal."""
    return zlib.crc32(run_id.encode())


def initial_model(config: ModelConfig, run_id: str, model_class: type | None = None) -> TextToImageTransformer:
    """The model every peer of run ``run_id`` starts from: the same parameters everywhere (``model_seed``), drawn
    without touching the caller's random state.

    :param model_class: TextToImageTransformer (the default) or a subclass of it
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model_seed(run_id))
        return (model_class or TextToImageTransformer)(config)


def non_finite_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters holding nan or inf (empty: all finite)."""
    with torch.no_grad():
        return [name for name, param in model.named_parameters() if not torch.isfinite(param).all()]


def count_parameters(model: nn.Module) -> int:
    """Stored parameters (a tensor shared between layers counts once)."""
    return sum(p.numel() for p in model.parameters())


def count_compute_parameters(model: TextToImageTransformer) -> int:
    """Parameters counted once per use: a block shared by 16 layers counts 16 times."""
    per_block = [count_parameters(block) for block in model.blocks]
    return count_parameters(model) - sum(per_block) + sum(per_block[b] for b, _ in model.plan)


def describe(config: ModelConfig) -> dict:
    """The model's shape and parameter counts, built on the meta device (no memory, even for the paper preset)."""
    with torch.device("meta"):
        model = TextToImageTransformer(config)
    unique, compute = count_parameters(model), count_compute_parameters(model)
    kinds = [kind for _, kind in model.plan]
    return dict(
        layers=config.num_layers,
        unique_blocks=len(model.blocks),
        attention=kinds,
        hidden_size=config.hidden_size,
        heads=f"{config.num_heads} x {config.head_size}",
        sequence=f"{config.text_length} caption tokens + {config.image_side}x{config.image_side} image codes",
        unique_parameters=unique,
        compute_parameters=compute,
        reversible=config.reversible,
    )
