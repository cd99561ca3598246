"""Where a peer trains and in what precision: the device, mixed precision that fits the card, and loss scaling.

    plan = choose_device("auto", "auto")            # a T4: cuda, fp16 with loss scaling; an A100: bf16; no GPU: cpu
    model.to(plan.device)
    with plan.autocast():
        loss = model(**plan.move(batch)).loss
    scaler = LossScaler(plan, model.parameters())
    if scaler.backward_and_unscale(loss):           # False: an fp16 overflow, this step is skipped (a normal event)
        optimizer.step()

The choice is a function of the machine's facts (``DeviceFacts``), so every card can be tried on a CPU:

- ``auto`` device: the first CUDA device when torch has one, else the CPU;
- ``auto`` precision: bf16 autocast on cards of compute capability 8.0 and newer (Ampere, Hopper), fp16 autocast with
  dynamic loss scaling below (T4 7.5, V100 7.0, P100 6.0: no bf16), fp32 on the CPU. bf16 and fp16 may be asked for on
  the CPU too (torch's CPU autocast; ``torch.amp.GradScaler("cpu")``), which is how the tests run them.

Parameters stay fp32 (autocast computes matrix products in 16 bits); gradients are unscaled before they reach the
collaborative optimizer, so peers of any precision and any loss scale average the same quantity. Device and
precision are each peer's own choice: never in a join line, never compared with the run's settings.
Shown by tests/model/test_device.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from collab_kit.errors import CollabKitError

DEVICES = ("auto", "cpu", "cuda")  # and "cuda:N"
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BF16_CAPABILITY = (8, 0)  # Ampere and newer compute bf16 on their tensor cores


class DeviceProblem(CollabKitError, ValueError):
    """The device or precision asked for cannot be used here: the message says why and what to choose."""


@dataclass(frozen=True)
class GpuFacts:
    """One CUDA device as torch sees it."""

    name: str
    memory_bytes: int
    capability: tuple[int, int]


@dataclass(frozen=True)
class DeviceFacts:
    """What this machine offers to train on: torch's CUDA build and its devices (``read_device_facts``).

    :param cuda_build: the CUDA version torch was built with (None: a CPU-only build of torch)
    :param gpus: the CUDA devices torch can use
    """

    cuda_build: str | None
    gpus: tuple[GpuFacts, ...] = ()


def read_device_facts() -> DeviceFacts:
    """This machine's facts, from torch."""
    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            gpus.append(GpuFacts(properties.name, int(properties.total_memory), (properties.major, properties.minor)))
    return DeviceFacts(cuda_build=torch.version.cuda, gpus=tuple(gpus))


@dataclass(frozen=True)
class DevicePlan:
    """Where and how a peer trains.

    :param device: the torch device of the model, the batches, the loss and the gradients
    :param precision: "fp32", "bf16" or "fp16" (autocast's dtype; fp16 with dynamic loss scaling)
    :param reason: why this precision, in words
    :param name: the device's name ("Tesla T4", "CPU")
    :param memory_bytes: its memory (None for the CPU: the machine's RAM is the preflight's business)
    """

    device: torch.device
    precision: str
    reason: str
    name: str
    memory_bytes: int | None = None

    @property
    def loss_scaling(self) -> bool:
        """fp16's range is small: its gradients are computed on a scaled loss, then unscaled."""
        return self.precision == "fp16"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return _DTYPES.get(self.precision)

    def autocast(self):
        """The context the forward pass runs in: autocast to the plan's dtype, or nothing for fp32."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def move(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``batch`` on the plan's device: through pinned memory and a non-blocking copy to a GPU, as it is on the
        CPU."""
        if self.device.type == "cpu":
            return batch
        return {key: value.pin_memory().to(self.device, non_blocking=True) for key, value in batch.items()}

    def describe(self) -> str:
        """One line: "Tesla T4 (cuda:0): fp16 with loss scaling (compute capability 7.5 has no bf16)"."""
        how = {"fp32": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast with loss scaling"}[self.precision]
        return f"{self.name} ({self.device}): {how} ({self.reason})"


def _cuda_index(device: str, facts: DeviceFacts) -> int:
    if facts.cuda_build is None:
        raise DeviceProblem(
            f"--device {device}: this PyTorch is a CPU-only build (no CUDA): install a CUDA build "
            f"of torch (pip install torch --index-url https://download.pytorch.org/whl/cu124), or "
            f"use --device cpu"
        )
    if not facts.gpus:
        raise DeviceProblem(
            f"--device {device}: no CUDA GPU is visible on this machine (on Colab: Runtime > Change "
            f"runtime type > T4 GPU), or use --device cpu"
        )
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if not 0 <= index < len(facts.gpus):
        raise DeviceProblem(
            f"--device {device}: this machine has {len(facts.gpus)} GPU(s), cuda:0 to cuda:{len(facts.gpus) - 1}"
        )
    return index


def _precision_for_gpu(gpu: GpuFacts) -> tuple[str, str]:
    major, minor = gpu.capability
    if gpu.capability >= BF16_CAPABILITY:
        return "bf16", f"compute capability {major}.{minor} computes bf16"
    return "fp16", f"compute capability {major}.{minor} has no bf16"


def choose_device(device: str = "auto", precision: str = "auto", facts: DeviceFacts | None = None) -> DevicePlan:
    """The device and precision a peer trains with (see the module's docstring for the rule).

    :param device: "auto", "cpu", "cuda" or "cuda:N"
    :param precision: "auto", "fp32", "bf16" or "fp16"
    :param facts: the machine's facts (default: this machine's, ``read_device_facts``)
    :raises DeviceProblem: a device that is not here (one sentence, with what to choose instead), or an unknown name
    """
    device, precision = str(device).strip().lower(), str(precision).strip().lower()
    if precision not in PRECISIONS:
        raise DeviceProblem(f"--precision {precision}: choose one of {', '.join(PRECISIONS)}")
    if device not in DEVICES and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise DeviceProblem(f"--device {device}: choose auto, cpu, cuda or cuda:N")
    facts = facts if facts is not None else read_device_facts()
    if device == "auto":
        device = "cuda:0" if facts.gpus else "cpu"
    if device == "cpu":
        if precision == "auto":
            return DevicePlan(torch.device("cpu"), "fp32", "no GPU: a CPU trains in fp32", "CPU")
        return DevicePlan(torch.device("cpu"), precision, "asked for (torch's CPU autocast)", "CPU")
    index = _cuda_index(device, facts)
    gpu = facts.gpus[index]
    if precision == "auto":
        precision, reason = _precision_for_gpu(gpu)
    elif precision == "bf16" and gpu.capability < BF16_CAPABILITY:
        raise DeviceProblem(
            f"--precision bf16: the {gpu.name} (compute capability {gpu.capability[0]}."
            f"{gpu.capability[1]}) has no bf16: use --precision fp16 (with loss scaling) or auto"
        )
    else:
        reason = "asked for"
    return DevicePlan(torch.device("cuda", index), precision, reason, gpu.name, gpu.memory_bytes)


def fp32_plan(device) -> DevicePlan:
    """fp32 on ``device`` (a model built and placed by its caller): no autocast, no loss scaling."""
    device = torch.device(device)
    name = (
        "CPU" if device.type == "cpu" else torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    )
    return DevicePlan(device, "fp32", "the model's own device, in fp32", name)


class _GradientsOf(torch.optim.Optimizer):
    """The model's parameters as ``torch.amp.GradScaler`` takes them: an optimizer whose step does nothing (the
    collaborative optimizer steps; the scaler only unscales and checks)."""

    def __init__(self, params: Iterable[torch.nn.Parameter]):
        super().__init__(list(params), dict())

    def step(self, closure=None):
        return True


class LossScaler:
    """Dynamic loss scaling for fp16 (torch's ``GradScaler`` on the plan's device), a pass-through otherwise.

    Each peer keeps its own scale: the loss is scaled before backward and the gradients unscaled right after, so
    what reaches the collaborative optimizer (and the swarm) is the true gradient. A step whose scaled gradients
    overflow is skipped and the scale halved: a normal event of fp16 training, not a fault.

    :param plan: the peer's device plan
    :param parameters: the model's parameters (those whose gradients are unscaled)
    :param init_scale: the first scale (torch's default 2**16)
    """

    def __init__(self, plan: DevicePlan, parameters: Iterable[torch.nn.Parameter], init_scale: float = 2.0**16):
        self.enabled = plan.loss_scaling
        self._gradients = _GradientsOf(parameters)
        self._scaler = torch.amp.GradScaler(plan.device.type, init_scale=init_scale, enabled=self.enabled)
        self.overflows = 0  # steps skipped because their fp16 gradients overflowed

    @property
    def scale(self) -> float:
        return float(self._scaler.get_scale()) if self.enabled else 1.0

    def backward_and_unscale(self, loss: torch.Tensor) -> bool:
        """Backward through the scaled loss and unscale the gradients; returns False when they overflowed (the
        caller skips the step; the scale is already lowered), True when they are the true, finite-scaled gradients.
        Without loss scaling: a plain backward, always True (non-finite values are the caller's to find)."""
        if not self.enabled:
            loss.backward()
            return True
        self._scaler.scale(loss).backward()
        self._scaler.unscale_(self._gradients)
        stepped = self._scaler.step(self._gradients) is not None  # torch skips the step when it found inf or nan
        self._scaler.update()
        if not stepped:
            self.overflows += 1
        return stepped
