"""How much memory training a model takes: weights, gradients, optimizer state, activations.

    estimate("gpt2-large", optimizer="8bit", checkpointing=True, micro_batch=4)
    recommend_settings("paper", 16 * 2**30)        # the largest micro-batch that fits a 16 GiB GPU

Models are named shapes (``CATALOGUE``: BERT, T5, GPT-2, GPT-3, GPT-J, DALL-E) whose parameters
follow from their dimensions, this kit's presets (``tiny``, ``small``, ``toy``, ``paper``: the
``TextToImageTransformer`` built on the meta device and counted), a ``ModelConfig`` or ``RunConfig``,
or any torch module (counted exactly, tensor by tensor).

Where the memory goes, and the paper's tricks against each part:

- **weights** and **gradients**: one number per parameter each. Shared layers (ALBERT-style, as in the
  paper's DALL-E) store fewer distinct parameters for the same computation.
- **optimizer state**: Adam keeps two statistics per parameter, twice the weights in fp32. The 8-bit
  optimizer (bitsandbytes) keeps them in 8 bits; offloading moves them (with an fp32 master copy of
  the weights) to CPU RAM, at the price of a PCIe round trip per step.
- **activations**: what the forward pass keeps for backward; grows with the micro-batch, the
  sequence and the depth. Gradient checkpointing (or reversible layers) keeps only each layer's input.

The byte counts of weights, gradients and optimizer state are exact: ``tests/test_memory.py`` checks
them against the bytes torch and bitsandbytes allocate after a real step. Activations are an
estimate from a per-layer formula, checked against what a CPU training step of GPT-2 small, medium and
large keeps (``benchmarks/memory_estimates.py``); ``benchmarks/memory_gpu.py`` measures a GPU's peak.

Measured counterparts: ``parameter_bytes``, ``gradient_bytes``, ``optimizer_state_bytes``.
"""
from __future__ import annotations

import dataclasses
import io
import logging
import math
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

GiB = 2 ** 30

OPTIMIZERS = ("32bit", "16bit", "8bit", "factorized")
OPTIMIZER_NAMES = {"32bit": "32-bit Adam", "16bit": "16-bit Adam", "8bit": "8-bit Adam",
                   "factorized": "factorized (Adafactor)"}
PRECISIONS = ("mixed", "fp32", "16bit", "bf16", "fp16")  # bf16 and fp16 are names for "16bit"
ATTENTIONS = ("sdpa", "eager")

# bitsandbytes 0.50.2, optim/optimizer.py, Optimizer2State.init_state: tensors with fewer elements than
# min_8bit_size keep fp32 statistics; larger ones get uint8 statistics, one fp32 absmax per block of 256
# elements for each statistic, and a 256-value fp32 quantization map for each (shared by all tensors)
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCKSIZE = 256
BNB_QMAP_VALUES = 256

# what the feed-forward keeps between its two projections, in tensors as wide as its inner layer: a fused GeLU
# its input and output; GPT-2's "gelu_new" (transformers' NewGELUActivation, written as Python tensor operations)
# also the intermediate results of its pow, tanh and products (5 in all); ReLU its output, which is also the
# second projection's input; GEGLU (the kit's model) the value, the gate, gelu(gate) and their product
FEED_FORWARD_TENSORS = {"gelu": 2, "gelu_new": 5, "relu": 1, "geglu": 4}

# a PCIe 3.0 x16 link moves about 12 GB/s in practice (16 GB/s on paper); PCIe 4.0 about twice that
DEFAULT_PCIE_GB_PER_S = 12.0
# without checkpointing, a micro-batch this large keeps a GPU busy: recommend_settings prefers it to a larger
# micro-batch with checkpointing, which costs a second forward pass (about a third more compute per sample)
MIN_MICRO_BATCH_WITHOUT_CHECKPOINTING = 4


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
    head_dim: Optional[int] = None
    learned_positions: bool = True
    tied_output: bool = True
    biases: bool = True
    activation: str = "gelu"

    def __post_init__(self):
        if self.activation not in FEED_FORWARD_TENSORS:
            raise ValueError(f"activation={self.activation!r} is not allowed: choose one of "
                             f"{', '.join(FEED_FORWARD_TENSORS)}")
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

    def tensor_shapes(self, shared_groups: Optional[int] = None) -> List[Tuple[int, ...]]:
        """Every parameter tensor's shape, in the layout GPT-2 stores them (q, k and v in one matrix).

        What bitsandbytes allocates depends on each tensor's size (``min_8bit_size``, blocks of 256),
        and Adafactor's state on its shape, so a byte-exact estimate needs the list, not the total.
        ``sum(prod(shape)) == parameters()`` without sharing.

        :param shared_groups: only this many distinct blocks exist (ALBERT-style sharing); for an
          encoder-decoder model, this many in the encoder and this many in the decoder
        """
        return [shape for shape, _ in self._tensors(shared_groups)]

    def _tensors(self, shared_groups: Optional[int] = None) -> List[Tuple[Tuple[int, ...], Optional[str]]]:
        """``(shape, block)`` of every tensor; ``block`` names the transformer block it belongs to (or None)."""
        h, a, f = self.hidden, self.attention_width, self.ffn
        bias = self.biases

        def linear(n_in: int, n_out: int) -> List[Tuple[int, ...]]:
            return [(n_in, n_out)] + ([(n_out,)] if bias else [])

        def norm() -> List[Tuple[int, ...]]:
            return [(h,)] + ([(h,)] if bias else [])

        attention = linear(h, 3 * a) + linear(a, h)
        block = norm() + attention + norm() + linear(h, f) + linear(f, h)
        cross = norm() + attention  # a decoder layer's attention over the encoder's output
        if self.kind == "encoder-decoder":
            stacks = [("encoder", self.layers - self.layers // 2, block), ("decoder", self.layers // 2, block + cross)]
        else:
            stacks = [("block", self.layers, block)]
        tensors: List[Tuple[Tuple[int, ...], Optional[str]]] = [((self.vocab, h), None)]
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
        raise ValueError(f"shared_groups={groups!r} is not allowed: expected an integer from 1 to the {layers} "
                         f"layers of the {what} stack (or None: no sharing)")
    return groups


# Published shapes. GPT-3: Brown et al. (2020), table 2.1; DALL-E: Ramesh et al. (2021): 64 layers of width
# 3968 with 62 heads over 256 text + 1024 image tokens (text vocab 16384, image vocab 8192).
CATALOGUE: Dict[str, ModelShape] = {
    "bert-base": ModelShape(12, 768, 12, 3072, 30522, 512, kind="encoder"),
    "bert-large": ModelShape(24, 1024, 16, 4096, 30522, 512, kind="encoder"),
    "t5-3b": ModelShape(48, 1024, 32, 16384, 32128, 512, kind="encoder-decoder", head_dim=128,
                        learned_positions=False, biases=False, activation="relu"),
    "t5-11b": ModelShape(48, 1024, 128, 65536, 32128, 512, kind="encoder-decoder", head_dim=128,
                         learned_positions=False, biases=False, activation="relu"),
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
    "gpt-j-6b": ModelShape(28, 4096, 16, 16384, 50400, 2048, learned_positions=False, tied_output=False,
                           activation="gelu_new"),
    "dalle-12b": ModelShape(64, 3968, 62, 4 * 3968, 16384 + 8192, 1280),
}


def known_models() -> List[str]:
    """Every name ``estimate`` accepts: the catalogue's shapes, then the kit's presets."""
    from collab_kit.config import PRESETS

    return [*CATALOGUE, *PRESETS]


# ---------------------------------------------------------------------------------------------
# what a model is made of, whatever it was given as


@dataclass
class _Architecture:
    """The parameter tensors of a model and the dimensions its activations depend on (None: unknown)."""

    label: str
    tensors: List[Tuple[Tuple[int, ...], Optional[str]]]  # trainable: (shape, block it belongs to or None)
    frozen: int = 0  # parameters without gradients
    layers: Optional[int] = None
    hidden: Optional[int] = None
    heads: Optional[int] = None
    attention_width: Optional[int] = None
    ffn: Optional[int] = None
    vocab: Optional[int] = None
    seq_len: Optional[int] = None  # the default sequence length
    max_seq_len: Optional[int] = None  # learned positions: no longer sequence possible
    fixed_seq_len: bool = False  # the kit's model: the sequence is its caption and image, nothing else
    logits_per_sample: Optional[int] = None  # overrides seq_len * vocab (the kit's two vocabularies)
    cross_attention_layers: int = 0  # decoder layers of an encoder-decoder model attend twice
    activation: str = "gelu"  # a key of FEED_FORWARD_TENSORS
    dropout: bool = True  # dropout masks (1 byte per element) are kept for backward
    reversible: bool = False  # activations are rebuilt in backward whatever `checkpointing` says
    shareable: bool = False  # shared_groups can be applied (a ModelShape)
    shape: Optional[ModelShape] = None

    @property
    def knows_activations(self) -> bool:
        return None not in (self.layers, self.hidden, self.heads, self.ffn, self.seq_len)


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _from_shape(shape: ModelShape, label: str, shared_groups: Optional[int]) -> _Architecture:
    return _Architecture(
        label=label, tensors=shape._tensors(shared_groups), layers=shape.layers, hidden=shape.hidden,
        heads=shape.heads, attention_width=shape.attention_width, ffn=shape.ffn, vocab=shape.vocab,
        seq_len=shape.seq_len, max_seq_len=shape.seq_len if shape.learned_positions else None,
        cross_attention_layers=shape.layers // 2 if shape.kind == "encoder-decoder" else 0,
        activation=shape.activation, shareable=True, shape=shape)


_BLOCK = re.compile(r"^(.*?\.\d+)\.")  # "transformer.h.3.attn.c_attn.weight" -> "transformer.h.3"


def _from_module(module: torch.nn.Module, label: str) -> _Architecture:
    """Every distinct parameter of ``module``; a parameter under a numbered child (``h.3.``) belongs to that block."""
    tensors, frozen = [], 0
    for name, param in module.named_parameters():  # tied or shared tensors are listed once
        if param.requires_grad:
            match = _BLOCK.match(name)
            tensors.append((tuple(param.shape), match.group(1) if match else None))
        else:
            frozen += param.numel()
    arch = _Architecture(label=label, tensors=tensors, frozen=frozen)
    from collab_kit.model import TextToImageTransformer

    config = getattr(module, "config", None)
    if isinstance(module, TextToImageTransformer):
        _describe_kit(arch, module.config)
    elif config is not None and all(hasattr(config, k) for k in ("num_hidden_layers", "hidden_size",
                                                                  "num_attention_heads", "vocab_size")):
        # a transformers model (GPT-2, BERT, ...): its config names the dimensions
        h = config.hidden_size
        positions = getattr(config, "max_position_embeddings", None)
        arch.layers, arch.hidden, arch.heads = config.num_hidden_layers, h, config.num_attention_heads
        arch.attention_width, arch.vocab = h, config.vocab_size
        arch.ffn = getattr(config, "n_inner", None) or getattr(config, "intermediate_size", None) or 4 * h
        arch.seq_len = arch.max_seq_len = positions
        name = getattr(config, "activation_function", None) or getattr(config, "hidden_act", None)
        arch.activation = name if name in ("gelu_new", "relu") else "gelu"
        arch.dropout = any((getattr(config, k, 0) or 0) > 0
                           for k in ("resid_pdrop", "hidden_dropout_prob", "dropout", "dropout_rate"))
    return arch


def _describe_kit(arch: _Architecture, config) -> None:
    """The dimensions of the kit's TextToImageTransformer (collab_kit.model) for ``config`` (a ModelConfig)."""
    arch.layers, arch.hidden, arch.heads = config.num_layers, config.hidden_size, config.num_heads
    arch.attention_width, arch.ffn = config.hidden_size, config.ffn_multiplier * config.hidden_size
    arch.seq_len, arch.fixed_seq_len = config.sequence_length, True
    arch.vocab = config.text_vocab_size + config.codebook_size
    # caption positions predict caption tokens, image positions predict codes (collab_kit.model.forward)
    arch.logits_per_sample = ((config.text_length - 1) * config.text_vocab_size
                              + config.image_length * config.codebook_size)
    arch.activation, arch.dropout, arch.reversible = "geglu", False, config.reversible


_KIT_CACHE: Dict[str, _Architecture] = {}


def _from_kit_config(config, label: str) -> _Architecture:
    """Build the kit's model on the meta device (no memory, even for the paper preset) and count its tensors."""
    from collab_kit.model import TextToImageTransformer

    key = repr(config)
    if key not in _KIT_CACHE:
        with torch.device("meta"):
            model = TextToImageTransformer(config)
        _KIT_CACHE[key] = _from_module(model, label)
    return dataclasses.replace(_KIT_CACHE[key], label=label)


def _resolve(model, shared_groups: Optional[int]) -> Tuple[_Architecture, dict]:
    """``model`` as an _Architecture, plus defaults it implies (a RunConfig's offload and min_8bit_size)."""
    from collab_kit.config import PRESETS, ModelConfig, RunConfig, get_preset

    defaults: dict = {}
    label = None
    if isinstance(model, RunConfig):
        defaults = dict(offload=model.optimizer.offload_optimizer, min_8bit_size=model.optimizer.min_8bit_size)
        label, model = f"{model.preset} preset", model.model
    if isinstance(model, str):
        if model in CATALOGUE:
            arch = _from_shape(CATALOGUE[model], model, shared_groups)
        elif model in PRESETS:
            arch = _from_kit_config(get_preset(model).model, f"{model} preset")
        else:
            raise ValueError(f"unknown model {model!r}: choose one of {', '.join(known_models())}, "
                             f"or pass a ModelShape, a RunConfig or a torch module")
    elif isinstance(model, ModelShape):
        arch = _from_shape(model, "custom shape", shared_groups)
    elif isinstance(model, ModelConfig):
        arch = _from_kit_config(model, label or "custom ModelConfig")
    elif isinstance(model, torch.nn.Module):
        arch = _from_module(model, type(model).__name__)
    else:
        raise TypeError(f"model={model!r}: expected a name ({', '.join(known_models())}), a ModelShape, "
                        f"a ModelConfig, a RunConfig or a torch.nn.Module")
    if shared_groups is not None and not arch.shareable:
        raise ValueError(f"shared_groups applies to catalogue names and ModelShapes; {arch.label} already has "
                         f"the parameters it has (the kit's model shares layers when its ModelConfig sets "
                         f"share_layer_groups=True)")
    return arch, defaults


# ---------------------------------------------------------------------------------------------
# the estimate


@dataclass
class MemoryEstimate:
    """Bytes one training step needs, part by part (``str()`` prints them as a table).

    ``gpu_bytes = weights_bytes + gradients_bytes + optimizer_bytes (unless offloaded) + activations_bytes``;
    it leaves out the CUDA context (about 0.3-0.5 GiB per process, outside torch's allocator) and the
    allocator's fragmentation: keep a headroom for them (``recommend_settings`` uses 85 % of the GPU).
    """

    model: str
    optimizer: str
    precision: str
    micro_batch: int
    seq_len: Optional[int]
    checkpointing: bool
    offload: bool
    shared_groups: Optional[int]
    parameters: int  # stored parameters (a shared tensor counts once)
    trainable_parameters: int
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    weight_copies_bytes: int  # the part of activations_bytes that is autocast's 16-bit copies of the weights
    gpu_bytes: int
    cpu_bytes: int
    transfer_bytes: int  # over PCIe per optimizer step when offloaded
    transfer_seconds: float
    notes: Tuple[str, ...] = ()

    def parts(self) -> Dict[str, int]:
        """What the GPU holds, part by part (the optimizer state is 0 when offloaded): the bars of a chart."""
        return {"weights": self.weights_bytes, "gradients": self.gradients_bytes,
                "optimizer state": 0 if self.offload else self.optimizer_bytes,
                "activations": self.activations_bytes}

    def describe(self) -> str:
        """One line: the model and the settings."""
        tokens = f" x {self.seq_len} tokens" if self.seq_len else ""
        tricks = [name for name, on in (("checkpointing", self.checkpointing), ("offload", self.offload)) if on]
        if self.shared_groups:
            tricks.append(f"{self.shared_groups} shared layer groups")
        return (f"{self.model}: {OPTIMIZER_NAMES[self.optimizer]}, {self.precision} precision, "
                f"micro-batch {self.micro_batch}{tokens}" + (", " + ", ".join(tricks) if tricks else ""))

    def table(self) -> str:
        """The estimate as a small table in GiB (MiB or KiB for small models)."""
        where_state = "CPU" if self.offload else "GPU"
        count = (f"{self.parameters / 1e6:,.1f} M" if self.parameters >= 1e5 else f"{self.parameters:,}")
        rows = [("parameters", count, ""),
                ("weights", format_bytes(self.weights_bytes), "GPU"),
                ("gradients", format_bytes(self.gradients_bytes), "GPU"),
                ("optimizer state", format_bytes(self.optimizer_bytes), where_state),
                ("activations", format_bytes(self.activations_bytes), "GPU"),
                ("total on the GPU", format_bytes(self.gpu_bytes), "")]
        if self.offload:
            rows += [("in CPU memory", format_bytes(self.cpu_bytes), "state + fp32 master weights and gradients"),
                     ("PCIe per step", format_bytes(self.transfer_bytes), f"{self.transfer_seconds:.2f} s")]
        width = max(len(name) for name, _, _ in rows)
        lines = [self.describe()] + [f"  {name.ljust(width)}  {value:>12}  {where}".rstrip()
                                     for name, value, where in rows]
        return "\n".join(lines + [f"  note: {note}" for note in self.notes])

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        values = dataclasses.asdict(self)
        values["notes"] = list(self.notes)
        return values


def format_bytes(n: float) -> str:
    """Bytes in GiB, or in MiB / KiB when that would round to nothing."""
    for unit, size in (("GiB", GiB), ("MiB", 2 ** 20)):
        if n >= 0.1 * size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 1024:.2f} KiB"


def _positive_int(name: str, value, what: str = "a positive integer") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed: expected {what}")


def _precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not allowed: choose one of {', '.join(PRECISIONS)}")
    return "16bit" if precision in ("bf16", "fp16") else precision


def optimizer_bytes_for(shapes: Sequence[Tuple[int, ...]], optimizer: str,
                        min_8bit_size: int = BNB_MIN_8BIT_SIZE) -> int:
    """Bytes of the state ``optimizer`` keeps for parameter tensors of these shapes (see ``estimate``)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not allowed: choose one of {', '.join(OPTIMIZERS)}")
    total, any_8bit = 0, False
    for shape in shapes:
        n = _numel(shape)
        if optimizer == "32bit":  # torch.optim.Adam: exp_avg, exp_avg_sq in fp32, a float32 step tensor
            total += 8 * n + 4
        elif optimizer == "16bit":  # torch.optim.Adam on 16-bit parameters: 16-bit statistics, fp32 step
            total += 4 * n + 4
        elif optimizer == "8bit":  # bitsandbytes Adam8bit; its step is a Python int
            if n < min_8bit_size:
                total += 8 * n
            else:
                any_8bit = True
                total += 2 * n + 2 * 4 * (-(-n // BNB_BLOCKSIZE))  # two uint8 statistics + their fp32 absmax
        else:  # factorized: transformers' Adafactor (beta1=None): row and column second moments, fp32 RMS
            if len(shape) >= 2:
                rows, columns = _numel(shape[:-1]), _numel(shape[:-2]) * shape[-1]
                total += 4 * (rows + columns) + 4
            else:
                total += 4 * n + 4
    if any_8bit:  # the signed and unsigned quantization maps, one tensor each shared by every parameter
        total += 2 * BNB_QMAP_VALUES * 4
    return total


def _activation_bytes(arch: _Architecture, micro_batch: int, seq_len: int, checkpointing: bool,
                      precision: str, attention: str) -> Tuple[int, int]:
    """(activations, the part of them that is autocast's weight copies) for one micro-batch; see ``estimate``."""
    s, b = seq_len, micro_batch
    h, aw, f, heads = arch.hidden, arch.attention_width or arch.hidden, arch.ffn, arch.heads
    e = 4 if precision == "fp32" else 2  # matrix products' outputs
    r = 2 if precision == "16bit" else 4  # the residual stream: fp32 under autocast (fp32 parameters)
    mask = 1 if arch.dropout else 0  # dropout keeps a 1-byte mask
    attention_part = s * b * (e * h + 4 * e * aw + mask * h)  # qkv input, q, k, v, output-projection input
    if attention == "eager":  # heads x s x s: the softmax's output (fp32 under autocast), and the product with
        # the values' input: the dropout's output and mask, or under autocast the softmax's 16-bit copy
        softmax = 2 if precision == "16bit" else 4
        product_input = (e + 1) if arch.dropout else (e if precision == "mixed" else 0)
        attention_part += heads * s * s * b * (softmax + product_input)
    else:  # fused attention (torch SDPA, flash) keeps only a float32 log-sum-exp per row and head
        attention_part += 4 * heads * s * b
    feed_forward = s * b * (e * h + mask * h) + FEED_FORWARD_TENSORS[arch.activation] * e * s * b * f
    norms = 2 * r * s * b * h
    layer = attention_part + feed_forward + norms
    cross_layer = attention_part + r * s * b * h  # a decoder layer's cross-attention and its norm
    cross = arch.cross_attention_layers * cross_layer

    logits = (arch.logits_per_sample if arch.logits_per_sample is not None else s * arch.vocab) * b
    # embeddings' dropout mask, the final norm's input, the output projection's input; the logits in the compute
    # dtype, their fp32 log-probabilities saved by the loss and the fp32 gradient backward starts from
    ends = s * b * h * (mask + r + e) + logits * (e + 4 + 4)

    if arch.reversible:  # only the two streams of the last layer are saved; one layer is rebuilt at a time
        stored = 2 * r * s * b * h + layer
    elif checkpointing:  # every layer's input, and one layer's activations while it is recomputed
        stored = arch.layers * r * s * b * h + layer + (cross_layer if arch.cross_attention_layers else 0)
    else:
        stored = arch.layers * layer + cross

    copies = 0
    if precision == "mixed":
        # autocast casts each weight matrix to 16 bits for its matrix product, keeps the copy for backward, and
        # caches it until the autocast context around the forward pass exits: with checkpointing (or reversible
        # layers) too, every copy is alive at the end of the forward pass (benchmarks/memory_estimates.py
        # measures it); a recomputed layer casts its weights again in backward, once the cache is gone.
        # A shared (tied) matrix is cast once.
        copies = 2 * sum(_numel(shape) for shape, _ in arch.tensors if len(shape) >= 2)
    return stored + ends + copies, copies


def estimate(model, *, optimizer: str = "32bit", offload: Optional[bool] = None, checkpointing: bool = True,
             shared_groups: Optional[int] = None, micro_batch: int = 1, seq_len: Optional[int] = None,
             precision: str = "mixed", attention: str = "sdpa", min_8bit_size: Optional[int] = None,
             pcie_gb_per_s: float = DEFAULT_PCIE_GB_PER_S) -> MemoryEstimate:
    """The memory of one training step of ``model``, part by part.

    :param model: a catalogue name ("gpt2-large", see ``known_models()``), a kit preset ("tiny", "small",
      "toy", "paper"), a ``ModelShape``, a kit ``ModelConfig`` or ``RunConfig``, or a ``torch.nn.Module``
      (counted exactly: every distinct parameter; frozen ones have no gradient and no optimizer state)
    :param optimizer: the optimizer's state, per parameter tensor of n elements:

      - "32bit": ``torch.optim.Adam``: two fp32 statistics (8 B per parameter) and a float32 ``step`` (4 B);
      - "16bit": ``torch.optim.Adam`` on 16-bit parameters: two 16-bit statistics (4 B) and the fp32 step;
      - "8bit": bitsandbytes' ``Adam8bit`` (0.50.2, also the kit's 8-bit LAMB, which keeps the same state):
        a tensor with fewer than ``min_8bit_size`` elements keeps two fp32 statistics (8 B per element);
        a larger one two uint8 statistics (2 B) plus, for each, one fp32 absmax per block of 256 elements;
        and the two 256-value fp32 quantization maps (2 KiB), shared by all tensors, once;
      - "factorized": Adafactor (``transformers.optimization.Adafactor`` with ``beta1=None``): no first
        moment; the second moment of a matrix ``[..., rows, columns]`` factored into fp32 row and column
        sums (rows + columns values instead of rows x columns), vectors keep a full fp32 second moment;
        plus an fp32 RMS scalar per tensor.
    :param offload: the optimizer runs on the CPU (hivemind's ``offload_optimizer``): its state, an fp32
      master copy of the parameters and an fp32 gradient buffer live in CPU RAM (``cpu_bytes``); every step
      the gradients go to the CPU and the updated weights come back (``transfer_bytes`` at ``pcie_gb_per_s``
      gigabytes per second: ``transfer_seconds``). The GPU keeps its weights and gradients. Default: False,
      or the RunConfig's ``optimizer.offload_optimizer``.
    :param checkpointing: gradient checkpointing: only each layer's input is kept, and one layer's
      activations while it is recomputed in backward. The kit's reversible model (``ModelConfig.reversible``)
      rebuilds its activations in backward whatever this says.
    :param shared_groups: ALBERT-style sharing (Lan et al. 2020), as the paper's DALL-E: the layers share the
      weights of this many distinct blocks (for catalogue names and ModelShapes; an encoder-decoder model
      shares this many in each stack). Weights, gradients and optimizer state shrink; activations do not
      (every layer still runs).
    :param micro_batch: samples per forward/backward pass
    :param seq_len: tokens per sample (default: the model's training length; the kit's model has a fixed one)
    :param precision: what the tensors are stored in:

      - "mixed" (``torch.autocast`` with fp32 parameters, as the kit and the GPT-2 tutorial train): weights and
        gradients 4 B per parameter; matrix products compute and save 16-bit outputs, while the residual
        stream and layer-norm inputs stay fp32 (a 16-bit product added to an fp32 tensor is fp32); autocast's
        16-bit copies of the weight matrices are kept for backward, and in autocast's cache until the forward
        pass's autocast context exits, with checkpointing too (``weight_copies_bytes``, counted in the
        activations);
      - "fp32": everything 4 B;
      - "16bit" ("bf16", "fp16"): parameters and gradients 2 B each, no fp32 master copy on the GPU.
    :param attention: "sdpa" (fused attention: torch's scaled_dot_product_attention, which transformers uses
      by default, keeps no s x s matrix) or "eager" (the scores, softmax and dropout are kept per head)
    :param min_8bit_size: bitsandbytes' threshold (default 4096, or the RunConfig's)
    :param pcie_gb_per_s: host <-> GPU bandwidth in gigabytes per second (12: PCIe 3.0 x16 in practice)

    Activations (an estimate, checked on a CPU by ``benchmarks/memory_estimates.py``; a GPU's peak is measured
    by ``benchmarks/memory_gpu.py``): per transformer layer,
    the tensors backward needs, after Korthikanti et al. (2022), "Reducing Activation Recomputation in Large
    Transformer Models": ``s*b*h*(34 + 5*a*s/h)`` bytes in 16 bits with dropout (s tokens, b samples, h width,
    a heads). Here each term has its own dtype (see ``precision``), the s x s term is replaced by a log-sum-exp
    with fused attention, the feed-forward term follows the inner width and what the non-linearity keeps
    (``FEED_FORWARD_TENSORS``), and dropout masks (1 byte, as CUDA's fused dropout keeps them) exist only for
    models with dropout. Without checkpointing every layer keeps all of it; with checkpointing the
    layers keep their inputs, plus one layer's activations. On top come the embeddings' and the output's
    inputs and the logits: ``s*b*vocab`` of them in the compute dtype, plus fp32 log-probabilities the loss
    keeps and the fp32 gradient backward starts from (for GPT-2, vocab 50257, often the largest term).
    Short-lived buffers (the gradient flowing between layers, matmul workspaces) are not counted.
    A torch module without a config naming its dimensions gets no activation estimate (0, with a note).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not allowed: choose one of {', '.join(OPTIMIZERS)}")
    precision = _precision(precision)
    if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r} is not allowed: choose one of {', '.join(ATTENTIONS)}")
    _positive_int("micro_batch", micro_batch)
    if seq_len is not None:
        _positive_int("seq_len", seq_len, "a positive number of tokens, or None for the model's own")
    if not isinstance(pcie_gb_per_s, (int, float)) or isinstance(pcie_gb_per_s, bool) or not pcie_gb_per_s > 0:
        raise ValueError(f"pcie_gb_per_s={pcie_gb_per_s!r} is not allowed: expected a positive number of GB/s")
    if offload is not None and not isinstance(offload, bool):
        raise ValueError(f"offload={offload!r} is not allowed: expected True, False or None")
    arch, defaults = _resolve(model, shared_groups)
    if min_8bit_size is None:
        min_8bit_size = defaults.get("min_8bit_size", BNB_MIN_8BIT_SIZE)
    _positive_int("min_8bit_size", min_8bit_size)
    if offload is None:
        offload = defaults.get("offload", False)
    return _estimate(arch, optimizer=optimizer, offload=offload, checkpointing=bool(checkpointing),
                     shared_groups=shared_groups, micro_batch=micro_batch, seq_len=seq_len, precision=precision,
                     attention=attention, min_8bit_size=min_8bit_size, pcie_gb_per_s=pcie_gb_per_s)


def _estimate(arch: _Architecture, *, optimizer, offload, checkpointing, shared_groups, micro_batch, seq_len,
              precision, attention, min_8bit_size, pcie_gb_per_s) -> MemoryEstimate:
    notes: List[str] = []
    if seq_len is None:
        seq_len = arch.seq_len
    elif arch.fixed_seq_len and seq_len != arch.seq_len:
        raise ValueError(f"seq_len={seq_len} is not allowed for {arch.label}: its samples are always "
                         f"{arch.seq_len} tokens (caption and image codes); pass seq_len=None")
    elif arch.max_seq_len is not None and seq_len > arch.max_seq_len:
        raise ValueError(f"seq_len={seq_len} is not allowed: {arch.label} learns {arch.max_seq_len} positions, "
                         f"so its sequences have at most {arch.max_seq_len} tokens")
    shapes = [shape for shape, _ in arch.tensors]
    trainable = sum(_numel(shape) for shape in shapes)
    parameters = trainable + arch.frozen
    per_parameter = 2 if precision == "16bit" else 4
    weights, gradients = per_parameter * parameters, per_parameter * trainable
    state = optimizer_bytes_for(shapes, optimizer, min_8bit_size)
    if arch.knows_activations:
        activations, copies = _activation_bytes(arch, micro_batch, seq_len, checkpointing, precision, attention)
    else:
        activations = copies = 0
        notes.append(f"{arch.label} does not say its layers, width and sequence length: activations not estimated")
    if arch.reversible:
        notes.append("reversible layers: activations are rebuilt in backward with or without checkpointing")
    cpu = transfer = 0
    if offload:
        cpu = state + 4 * trainable + 4 * trainable  # state, fp32 master weights, fp32 gradient buffer
        transfer = gradients + per_parameter * trainable  # gradients out, updated weights back
    gpu = weights + gradients + (0 if offload else state) + activations
    return MemoryEstimate(
        model=arch.label, optimizer=optimizer, precision=precision, micro_batch=micro_batch, seq_len=seq_len,
        checkpointing=checkpointing, offload=offload, shared_groups=shared_groups, parameters=parameters,
        trainable_parameters=trainable, weights_bytes=weights, gradients_bytes=gradients, optimizer_bytes=state,
        activations_bytes=activations, weight_copies_bytes=copies, gpu_bytes=gpu, cpu_bytes=cpu,
        transfer_bytes=transfer, transfer_seconds=transfer / (pcie_gb_per_s * 1e9), notes=tuple(notes))


def compare(model, *, micro_batch: int = 1, seq_len: Optional[int] = None, shared_groups: Optional[int] = None,
            precision: str = "mixed", **kwargs) -> Dict[str, MemoryEstimate]:
    """The paper's tricks one after the other: 32-bit Adam, 8-bit, + checkpointing, + offloading.

    :param kwargs: more arguments of ``estimate`` (attention, pcie_gb_per_s, min_8bit_size)
    """
    common = dict(micro_batch=micro_batch, seq_len=seq_len, shared_groups=shared_groups, precision=precision,
                  **kwargs)
    return {
        "32-bit Adam": estimate(model, optimizer="32bit", checkpointing=False, offload=False, **common),
        "8-bit Adam": estimate(model, optimizer="8bit", checkpointing=False, offload=False, **common),
        "8-bit + checkpointing": estimate(model, optimizer="8bit", checkpointing=True, offload=False, **common),
        "8-bit + checkpointing + offload": estimate(model, optimizer="8bit", checkpointing=True, offload=True,
                                                    **common),
    }


# ---------------------------------------------------------------------------------------------
# settings for a GPU


@dataclass
class Recommendation:
    """What ``recommend_settings`` chose, and why (``reason``, also ``str()``)."""

    micro_batch: int
    checkpointing: bool
    estimate: MemoryEstimate
    fits: bool
    reason: str
    gpu_memory_bytes: int = 0
    budget_bytes: int = 0

    def __str__(self) -> str:
        return self.reason


def recommend_settings(model, gpu_memory_bytes: int, *, optimizer: str = "8bit", seq_len: Optional[int] = None,
                       headroom: float = 0.85, max_micro_batch: int = 64, offload: Optional[bool] = None,
                       precision: str = "mixed", shared_groups: Optional[int] = None,
                       checkpointing: Optional[bool] = None,
                       min_micro_batch: int = MIN_MICRO_BATCH_WITHOUT_CHECKPOINTING, **kwargs) -> Recommendation:
    """The largest micro-batch that fits ``headroom`` of the GPU's memory, and whether to checkpoint.

    Without checkpointing a step is about a third faster (no second forward pass), so it is chosen when
    its largest micro-batch reaches ``min_micro_batch`` (4: enough to keep a GPU busy; hivemind accumulates
    micro-batches up to the swarm's target batch anyway), or is as large as with checkpointing. Otherwise
    checkpointing, with its largest micro-batch. When not even one sample fits with checkpointing,
    ``fits`` is False and ``reason`` says which change would fit (8-bit optimizer, offloading, a smaller model).

    :param model: anything ``estimate`` takes: a name, a preset, a ModelShape, a RunConfig, a torch module
    :param gpu_memory_bytes: the GPU's memory (``torch.cuda.get_device_properties(0).total_memory``)
    :param headroom: the fraction of it to plan for; the rest is for the CUDA context and fragmentation
    :param max_micro_batch: the largest micro-batch to consider
    :param checkpointing: None: choose as above; True or False: only the micro-batch is chosen
    :param kwargs: more arguments of ``estimate`` (attention, pcie_gb_per_s, min_8bit_size)
    """
    if not isinstance(gpu_memory_bytes, (int, float)) or isinstance(gpu_memory_bytes, bool) or gpu_memory_bytes <= 0:
        raise ValueError(f"gpu_memory_bytes={gpu_memory_bytes!r} is not allowed: expected the GPU's memory in bytes, "
                         f"e.g. 16 * 2**30")
    if not isinstance(headroom, (int, float)) or not 0 < headroom <= 1:
        raise ValueError(f"headroom={headroom!r} is not allowed: expected a fraction in (0, 1], e.g. 0.85")
    _positive_int("max_micro_batch", max_micro_batch)
    _positive_int("min_micro_batch", min_micro_batch)
    budget = int(headroom * gpu_memory_bytes)
    settings = dict(optimizer=optimizer, seq_len=seq_len, offload=offload, precision=precision,
                    shared_groups=shared_groups, **kwargs)
    estimate(model, **settings)  # checks the arguments once, with clear errors

    def at(micro_batch: int, checkpointing: bool, **changes) -> MemoryEstimate:
        return estimate(model, micro_batch=micro_batch, checkpointing=checkpointing, **{**settings, **changes})

    def largest(checkpointing: bool) -> int:
        """The largest micro-batch in [1, max_micro_batch] that fits (memory grows with it), 0 if none."""
        low, high = 0, max_micro_batch
        while low < high:
            middle = (low + high + 1) // 2
            if at(middle, checkpointing).gpu_bytes <= budget:
                low = middle
            else:
                high = middle - 1
        return low

    if checkpointing not in (None, True, False):
        raise ValueError(f"checkpointing={checkpointing!r} is not allowed: expected True, False or None (choose)")
    where = f"{format_bytes(budget)} budget ({headroom:.0%} of {format_bytes(gpu_memory_bytes)})"
    plain = 0 if checkpointing is True else largest(False)
    checkpointed = 0 if checkpointing is False else largest(True)
    if plain and (checkpointing is False or plain >= min(min_micro_batch, checkpointed)):
        chosen = at(plain, False)
        reason = f"micro-batch {plain} without checkpointing: {format_bytes(chosen.gpu_bytes)} of the {where}"
        if any("reversible" in note for note in chosen.notes):
            reason += " (reversible layers already rebuild their activations in backward)"
        elif checkpointing is None and checkpointed > plain:
            reason += f"; checkpointing would allow {checkpointed}, at about a third more compute per sample"
        return Recommendation(plain, False, chosen, True, reason, int(gpu_memory_bytes), budget)
    if checkpointed:
        chosen = at(checkpointed, True)
        reason = f"micro-batch {checkpointed} with gradient checkpointing: {format_bytes(chosen.gpu_bytes)} of the {where}"
        if checkpointing is None:
            reason += f" (without it, only {plain} would fit)" if plain else " (without it, not one sample fits)"
        return Recommendation(checkpointed, True, chosen, True, reason, int(gpu_memory_bytes), budget)

    smallest = at(1, checkpointing is not False)
    current = dict(optimizer=smallest.optimizer, offload=smallest.offload)
    fixes, tried = [], [current]
    for name, changes in (("the 8-bit optimizer (optimizer='8bit')", dict(optimizer="8bit")),
                          ("offloading the optimizer to the CPU (offload=True)", dict(offload=True)),
                          ("the 8-bit optimizer and offloading", dict(optimizer="8bit", offload=True))):
        if {**current, **changes} in tried:
            continue  # already so, or already suggested
        tried.append({**current, **changes})
        option = at(1, smallest.checkpointing, **changes)
        if option.gpu_bytes <= budget:
            fixes.append(f"{name}: {format_bytes(option.gpu_bytes)}")
    advice = ("it would fit with " + "; or ".join(fixes) + ". Otherwise try " if fixes else "try ")
    advice += "a smaller model (preset 'small', a smaller catalogue size), shared layers, or a GPU with more memory"
    how = "with" if smallest.checkpointing else "without"
    reason = (f"does not fit: micro-batch 1 {how} checkpointing needs {format_bytes(smallest.gpu_bytes)} on the GPU, "
              f"more than the {where}; {advice}")
    return Recommendation(1, smallest.checkpointing, smallest, False, reason, int(gpu_memory_bytes), budget)


# ---------------------------------------------------------------------------------------------
# measured bytes, to check the estimate against


def _tensor_bytes(tensors) -> int:
    """Bytes of the distinct tensors (a tensor listed twice, such as bitsandbytes' shared qmap, counts once)."""
    seen, total = set(), 0
    for value in tensors:
        if torch.is_tensor(value):
            key = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(), value.numel(),
                   value.dtype)
            if key not in seen:
                seen.add(key)
                total += value.numel() * value.element_size()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Measured: the bytes of every tensor in ``optimizer.state`` (torch.optim.Adam, bitsandbytes' 8-bit
    optimizers, Adafactor...), each distinct tensor once."""
    return _tensor_bytes(value for state in optimizer.state.values() for value in state.values())


def parameter_bytes(module: torch.nn.Module) -> int:
    """Measured: the bytes of ``module``'s distinct parameters."""
    return _tensor_bytes(module.parameters())


def gradient_bytes(module: torch.nn.Module) -> int:
    """Measured: the bytes of the gradients ``module``'s parameters hold now."""
    return _tensor_bytes(p.grad for p in module.parameters() if p.grad is not None)


# ---------------------------------------------------------------------------------------------
# pictures: a stacked bar chart and the interactive calculator

PART_COLOURS = {"weights": "#4c72b0", "gradients": "#55a868", "optimizer state": "#c44e52",
                "activations": "#dd8452"}


def plot_estimates(estimates: Mapping[str, MemoryEstimate], gpu_memory_bytes: Optional[int] = None, ax=None,
                   title: Optional[str] = None):
    """Stacked bars of what each estimate puts on the GPU (GiB), a line at the GPU's memory; returns the axes.

    Offloaded optimizer state is written above its bar (it is in CPU memory, not in the bar).

    :param estimates: label -> estimate, one bar each (e.g. ``compare(...)``)
    :param gpu_memory_bytes: draw the GPU's memory as a horizontal line
    :param ax: matplotlib axes to draw into (default: a new pyplot figure)
    """
    if not estimates:
        raise ValueError("plot_estimates needs at least one estimate")
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(1.8 * len(estimates) + 3, 4.5))
    labels = list(estimates)
    bottoms = [0.0] * len(labels)
    for part, colour in PART_COLOURS.items():
        heights = [estimates[label].parts()[part] / GiB for label in labels]
        ax.bar(labels, heights, bottom=bottoms, color=colour, label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for index, label in enumerate(labels):
        item = estimates[label]
        text = f"{item.gpu_bytes / GiB:.1f}"
        if item.offload:
            text += f"\n(+{item.cpu_bytes / GiB:.1f} in RAM)"
        ax.annotate(text, (index, bottoms[index]), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    if gpu_memory_bytes:
        ax.axhline(gpu_memory_bytes / GiB, color="black", linestyle="--", linewidth=1,
                   label=f"GPU memory ({gpu_memory_bytes / GiB:.0f} GiB)")
    ax.set_ylabel("GPU memory (GiB)")
    ax.set_ylim(0, max(max(bottoms), (gpu_memory_bytes or 0) / GiB) * 1.2)
    first = next(iter(estimates.values()))
    ax.set_title(title or f"{first.model}, micro-batch {first.micro_batch}"
                 + (f" x {first.seq_len} tokens" if first.seq_len else ""))
    ax.tick_params(axis="x", labelrotation=15, labelsize=8)
    ax.legend(fontsize=8, loc="upper right")
    return ax


def figure_png(estimates: Mapping[str, MemoryEstimate], gpu_memory_bytes: Optional[int] = None, **kwargs) -> bytes:
    """``plot_estimates`` rendered to PNG bytes, without pyplot (for widgets and pages)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(1.8 * len(estimates) + 3, 4.5))
    FigureCanvasAgg(figure)
    plot_estimates(estimates, gpu_memory_bytes, ax=figure.add_subplot(), **kwargs)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80)
    return buffer.getvalue()


class MemoryCalculator:
    """The interactive calculator: dropdowns and sliders, the estimate table, a recommendation and a chart.

    Display it in a notebook (it shows ``panel``); ``estimate`` and ``recommendation`` follow the controls.
    """

    def __init__(self, model: str = "gpt2-large", optimizer: str = "8bit", micro_batch: int = 1,
                 seq_len: Optional[int] = None, checkpointing: bool = True, offload: bool = False,
                 shared_groups: Optional[int] = None, precision: str = "mixed", gpu_memory_gib: float = 16):
        import ipywidgets as widgets

        if model not in known_models():
            raise ValueError(f"unknown model {model!r}: the calculator offers {', '.join(known_models())}")
        self.estimate: Optional[MemoryEstimate] = None
        self.recommendation: Optional[Recommendation] = None
        self.error: Optional[str] = None
        style = {"description_width": "110px"}
        self.model = widgets.Dropdown(options=known_models(), value=model, description="model", style=style)
        self.optimizer = widgets.Dropdown(options=list(OPTIMIZERS), value=optimizer, description="optimizer",
                                          style=style)
        self.precision = widgets.Dropdown(options=["mixed", "fp32", "16bit"], value=_precision(precision),
                                          description="precision", style=style)
        self.micro_batch = widgets.IntSlider(value=micro_batch, min=1, max=64, description="micro-batch", style=style)
        self.seq_len = widgets.IntSlider(value=1, min=1, max=2, description="sequence", style=style)
        self.checkpointing = widgets.Checkbox(value=checkpointing, description="checkpointing")
        self.offload = widgets.Checkbox(value=offload, description="offload to CPU")
        self.shared_groups = widgets.IntSlider(value=shared_groups or 0, min=0, max=2, style=style,
                                               description="shared groups", tooltip="0: no sharing")
        self.gpu_memory_gib = widgets.FloatSlider(value=gpu_memory_gib, min=2, max=80, step=1, style=style,
                                                  description="GPU memory GiB")
        self.text = widgets.HTML()
        self.chart = widgets.Image(format="png")
        self._fit_sliders(seq_len)
        controls = widgets.VBox([self.model, self.optimizer, self.precision, self.micro_batch, self.seq_len,
                                 self.shared_groups, self.gpu_memory_gib,
                                 widgets.HBox([self.checkpointing, self.offload])])
        self.panel = widgets.VBox([widgets.HBox([controls, self.chart]), self.text])
        self.model.observe(self._model_changed, names="value")
        for control in (self.optimizer, self.precision, self.micro_batch, self.seq_len, self.checkpointing,
                        self.offload, self.shared_groups, self.gpu_memory_gib):
            control.observe(lambda change: self.update(), names="value")
        self.update()

    def _fit_sliders(self, seq_len: Optional[int] = None) -> None:
        """Set the sequence and sharing sliders' ranges to the model's."""
        arch, _ = _resolve(self.model.value, None)
        top = arch.max_seq_len or max(arch.seq_len or 1, 2 * (arch.seq_len or 1))
        self.seq_len.max = max(top, 2)
        self.seq_len.value = min(seq_len or arch.seq_len or 1, self.seq_len.max)
        self.seq_len.disabled = arch.fixed_seq_len
        self.shared_groups.disabled = not arch.shareable
        self.shared_groups.max = arch.layers or 1
        if not arch.shareable:
            self.shared_groups.value = 0

    def _model_changed(self, change) -> None:
        self._updating = True
        try:
            self._fit_sliders()
        finally:
            self._updating = False
        self.update()

    def update(self) -> None:
        """Recompute the estimate and the recommendation; redraw the table and the chart."""
        if getattr(self, "_updating", False):
            return
        import html

        settings = dict(optimizer=self.optimizer.value, precision=self.precision.value,
                        seq_len=None if self.seq_len.disabled else self.seq_len.value,
                        shared_groups=self.shared_groups.value or None)
        gpu = int(self.gpu_memory_gib.value * GiB)
        try:
            self.estimate = estimate(self.model.value, micro_batch=self.micro_batch.value,
                                     checkpointing=self.checkpointing.value, offload=self.offload.value, **settings)
            self.recommendation = recommend_settings(self.model.value, gpu, offload=self.offload.value, **settings)
            self.error = None
        except ValueError as e:
            self.error = str(e)
            self.text.value = f"<pre>{html.escape(self.error)}</pre>"
            return
        verdict = "fit" if self.estimate.gpu_bytes <= gpu else "do NOT fit"
        self.text.value = (f"<pre>{html.escape(self.estimate.table())}\n\n"
                           f"These settings {verdict} in {self.gpu_memory_gib.value:.0f} GiB.\n"
                           f"Recommended: {html.escape(self.recommendation.reason)}</pre>")
        others = {k: v for k, v in settings.items() if k != "optimizer"}
        self.chart.value = figure_png({"these settings": self.estimate, **compare(
            self.model.value, micro_batch=self.micro_batch.value, **others)}, gpu)

    def _repr_mimebundle_(self, **kwargs):
        return self.panel._repr_mimebundle_(**kwargs)


def calculator_widget(**settings) -> MemoryCalculator:
    """The interactive memory calculator for a notebook (ipywidgets); see ``MemoryCalculator`` for the settings."""
    return MemoryCalculator(**settings)


def summary(chosen: MemoryEstimate, comparison: Mapping[str, MemoryEstimate], recommendation: Recommendation,
            gpu_memory_bytes: int) -> dict:
    """What the memory calculator notebook found, as JSON-able values (its SUMMARY_PATH file)."""
    return dict(model=chosen.model, gpu_memory_bytes=int(gpu_memory_bytes),
                fits=chosen.gpu_bytes <= gpu_memory_bytes, chosen=chosen.to_dict(),
                comparison={label: item.to_dict() for label, item in comparison.items()},
                recommendation=dict(micro_batch=recommendation.micro_batch,
                                    checkpointing=recommendation.checkpointing, fits=recommendation.fits,
                                    reason=recommendation.reason, gpu_bytes=recommendation.estimate.gpu_bytes))
