"""The models the memory estimate knows by name: transformers described by their dimensions.

``CATALOGUE`` holds BERT, T5, GPT-2, GPT-3, GPT-J and DALL-E as ``ModelShape``s, whose parameters follow from their
layers, widths and vocabulary; ``known_models`` adds the kit's presets, which collab_kit.memory.estimator counts on
the real model built on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass

from collab_kit.config import PRESETS

# what the feed-forward keeps between its two projections, in tensors as wide as its inner layer: a fused GeLU
# its input and output; GPT-2's "gelu_new" (transformers' NewGELUActivation, written as Python tensor operations)
# also the intermediate results of its pow, tanh and products (5 in all); ReLU its output, which is also the
# second projection's input; GEGLU (the kit's model) the value, the gate, gelu(gate) and their product
FEED_FORWARD_TENSORS = {"gelu": 2, "gelu_new": 5, "relu": 1, "geglu": 4}


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
    :param activation: the feed-forward's non-linearity, for the activations' estimate: one of
      ``FEED_FORWARD_TENSORS`` ("gelu_new" is what transformers' GPT-2 and GPT-J use)
    """

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq_len: int
    kind: str = "decoder"
    head_dim: int | None = None
    learned_positions: bool = True
    tied_output: bool = True
    biases: bool = True
    activation: str = "gelu"

    def __post_init__(self):
        if self.activation not in FEED_FORWARD_TENSORS:
            raise ValueError(
                f"activation={self.activation!r} is not allowed: choose one of {', '.join(FEED_FORWARD_TENSORS)}"
            )
        if self.kind not in ("encoder", "decoder", "encoder-decoder"):
            raise ValueError(f"kind={self.kind!r} is not allowed: choose encoder, decoder or encoder-decoder")

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

    def tensor_shapes(self, shared_groups: int | None = None) -> list[tuple[int, ...]]:
        """Every parameter tensor's shape, in the layout GPT-2 stores them (q, k and v in one matrix).

        What bitsandbytes allocates depends on each tensor's size (``min_8bit_size``, blocks of 256),
        and Adafactor's state on its shape, so a byte-exact estimate needs the list, not the total.
        ``sum(prod(shape)) == parameters()`` without sharing.

        :param shared_groups: only this many distinct blocks exist (ALBERT-style sharing); for an
          encoder-decoder model, this many in the encoder and this many in the decoder
        """
        return [shape for shape, _ in self._tensors(shared_groups)]

    def _tensors(self, shared_groups: int | None = None) -> list[tuple[tuple[int, ...], str | None]]:
        """``(shape, block)`` of every tensor; ``block`` names the transformer block it belongs to (or None)."""
        h, a, f = self.hidden, self.attention_width, self.ffn
        bias = self.biases

        def linear(n_in: int, n_out: int) -> list[tuple[int, ...]]:
            return [(n_in, n_out)] + ([(n_out,)] if bias else [])

        def norm() -> list[tuple[int, ...]]:
            return [(h,)] + ([(h,)] if bias else [])

        attention = linear(h, 3 * a) + linear(a, h)
        block = norm() + attention + norm() + linear(h, f) + linear(f, h)
        cross = norm() + attention  # a decoder layer's attention over the encoder's output
        if self.kind == "encoder-decoder":
            stacks = [("encoder", self.layers - self.layers // 2, block), ("decoder", self.layers // 2, block + cross)]
        else:
            stacks = [("block", self.layers, block)]
        tensors: list[tuple[tuple[int, ...], str | None]] = [((self.vocab, h), None)]
        if self.learned_positions:
            tensors.append(((self.seq_len, h), None))
        for name, count, shapes in stacks:
            distinct = count if shared_groups is None else _check_groups(shared_groups, count, name)
            tensors += [(shape, f"{name}.{i}") for i in range(distinct) for shape in shapes]
        tensors += [(shape, None) for shape in norm() * (2 if self.kind == "encoder-decoder" else 1)]
        if not self.tied_output:
            tensors += [((h, self.vocab), None)] + ([((self.vocab,), None)] if bias else [])
        return tensors


def _check_groups(groups, layers: int, what: str) -> int:
    if not isinstance(groups, int) or isinstance(groups, bool) or not 1 <= groups <= layers:
        raise ValueError(
            f"shared_groups={groups!r} is not allowed: expected an integer from 1 to the {layers} "
            f"layers of the {what} stack (or None: no sharing)"
        )
    return groups


# Published shapes. GPT-3: Brown et al. (2020), table 2.1; DALL-E: Ramesh et al. (2021): 64 layers of width
# 3968 with 62 heads over 256 text + 1024 image tokens (text vocab 16384, image vocab 8192).
CATALOGUE: dict[str, ModelShape] = {
    "bert-base": ModelShape(12, 768, 12, 3072, 30522, 512, kind="encoder"),
    "bert-large": ModelShape(24, 1024, 16, 4096, 30522, 512, kind="encoder"),
    "t5-3b": ModelShape(
        48,
        1024,
        32,
        16384,
        32128,
        512,
        kind="encoder-decoder",
        head_dim=128,
        learned_positions=False,
        biases=False,
        activation="relu",
    ),
    "t5-11b": ModelShape(
        48,
        1024,
        128,
        65536,
        32128,
        512,
        kind="encoder-decoder",
        head_dim=128,
        learned_positions=False,
        biases=False,
        activation="relu",
    ),
    "gpt2-small": ModelShape(12, 768, 12, 3072, 50257, 1024, activation="gelu_new"),
    "gpt2-medium": ModelShape(24, 1024, 16, 4096, 50257, 1024, activation="gelu_new"),
    "gpt2-large": ModelShape(36, 1280, 20, 5120, 50257, 1024, activation="gelu_new"),
    "gpt2-xl": ModelShape(48, 1600, 25, 6400, 50257, 1024, activation="gelu_new"),
    "gpt3-small": ModelShape(12, 768, 12, 3072, 50257, 2048),
    "gpt3-medium": ModelShape(24, 1024, 16, 4096, 50257, 2048),
    "gpt3-large": ModelShape(24, 1536, 16, 6144, 50257, 2048),
    "gpt3-xl": ModelShape(24, 2048, 24, 8192, 50257, 2048),
    "gpt3-2.7b": ModelShape(32, 2560, 32, 10240, 50257, 2048),
    "gpt3-6.7b": ModelShape(32, 4096, 32, 16384, 50257, 2048),
    "gpt3-13b": ModelShape(40, 5140, 40, 20560, 50257, 2048),
    "gpt3-175b": ModelShape(96, 12288, 96, 49152, 50257, 2048),
    "gpt-j-6b": ModelShape(
        28, 4096, 16, 16384, 50400, 2048, learned_positions=False, tied_output=False, activation="gelu_new"
    ),
    "dalle-12b": ModelShape(64, 3968, 62, 4 * 3968, 16384 + 8192, 1280),
}


def known_models() -> list[str]:
    """Every name ``estimate`` accepts: the catalogue's shapes, then the kit's presets."""
    return [*CATALOGUE, *PRESETS]
