"""The DALL-E-like decoder: one causal transformer over [caption tokens; image codes].

A sample is a caption of ``text_length`` tokens followed by ``image_side ** 2`` VQGAN codes read in
raster order. The model predicts every next token: caption tokens from the caption so far, image
codes from the whole caption and the codes before. Text and image tokens have their own embedding
tables, tied with their output layers (the paper ties input and output embeddings).

This is the dense baseline: full causal attention, one block per layer, learned positions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from collab_kit.config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = self.qkv(x).split(hidden, dim=2)
        # [batch, heads, length, head_size]
        q, k, v = (t.view(batch, length, self.num_heads, hidden // self.num_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(batch, length, hidden))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.up = nn.Linear(config.hidden_size, config.ffn_multiplier * config.hidden_size)
        self.down = nn.Linear(config.ffn_multiplier * config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + feed_forward(norm(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.hidden_size)
        self.attention = CausalSelfAttention(config)
        self.ffn_norm = nn.LayerNorm(config.hidden_size)
        self.ffn = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.ffn(self.ffn_norm(x))


@dataclass
class ModelOutput:
    loss: Optional[torch.Tensor]
    text_loss: Optional[torch.Tensor]
    image_loss: Optional[torch.Tensor]
    text_logits: torch.Tensor  # [batch, text_length - 1, text_vocab]: predictions of caption tokens 1..
    image_logits: torch.Tensor  # [batch, image_length, codebook]: predictions of every image code


class TextToImageTransformer(nn.Module):
    """Decoder-only transformer over [caption tokens; image codes] with the next-token loss on both.

    :param config: the model's shape (collab_kit.config.ModelConfig)
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.text_embedding = nn.Embedding(config.text_vocab_size, config.hidden_size)
        self.image_embedding = nn.Embedding(config.codebook_size, config.hidden_size)
        self.position_embedding = nn.Embedding(config.sequence_length, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size)
        self.apply(self._init_weights)
        # scaled init of the residual projections keeps the residual stream's variance flat with depth (GPT-2)
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

    def forward(self, text_tokens: torch.Tensor, image_codes: torch.Tensor, compute_loss: bool = True) -> ModelOutput:
        """
        :param text_tokens: int64 [batch, text_length], caption tokens padded with pad_token_id
        :param image_codes: int64 [batch, image_length], VQGAN codes in raster order
        :param compute_loss: also return the mean next-token cross-entropy (caption pads are not predicted)
        """
        cfg = self.config
        if text_tokens.shape[1] != cfg.text_length or image_codes.shape[1] != cfg.image_length:
            raise ValueError(f"expected text_tokens [batch, {cfg.text_length}] and image_codes "
                             f"[batch, {cfg.image_length}], got {tuple(text_tokens.shape)} and "
                             f"{tuple(image_codes.shape)}")
        x = torch.cat([self.text_embedding(text_tokens), self.image_embedding(image_codes)], dim=1)
        # the last position has nothing left to predict
        x = x[:, :-1] + self.position_embedding.weight[: cfg.sequence_length - 1]
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x)
        text_hidden, image_hidden = x[:, : cfg.text_length - 1], x[:, cfg.text_length - 1:]
        text_logits = text_hidden @ self.text_embedding.weight.t()  # tied input / output embeddings
        image_logits = image_hidden @ self.image_embedding.weight.t()

        loss = text_loss = image_loss = None
        if compute_loss:
            text_targets = text_tokens[:, 1:].masked_fill(text_tokens[:, 1:] == cfg.pad_token_id, -100)
            text_loss_sum = F.cross_entropy(text_logits.flatten(0, 1).float(), text_targets.flatten(),
                                            ignore_index=-100, reduction="sum")
            image_loss_sum = F.cross_entropy(image_logits.flatten(0, 1).float(), image_codes.flatten(),
                                             reduction="sum")
            num_text = (text_targets != -100).sum().clamp_min(1)
            text_loss, image_loss = text_loss_sum / num_text, image_loss_sum / image_codes.numel()
            loss = (text_loss_sum + image_loss_sum) / (num_text + image_codes.numel())
        return ModelOutput(loss, text_loss, image_loss, text_logits, image_logits)


def count_parameters(model: nn.Module) -> int:
    """Stored parameters (a tensor shared between layers counts once)."""
    return sum(p.numel() for p in model.parameters())
