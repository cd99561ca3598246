"""Fine-tune GPT-2 with 8-bit Adam and gradient checkpointing, and measure what the optimizer's state costs.

    model = load_gpt2("gpt2-large", device="cuda")            # or load_gpt2(dict(n_layer=2, n_embd=64, ...))
    optimizer = make_adam(model, bits=8, lr=1e-5)
    result = finetune(model, blocks, optimizer, steps=200, micro_batch=4, accumulation=8)
    comparison = compare_optimizer_memory("gpt2-large", sample_batch)   # 32-bit vs 8-bit Adam, measured

Adam keeps two statistics per parameter (the moving averages of the gradient and of its square). In
32 bits that is 8 bytes per parameter: 6.2 GB for GPT-2 Large's 774M parameters, twice the model's
own fp32 weights. bitsandbytes' 8-bit Adam (Dettmers et al., 2022) stores each statistic in one byte,
quantized block-wise: every block of 256 values has its own fp32 scale (its largest magnitude), so
an outlier only costs precision in its own block, and the byte indexes a non-linear (dynamic) code
that keeps small values precise. That is 2 bytes + 8/256 per parameter: about 1.55 GB for GPT-2 Large.
Tensors under 4096 elements (biases, layer norms: a tiny share of the parameters) keep 32-bit state.

Gradient checkpointing keeps only each block's input during the forward pass and recomputes the
block's activations during the backward pass: about a third more compute, a fraction of the memory.
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import time
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from collab_kit import memory
from collab_kit.config import SettingProblem
from collab_kit.model.transformer import count_parameters  # distinct parameters: a tied embedding counts once
from collab_kit.quiet import import_bitsandbytes
from collab_kit.tutorial.text_stream import GPT2_CONTEXT, block_batches
from collab_kit.units import GiB, MiB, format_bytes

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# the model


def _device(device: str | torch.device | None) -> torch.device:
    return torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))


# the model a CPU can fine-tune in minutes: GPT-2's vocabulary and tokenizer, 2 blocks of width 64
CPU_SIZED_GPT2 = dict(n_layer=2, n_embd=64, n_head=2)


def choose_model(model: str = "gpt2-large", tiny_config="auto", block_size: int = GPT2_CONTEXT):
    """What the tutorial trains: ``model`` (a Hub id or folder), or a GPT-2 built from ``tiny_config``.

    :param tiny_config: a dict of GPT2Config fields (build that model from scratch), None (load ``model``), or
        ``"auto"``: ``model`` where a GPU is, else a tiny GPT-2 (``CPU_SIZED_GPT2``) whose context is ``block_size``
    :returns: (what ``load_gpt2`` takes, a sentence saying what was chosen and why)
    """
    if tiny_config == "auto":
        if torch.cuda.is_available():
            return model, f"{model} (a GPU is here)"
        tiny_config = dict(CPU_SIZED_GPT2, n_positions=block_size)
        return tiny_config, (
            f"a tiny GPT-2 from scratch ({tiny_config['n_layer']} blocks of width "
            f"{tiny_config['n_embd']}): no GPU here, and {model} needs one (TINY_CONFIG = None "
            f"loads it anyway)"
        )
    if tiny_config:
        return dict(tiny_config), "a tiny GPT-2 from scratch (TINY_CONFIG)"
    return model, model


def load_gpt2(name_or_config="gpt2-large", gradient_checkpointing: bool = True, device=None, seed: int = 0):
    """GPT-2 with a language-modelling head, pretrained from the Hub or freshly initialized from a config.

    :param name_or_config: a Hub id or local folder (``"gpt2-large"``: 774M parameters, 3.1 GB of fp32
        weights), a ``transformers.GPT2Config``, or a dict of GPT2Config fields (a tiny model for tests:
        ``dict(n_layer=2, n_embd=64, n_head=2, n_positions=64)``)
    :param gradient_checkpointing: recompute each block's activations in the backward pass instead of keeping them
    :param device: where the model goes (default: CUDA when available, else the CPU)
    :param seed: the initialization's seed for a model built from a config
    :returns: a ``GPT2LMHeadModel`` in training mode, fp32 weights, ``use_cache`` off
    """
    # lazy: transformers takes seconds to import; only this needs it
    from transformers import GPT2Config, GPT2LMHeadModel

    if isinstance(name_or_config, (dict, GPT2Config)):
        config = GPT2Config(**name_or_config) if isinstance(name_or_config, dict) else copy.deepcopy(name_or_config)
        with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
            torch.manual_seed(seed)
            model = GPT2LMHeadModel(config)
    elif isinstance(name_or_config, str):
        try:
            model = GPT2LMHeadModel.from_pretrained(name_or_config, dtype=torch.float32)
        except OSError as e:  # no Internet (or HF_HUB_OFFLINE), a wrong id, a folder without weights
            reason = str(e).splitlines()[0][:200]
            raise SettingProblem(
                f"cannot load {name_or_config!r} ({reason}): connect to the Internet (the weights "
                f"download once), give MODEL a local folder, or set TINY_CONFIG to build a tiny "
                f"GPT-2 from scratch"
            ) from None
    else:
        raise TypeError(
            f"name_or_config must be a Hub id, a GPT2Config or a dict of its fields, "
            f"not {type(name_or_config).__name__}"
        )
    # the key/value cache only serves generation; with checkpointing transformers would turn it off with a warning
    model.config.use_cache = False
    # GPT2LMHeadModel's class name names no loss: say which one, rather than have transformers warn and guess
    model.loss_type = "ForCausalLM"
    if gradient_checkpointing:
        # use_reentrant=False: the variant PyTorch recommends (works when the inputs need no gradient)
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model.to(_device(device))


# ---------------------------------------------------------------------------------------------
# the optimizer and the memory of its state


def make_adam(
    model: torch.nn.Module,
    bits: int = 8,
    lr: float = 1e-5,
    betas=(0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """AdamW with 8-bit state (bitsandbytes ``AdamW8bit``) or 32-bit state (``torch.optim.AdamW``).

    Both follow the same update rule; only the way the two moment estimates are stored differs.

    :param model: the model whose parameters are optimized
    :param bits: 8 or 32
    :param lr: learning rate (fine-tuning GPT-2 Large: around 1e-5; a tiny model from scratch: 1e-3)
    :param betas: Adam's decay rates of the first and second moments
    :param eps: Adam's epsilon
    :param weight_decay: decoupled weight decay (AdamW); 0 makes it plain Adam
    """
    parameters = [p for p in model.parameters() if p.requires_grad]
    if bits == 8:
        bnb = import_bitsandbytes()
        return bnb.optim.AdamW8bit(
            parameters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, min_8bit_size=memory.BNB_MIN_8BIT_SIZE
        )
    if bits == 32:
        return torch.optim.AdamW(parameters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    raise ValueError(f"bits={bits} is not supported: choose 8 (bitsandbytes) or 32 (torch)")


def measure_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state``, measured (each storage counted once).

    Includes everything the optimizer keeps: moments, bitsandbytes' quantization maps and block
    scales, step counters. The state exists only after the first ``step()``.
    (``collab_kit.memory.estimator.estimate`` *predicts* these bytes from the model's tensors; this measures them.)
    """
    return memory.optimizer_state_bytes(optimizer)


# ---------------------------------------------------------------------------------------------
# the training loop


@dataclass
class TrainResult:
    """What :func:`finetune` did.

    :param losses: the mean loss of every optimizer step
    :param tokens: tokens trained on
    :param seconds: wall-clock time of the loop
    :param peak_gpu_bytes: ``torch.cuda.max_memory_allocated`` over the loop (None on the CPU)
    :param state_bytes: bytes of the optimizer's state after training (:func:`measure_state_bytes`)
    """

    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    peak_gpu_bytes: int | None = None
    state_bytes: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return dict(
            losses=self.losses,
            tokens=self.tokens,
            seconds=self.seconds,
            tokens_per_second=self.tokens_per_second,
            peak_gpu_bytes=self.peak_gpu_bytes,
            state_bytes=self.state_bytes,
        )

    def mean_loss(self, first: int | None = None, last: int | None = None) -> float:
        """Mean loss of the ``first`` or the ``last`` n steps (single steps are noisy)."""
        window = self.losses[:first] if first is not None else self.losses[-last:] if last else self.losses
        return sum(window) / len(window) if window else float("nan")


def _autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def default_precision(device) -> str:
    """bf16 where the GPU computes in it natively (A100, H100, L4...), fp16 on older GPUs (T4, V100), else fp32."""
    device = _device(device)
    if device.type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"


def finetune(
    model: torch.nn.Module,
    blocks: Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    steps: int,
    micro_batch: int,
    accumulation: int = 1,
    device=None,
    precision: str | None = None,
    max_grad_norm: float | None = 1.0,
    progress: bool = True,
) -> TrainResult:
    """Train ``model`` on packed blocks for ``steps`` optimizer steps of ``micro_batch * accumulation`` blocks.

    Weights stay in fp32; the forward and backward passes run under autocast (mixed precision) on a
    GPU, which halves activation memory and uses the tensor cores. Each step accumulates the
    gradients of ``accumulation`` micro-batches (a larger batch than fits in memory at once), clips
    their norm, and takes one optimizer step.

    :param model: a causal LM that returns ``.loss`` given ``input_ids`` and ``labels`` (:func:`load_gpt2`)
    :param blocks: packed token blocks (:func:`collab_kit.tutorial.text_stream.pack_blocks`); an endless stream is fine
    :param optimizer: from :func:`make_adam`
    :param steps: optimizer steps
    :param micro_batch: blocks per forward / backward pass
    :param accumulation: micro-batches per optimizer step
    :param device: where the batches go (default: the model's device)
    :param precision: "bf16", "fp16" (with loss scaling) or "fp32"; default :func:`default_precision`
    :param max_grad_norm: clip the gradients' global norm to this (None: no clipping)
    :param progress: show a progress bar
    :raises ValueError: if the blocks are longer than the model's context
    :raises RuntimeError: if the blocks run out before ``steps`` steps
    """

    if steps < 1 or accumulation < 1:
        raise ValueError(f"steps={steps} and accumulation={accumulation} must both be at least 1")
    device = next(model.parameters()).device if device is None else _device(device)
    precision = precision or default_precision(device)
    if precision not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"precision={precision!r}: choose 'bf16', 'fp16' or 'fp32'")
    # fp16 overflows without loss scaling; bf16 has fp32's range and needs none
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    context = getattr(getattr(model, "config", None), "n_positions", None)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)

    result = TrainResult()
    batches: Iterator[torch.Tensor] = block_batches(blocks, micro_batch)
    model.train()
    started = time.perf_counter()
    with tqdm(total=steps, desc="fine-tuning", unit="step", disable=not progress, dynamic_ncols=True) as bar:
        for step in range(steps):
            step_loss = 0.0
            for _ in range(accumulation):
                batch = next(batches, None)
                if batch is None:
                    raise RuntimeError(
                        f"the data ran out after {step} of {steps} steps: stream more text "
                        f"(iterate_texts(..., passes=None) repeats it) or lower the steps"
                    )
                if context is not None and batch.shape[1] > context:
                    raise ValueError(
                        f"blocks of {batch.shape[1]} tokens are longer than the model's context "
                        f"(n_positions={context}): lower the block size to at most {context}"
                    )
                batch = batch.to(device, non_blocking=True)
                with _autocast(device, precision):
                    # labels = inputs: the model shifts them itself, so each token predicts the next
                    loss = model(input_ids=batch, labels=batch).loss
                scaler.scale(loss / accumulation).backward()
                step_loss += loss.item() / accumulation
            if max_grad_norm is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if not math.isfinite(step_loss):
                logger.warning(f"step {step}: the loss is {step_loss}")
            result.losses.append(step_loss)
            result.tokens += batch.numel() * accumulation
            bar.set_postfix(loss=f"{step_loss:.3f}")
            bar.update(1)
    if on_gpu:
        torch.cuda.synchronize(device)
        result.peak_gpu_bytes = torch.cuda.max_memory_allocated(device)
    result.seconds = time.perf_counter() - started
    result.state_bytes = measure_state_bytes(optimizer)
    logger.info(
        f"{steps} steps, {result.tokens} tokens in {result.seconds:.1f} s: loss "
        f"{result.losses[0]:.3f} -> {result.losses[-1]:.3f}"
    )
    return result


# ---------------------------------------------------------------------------------------------
# 32-bit against 8-bit Adam, measured


@dataclass
class OptimizerMemory:
    """One optimizer's measured memory (a row of :func:`compare_optimizer_memory`).

    :param bits: 8 or 32
    :param parameters: the model's parameters
    :param state_bytes: bytes of the optimizer's state after one step (None if the step ran out of memory)
    :param peak_gpu_bytes: the most GPU memory allocated while building the model and taking the step,
        above what was allocated before (None on the CPU)
    :param error: why the measurement failed ("out of memory"), or None
    :param estimated_state_bytes: what ``collab_kit.memory.estimator.estimate`` predicts for the state, from the model
      alone
    :param estimated_peak_bytes: what it predicts for the step's peak (weights, gradients, state, activations)
    """

    bits: int
    parameters: int
    state_bytes: int | None = None
    peak_gpu_bytes: int | None = None
    error: str | None = None
    estimated_state_bytes: int | None = None
    estimated_peak_bytes: int | None = None

    @property
    def state_bytes_per_parameter(self) -> float | None:
        return None if self.state_bytes is None else self.state_bytes / self.parameters


def compare_optimizer_memory(
    name_or_config,
    batch: torch.Tensor,
    bits=(32, 8),
    lr: float = 1e-5,
    gradient_checkpointing: bool = True,
    device=None,
    precision: str | None = None,
) -> list[OptimizerMemory]:
    """Build the model once per optimizer, take one training step on ``batch``, measure the optimizer's memory.

    Each model is freed before the next is built, so on a GPU the peaks do not add up; a run that
    does not fit (32-bit Adam for GPT-2 Large on a 16 GB GPU) is reported as "out of memory"
    rather than raised.

    :param name_or_config: what :func:`load_gpt2` takes (the same initialization for every optimizer)
    :param batch: one micro-batch of blocks, LongTensor [micro_batch, block_size]
    :param bits: the optimizers to compare, as :func:`make_adam`'s ``bits``
    :param lr: their learning rate (one step: it hardly matters)
    :param gradient_checkpointing: as in training, so the GPU peaks are the ones training would see
    :param device: where to measure (default: CUDA when available)
    :param precision: as :func:`finetune`'s
    :returns: one :class:`OptimizerMemory` per entry of ``bits``
    """
    device = _device(device)
    on_gpu = device.type == "cuda"
    rows = []
    for n_bits in bits:
        model = optimizer = None
        if on_gpu:
            torch.cuda.synchronize(device)
            baseline = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        try:
            model = load_gpt2(name_or_config, gradient_checkpointing=gradient_checkpointing, device=device)
            # the prediction comes first, from the model's tensors alone, before anything is measured
            # fp32 training keeps fp32 activations; bf16 / fp16 autocast is memory's "mixed"
            used = precision or default_precision(device)
            predicted = memory.estimate(
                model,
                optimizer=f"{n_bits}bit",
                checkpointing=gradient_checkpointing,
                micro_batch=batch.shape[0],
                seq_len=batch.shape[1],
                precision="fp32" if used == "fp32" else "mixed",
            )
            row = OptimizerMemory(
                bits=n_bits,
                parameters=count_parameters(model),
                estimated_state_bytes=predicted.optimizer_bytes,
                estimated_peak_bytes=predicted.gpu_bytes,
            )
            optimizer = make_adam(model, bits=n_bits, lr=lr)
            finetune(
                model,
                [*batch],
                optimizer,
                steps=1,
                micro_batch=batch.shape[0],
                device=device,
                precision=precision,
                progress=False,
            )
            row.state_bytes = measure_state_bytes(optimizer)
            if on_gpu:
                row.peak_gpu_bytes = torch.cuda.max_memory_allocated(device) - baseline
        except torch.cuda.OutOfMemoryError:
            row = OptimizerMemory(
                bits=n_bits, parameters=count_parameters(model) if model is not None else 0, error="out of memory"
            )
            logger.warning(f"{n_bits}-bit Adam does not fit in this GPU's memory")
        finally:
            del model, optimizer
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
        rows.append(row)
    return rows


def finetune_summary(
    result: TrainResult,
    comparison: list[OptimizerMemory],
    model: torch.nn.Module,
    model_name: str,
    optimizer_bits: int,
    **settings,
) -> dict:
    """What the tutorial reports, as JSON-ready data: the training's figures and the optimizers' measured memory.

    :param result: from :func:`finetune`
    :param comparison: from :func:`compare_optimizer_memory` (may be empty)
    :param model: the trained model (its parameter count and device)
    :param model_name: how to call the model in the report
    :param optimizer_bits: the trained optimizer's bits
    :param settings: more fields to record as they are (block size, micro-batch, ...)
    """
    measured = {row.bits: row for row in comparison}
    return dict(
        model=model_name,
        parameters=count_parameters(model),
        device=str(next(model.parameters()).device),
        optimizer_bits=optimizer_bits,
        steps=len(result.losses),
        first_loss=result.losses[0] if result.losses else None,
        last_loss=result.losses[-1] if result.losses else None,
        **result.to_dict(),
        **settings,
        state_bytes_32=measured[32].state_bytes if 32 in measured else None,
        state_bytes_8=measured[8].state_bytes if 8 in measured else None,
        optimizer_memory=[
            dict(
                bits=row.bits,
                parameters=row.parameters,
                state_bytes=row.state_bytes,
                peak_gpu_bytes=row.peak_gpu_bytes,
                error=row.error,
                estimated_state_bytes=row.estimated_state_bytes,
                estimated_peak_bytes=row.estimated_peak_bytes,
            )
            for row in comparison
        ],
    )


def _bytes_cell(value: int | None) -> str:
    """A table cell: ``collab_kit.units.format_bytes``, or ``-`` for None (a measurement that did not run)."""
    return "-" if value is None else format_bytes(value)


def memory_table(rows: list[OptimizerMemory]) -> str:
    """The comparison as a text table: state bytes (total and per parameter) and GPU peak of each optimizer."""
    lines = [
        f"{'optimizer':<14}{'parameters':>14}{'state':>14}{'estimated':>14}{'bytes/param':>13}"
        f"{'GPU peak':>14}{'estimated':>14}"
    ]
    for row in rows:
        per_parameter = row.state_bytes_per_parameter
        lines.append(
            f"{f'{row.bits}-bit Adam':<14}{row.parameters:>14,}{_bytes_cell(row.state_bytes):>14}"
            f"{_bytes_cell(row.estimated_state_bytes):>14}"
            f"{'-' if per_parameter is None else f'{per_parameter:.3f}':>13}"
            f"{row.error or _bytes_cell(row.peak_gpu_bytes):>14}{_bytes_cell(row.estimated_peak_bytes):>14}"
        )
    measured = {row.bits: row.state_bytes for row in rows if row.state_bytes}
    if 8 in measured and 32 in measured:
        lines.append(f"8-bit state / 32-bit state = {measured[8] / measured[32]:.3f}")
    return "\n".join(lines)


def plot_memory_comparison(rows: list[OptimizerMemory], ax=None):
    """A bar chart of the optimizers' state bytes (and GPU peaks, where measured); returns the axes."""
    # lazy: matplotlib takes a second to import; only a plot needs it
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"{row.bits}-bit Adam" for row in rows]
    series = [("optimizer state", [row.state_bytes for row in rows])]
    if any(row.peak_gpu_bytes is not None for row in rows):
        series.append(("GPU peak (one step)", [row.peak_gpu_bytes for row in rows]))
    largest = max([value for _, values in series for value in values if value] or [1])
    # binary units, as format_bytes writes the labels on the bars (a tiny model's state is a few MiB)
    unit, size = ("GiB", GiB) if largest >= GiB else ("MiB", MiB)
    width = 0.8 / len(series)
    for index, (name, values) in enumerate(series):
        positions = [i + (index - (len(series) - 1) / 2) * width for i in range(len(rows))]
        bars = ax.bar(positions, [(value or 0) / size for value in values], width, label=name)
        for bar, value, row in zip(bars, values, rows):
            ax.annotate(
                row.error or "n/a" if value is None else _bytes_cell(value),
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title("Adam's memory: 32-bit vs 8-bit state")
    ax.legend()
    return ax


def plot_losses(losses: list[float], ax=None, smooth: int = 0):
    """The training loss per step (and its running mean over ``smooth`` steps when > 1); returns the axes."""
    # lazy: matplotlib takes a second to import; only a plot needs it
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, alpha=0.5 if smooth > 1 else 1.0, label="loss")
    if smooth > 1 and len(losses) >= 2 * smooth:
        means = [sum(losses[i - smooth : i]) / smooth for i in range(smooth, len(losses) + 1)]
        ax.plot(range(smooth, len(losses) + 1), means, label=f"mean of {smooth} steps")
        ax.legend()
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title("fine-tuning loss")
    return ax
