"""How much memory training a model takes: weights, gradients, optimizer state, activations (work in progress).

    estimate("gpt2-large", optimizer="8bit", checkpointing=True, micro_batch=4)

Models are named shapes (``CATALOGUE``: BERT, T5, GPT-2, GPT-3, GPT-J, DALL-E) whose parameter counts
follow from their dimensions, this kit's presets, or any torch module (counted exactly).

WIP (issue 8): the parameter counts of the catalogue are checked against the published sizes; the
byte formulas, ``estimate`` and its tests against measurement come next.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional


@dataclass(frozen=True)
class ModelShape:
    """A transformer described by its dimensions (enough to count parameters and activations).

    :param layers: transformer blocks (for encoder-decoder models, the encoder's and the decoder's together)
    :param hidden: the residual stream's width (d_model)
    :param heads: attention heads
    :param ffn: the feed-forward layer's inner width
    :param vocab: tokens in the (input) embedding
    :param seq_len: the usual training sequence length
    :param kind: "encoder" (BERT), "decoder" (GPT), "encoder-decoder" (T5)
    :param head_dim: width of one head (default hidden / heads; T5 sets its own)
    :param learned_positions: positions in a learned embedding of seq_len rows (BERT, GPT-2, GPT-3)
    :param tied_output: the output projection shares the input embedding
    :param biases: linear layers and layer norms carry biases (T5 and GPT-J's attention do not)
    """

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq_len: int
    kind: str = "decoder"
    head_dim: Optional[int] = None
    learned_positions: bool = True
    tied_output: bool = True
    biases: bool = True

    @property
    def attention_width(self) -> int:
        return self.heads * (self.head_dim or self.hidden // self.heads)

    def parameters(self) -> int:
        """Parameters, counted from the dimensions."""
        h, a, f = self.hidden, self.attention_width, self.ffn
        bias = 1 if self.biases else 0
        attention = 4 * h * a + bias * (3 * a + h)  # q, k, v, output projections
        feed_forward = 2 * h * f + bias * (f + h)
        norms = 2 * h * (1 + bias)  # a layer norm (or RMS norm without bias) before each sublayer
        block = attention + feed_forward + norms
        if self.kind == "encoder-decoder":  # half the layers are decoder layers, with cross-attention and a norm
            block_total = self.layers * block + (self.layers // 2) * (attention + h * (1 + bias))
        else:
            block_total = self.layers * block
        embeddings = self.vocab * h + (self.seq_len * h if self.learned_positions else 0)
        output = 0 if self.tied_output else self.vocab * h + bias * self.vocab
        final_norm = h * (1 + bias) * (2 if self.kind == "encoder-decoder" else 1)
        return block_total + embeddings + output + final_norm


# Published shapes. GPT-3: Brown et al. (2020), table 2.1; DALL-E: Ramesh et al. (2021): 64 layers of width
# 3968 with 62 heads over 256 text + 1024 image tokens (text vocab 16384, image vocab 8192).
CATALOGUE: Dict[str, ModelShape] = {
    "bert-base": ModelShape(12, 768, 12, 3072, 30522, 512, kind="encoder"),
    "bert-large": ModelShape(24, 1024, 16, 4096, 30522, 512, kind="encoder"),
    "t5-3b": ModelShape(48, 1024, 32, 16384, 32128, 512, kind="encoder-decoder", head_dim=128,
                        learned_positions=False, biases=False),
    "t5-11b": ModelShape(48, 1024, 128, 65536, 32128, 512, kind="encoder-decoder", head_dim=128,
                         learned_positions=False, biases=False),
    "gpt2-small": ModelShape(12, 768, 12, 3072, 50257, 1024),
    "gpt2-medium": ModelShape(24, 1024, 16, 4096, 50257, 1024),
    "gpt2-large": ModelShape(36, 1280, 20, 5120, 50257, 1024),
    "gpt2-xl": ModelShape(48, 1600, 25, 6400, 50257, 1024),
    "gpt3-small": ModelShape(12, 768, 12, 3072, 50257, 2048),
    "gpt3-medium": ModelShape(24, 1024, 16, 4096, 50257, 2048),
    "gpt3-large": ModelShape(24, 1536, 16, 6144, 50257, 2048),
    "gpt3-xl": ModelShape(24, 2048, 24, 8192, 50257, 2048),
    "gpt3-2.7b": ModelShape(32, 2560, 32, 10240, 50257, 2048),
    "gpt3-6.7b": ModelShape(32, 4096, 32, 16384, 50257, 2048),
    "gpt3-13b": ModelShape(40, 5140, 40, 20560, 50257, 2048),
    "gpt3-175b": ModelShape(96, 12288, 96, 49152, 50257, 2048),
    "gpt-j-6b": ModelShape(28, 4096, 16, 16384, 50400, 2048, learned_positions=False, tied_output=False),
    "dalle-12b": ModelShape(64, 3968, 62, 4 * 3968, 16384 + 8192, 1280),
}
