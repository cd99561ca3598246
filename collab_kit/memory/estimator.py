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

The byte counts of weights, gradients and optimizer state are exact: ``tests/memory/test_memory.py`` checks
them against the bytes torch and bitsandbytes allocate after a real step. Activations are an
estimate from a per-layer formula, checked against what a CPU training step of GPT-2 small, medium and
large keeps (``benchmarks/memory_estimates.py``); ``benchmarks/memory_gpu.py`` measures a GPU's peak.

Measured counterparts: ``parameter_bytes``, ``gradient_bytes``, ``optimizer_state_bytes``.

Recommended settings for a GPU are in collab_kit.memory.recommend; the chart and the notebook's calculator in
collab_kit.memory.widgets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from collab_kit.memory.architecture import Architecture, numel, resolve_model
from collab_kit.memory.catalogue import FEED_FORWARD_TENSORS
from collab_kit.units import format_bytes

OPTIMIZERS = ("32bit", "16bit", "8bit", "factorized")
OPTIMIZER_NAMES = {
    "32bit": "32-bit Adam",
    "16bit": "16-bit Adam",
    "8bit": "8-bit Adam",
    "factorized": "factorized (Adafactor)",
}
PRECISIONS = ("mixed", "fp32", "16bit", "bf16", "fp16")  # bf16 and fp16 are names for "16bit"
ATTENTIONS = ("sdpa", "eager")

# bitsandbytes 0.50.2, optim/optimizer.py, Optimizer2State.init_state: tensors with fewer elements than
# min_8bit_size keep fp32 statistics; larger ones get uint8 statistics, one fp32 absmax per block of 256
# elements for each statistic, and a 256-value fp32 quantization map for each (shared by all tensors)
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCKSIZE = 256
BNB_QMAP_VALUES = 256

# a PCIe 3.0 x16 link moves about 12 GB/s in practice (16 GB/s on paper); PCIe 4.0 about twice that
DEFAULT_PCIE_GB_PER_S = 12.0

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
    seq_len: int | None
    checkpointing: bool
    offload: bool
    shared_groups: int | None
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
    notes: tuple[str, ...] = ()
    # local-update mode (collab_kit.swarm.local_updates): the optimizer state above is the inner optimizer's, kept
    # beside the model; the CPU holds the swarm's last global parameters and the outer momentum (outer_bytes) and the
    # pseudo-gradient buffer
    local_updates: bool = False
    outer_bytes: int = 0
    cpu_extras: tuple[str, ...] = ()  # the buffers of the mode's options on the CPU besides (4 bytes a parameter each)

    def parts(self) -> dict[str, int]:
        """What the GPU holds, part by part (the optimizer state is 0 when offloaded): the bars of a chart."""
        return {
            "weights": self.weights_bytes,
            "gradients": self.gradients_bytes,
            "optimizer state": 0 if self.offload and not self.local_updates else self.optimizer_bytes,
            "activations": self.activations_bytes,
        }

    def describe(self) -> str:
        """One line: the model and the settings."""
        tokens = f" x {self.seq_len} tokens" if self.seq_len else ""
        tricks = [
            name
            for name, on in (
                ("checkpointing", self.checkpointing),
                ("offload", self.offload),
                ("local updates", self.local_updates),
            )
            if on
        ]
        if self.shared_groups:
            tricks.append(f"{self.shared_groups} shared layer groups")
        return (
            f"{self.model}: {OPTIMIZER_NAMES[self.optimizer]}, {self.precision} precision, "
            f"micro-batch {self.micro_batch}{tokens}" + (", " + ", ".join(tricks) if tricks else "")
        )

    def table(self) -> str:
        """The estimate as a small table in GiB (MiB or KiB for small models)."""
        where_state = "CPU" if self.offload and not self.local_updates else "GPU"
        count = f"{self.parameters / 1e6:,.1f} M" if self.parameters >= 1e5 else f"{self.parameters:,}"
        rows = [
            ("parameters", count, ""),
            ("weights", format_bytes(self.weights_bytes), "GPU"),
            ("gradients", format_bytes(self.gradients_bytes), "GPU"),
            ("optimizer state", format_bytes(self.optimizer_bytes), where_state),
            ("activations", format_bytes(self.activations_bytes), "GPU"),
            ("total on the GPU", format_bytes(self.gpu_bytes), ""),
        ]
        if self.local_updates:
            rows += [
                (
                    "in CPU memory",
                    format_bytes(self.cpu_bytes),
                    ", ".join(("fp32 global weights, outer momentum, pseudo-gradient",) + self.cpu_extras),
                ),
                ("PCIe per round", format_bytes(self.transfer_bytes), f"{self.transfer_seconds:.2f} s"),
            ]
        elif self.offload:
            rows += [
                ("in CPU memory", format_bytes(self.cpu_bytes), "state + fp32 master weights and gradients"),
                ("PCIe per step", format_bytes(self.transfer_bytes), f"{self.transfer_seconds:.2f} s"),
            ]
        width = max(len(name) for name, _, _ in rows)
        lines = [self.describe()] + [
            f"  {name.ljust(width)}  {value:>12}  {where}".rstrip() for name, value, where in rows
        ]
        return "\n".join(lines + [f"  note: {note}" for note in self.notes])

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        values = dataclasses.asdict(self)
        values["notes"] = list(self.notes)
        return values


def check_positive_int(name: str, value, what: str = "a positive integer") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed: expected {what}")


def normalize_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not allowed: choose one of {', '.join(PRECISIONS)}")
    return "16bit" if precision in ("bf16", "fp16") else precision


def optimizer_bytes_for(
    shapes: Sequence[tuple[int, ...]], optimizer: str, min_8bit_size: int = BNB_MIN_8BIT_SIZE
) -> int:
    """Bytes of the state ``optimizer`` keeps for parameter tensors of these shapes (see ``estimate``)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not allowed: choose one of {', '.join(OPTIMIZERS)}")
    total, any_8bit = 0, False
    for shape in shapes:
        n = numel(shape)
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
                rows, columns = numel(shape[:-1]), numel(shape[:-2]) * shape[-1]
                total += 4 * (rows + columns) + 4
            else:
                total += 4 * n + 4
    if any_8bit:  # the signed and unsigned quantization maps, one tensor each shared by every parameter
        total += 2 * BNB_QMAP_VALUES * 4
    return total


def _activation_bytes(
    arch: Architecture, micro_batch: int, seq_len: int, checkpointing: bool, precision: str, attention: str
) -> tuple[int, int]:
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
        copies = 2 * sum(numel(shape) for shape, _ in arch.tensors if len(shape) >= 2)
    return stored + ends + copies, copies


def estimate(
    model,
    *,
    optimizer: str = "32bit",
    offload: bool | None = None,
    checkpointing: bool = True,
    shared_groups: int | None = None,
    micro_batch: int = 1,
    seq_len: int | None = None,
    precision: str = "mixed",
    attention: str = "sdpa",
    min_8bit_size: int | None = None,
    pcie_gb_per_s: float = DEFAULT_PCIE_GB_PER_S,
    local_updates: bool | None = None,
) -> MemoryEstimate:
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
    :param local_updates: the local-update mode (DiLoCo, collab_kit.swarm.local_updates): ``optimizer`` is the inner
      optimizer, which steps the model's own weights where they are (its state counts on the GPU even with
      ``offload``); the CPU holds an fp32 copy of the swarm's last global weights, the outer optimizer's fp32
      Nesterov momentum (``outer_bytes``) and an fp32 pseudo-gradient buffer; once a round, the weights go to the
      CPU and the new global ones come back (``transfer_bytes``). Default: False, or the RunConfig's
      ``optimizer.local_updates``.

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
    precision = _check_options(optimizer, precision, attention, micro_batch, seq_len, pcie_gb_per_s, offload)
    arch, defaults = resolve_model(model, shared_groups)
    if min_8bit_size is None:
        min_8bit_size = defaults.get("min_8bit_size", BNB_MIN_8BIT_SIZE)
    check_positive_int("min_8bit_size", min_8bit_size)
    if offload is None:
        offload = defaults.get("offload", False)
    if local_updates is None:
        local_updates = defaults.get("local_updates", False)
    if not isinstance(local_updates, bool):
        raise ValueError(f"local_updates={local_updates!r} is not allowed: expected True, False or None")
    return _estimate(
        arch,
        optimizer=optimizer,
        offload=offload,
        checkpointing=bool(checkpointing),
        shared_groups=shared_groups,
        micro_batch=micro_batch,
        seq_len=seq_len,
        precision=precision,
        attention=attention,
        min_8bit_size=min_8bit_size,
        pcie_gb_per_s=pcie_gb_per_s,
        local_updates=local_updates,
        overlap_rounds=local_updates and defaults.get("overlap_rounds", False),
        error_feedback=local_updates and defaults.get("error_feedback", False),
    )


def _check_options(optimizer, precision, attention, micro_batch, seq_len, pcie_gb_per_s, offload) -> str:
    """``estimate``'s options checked, each error naming the option and what it takes; returns the precision's
    canonical name."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not allowed: choose one of {', '.join(OPTIMIZERS)}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r} is not allowed: choose one of {', '.join(ATTENTIONS)}")
    check_positive_int("micro_batch", micro_batch)
    if seq_len is not None:
        check_positive_int("seq_len", seq_len, "a positive number of tokens, or None for the model's own")
    if not isinstance(pcie_gb_per_s, (int, float)) or isinstance(pcie_gb_per_s, bool) or not pcie_gb_per_s > 0:
        raise ValueError(f"pcie_gb_per_s={pcie_gb_per_s!r} is not allowed: expected a positive number of GB/s")
    if offload is not None and not isinstance(offload, bool):
        raise ValueError(f"offload={offload!r} is not allowed: expected True, False or None")
    return normalize_precision(precision)


def _estimate(
    arch: Architecture,
    *,
    optimizer,
    offload,
    checkpointing,
    shared_groups,
    micro_batch,
    seq_len,
    precision,
    attention,
    min_8bit_size,
    pcie_gb_per_s,
    local_updates=False,
    overlap_rounds=False,
    error_feedback=False,
) -> MemoryEstimate:
    notes: list[str] = []
    if seq_len is None:
        seq_len = arch.seq_len
    elif arch.fixed_seq_len and seq_len != arch.seq_len:
        raise ValueError(
            f"seq_len={seq_len} is not allowed for {arch.label}: its samples are always "
            f"{arch.seq_len} tokens (caption and image codes); pass seq_len=None"
        )
    elif arch.max_seq_len is not None and seq_len > arch.max_seq_len:
        raise ValueError(
            f"seq_len={seq_len} is not allowed: {arch.label} learns {arch.max_seq_len} positions, "
            f"so its sequences have at most {arch.max_seq_len} tokens"
        )
    shapes = [shape for shape, _ in arch.tensors]
    trainable = sum(numel(shape) for shape in shapes)
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
    cpu = transfer = outer = 0
    extras = []
    if local_updates:
        # hivemind's offloaded copy holds the global weights (always on the CPU in this mode), beside the outer
        # optimizer's momentum and the pseudo-gradient buffer; the inner optimizer's state stays with the model
        outer = 4 * trainable + 4 * trainable  # fp32 global weights, fp32 Nesterov momentum
        cpu = outer + 4 * trainable  # + the fp32 pseudo-gradient buffer
        # + the model's parameters when the round in flight was sent (the progress since is kept), and what 4-bit
        # rounding dropped from the last pseudo-gradient (collab_kit.swarm.four_bit)
        extras = [
            name for name, used in (("parameters sent", overlap_rounds), ("error feedback", error_feedback)) if used
        ]
        cpu += 4 * trainable * len(extras)
        transfer = per_parameter * trainable + per_parameter * trainable  # local weights out, global weights back
    elif offload:
        cpu = state + 4 * trainable + 4 * trainable  # state, fp32 master weights, fp32 gradient buffer
        transfer = gradients + per_parameter * trainable  # gradients out, updated weights back
    gpu = weights + gradients + (state if local_updates or not offload else 0) + activations
    return MemoryEstimate(
        model=arch.label,
        optimizer=optimizer,
        precision=precision,
        micro_batch=micro_batch,
        seq_len=seq_len,
        checkpointing=checkpointing,
        offload=offload,
        shared_groups=shared_groups,
        parameters=parameters,
        trainable_parameters=trainable,
        weights_bytes=weights,
        gradients_bytes=gradients,
        optimizer_bytes=state,
        activations_bytes=activations,
        weight_copies_bytes=copies,
        gpu_bytes=gpu,
        cpu_bytes=cpu,
        transfer_bytes=transfer,
        transfer_seconds=transfer / (pcie_gb_per_s * 1e9),
        notes=tuple(notes),
        local_updates=local_updates,
        outer_bytes=outer,
        cpu_extras=tuple(extras),
    )


def compare(
    model,
    *,
    micro_batch: int = 1,
    seq_len: int | None = None,
    shared_groups: int | None = None,
    precision: str = "mixed",
    **kwargs,
) -> dict[str, MemoryEstimate]:
    """The paper's tricks one after the other: 32-bit Adam, 8-bit, + checkpointing, + offloading.

    :param kwargs: more arguments of ``estimate`` (attention, pcie_gb_per_s, min_8bit_size)
    """
    common = dict(micro_batch=micro_batch, seq_len=seq_len, shared_groups=shared_groups, precision=precision, **kwargs)
    return {
        "32-bit Adam": estimate(model, optimizer="32bit", checkpointing=False, offload=False, **common),
        "8-bit Adam": estimate(model, optimizer="8bit", checkpointing=False, offload=False, **common),
        "8-bit + checkpointing": estimate(model, optimizer="8bit", checkpointing=True, offload=False, **common),
        "8-bit + checkpointing + offload": estimate(
            model, optimizer="8bit", checkpointing=True, offload=True, **common
        ),
    }
