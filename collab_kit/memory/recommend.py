"""Settings for a GPU: the largest micro-batch that fits, with or without gradient checkpointing, and why.

``recommend_settings`` tries the estimate (collab_kit.memory.estimator) at growing micro-batches and says what it
chose, what it left out and, when nothing fits, which setting would make it fit. ``fit_to_device`` applies it to a
peer's device plan: the preflight and ``Volunteer.from_config`` decide the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from collab_kit.memory.estimator import MemoryEstimate, check_positive_int, estimate
from collab_kit.model.device import DeviceFacts, DevicePlan, choose_device
from collab_kit.units import format_bytes

# without checkpointing, a micro-batch this large keeps a GPU busy: recommend_settings prefers it to a larger
# micro-batch with checkpointing, which costs a second forward pass (about a third more compute per sample)
MIN_MICRO_BATCH_WITHOUT_CHECKPOINTING = 4

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


def recommend_settings(
    model,
    gpu_memory_bytes: int,
    *,
    optimizer: str = "8bit",
    seq_len: int | None = None,
    headroom: float = 0.85,
    max_micro_batch: int = 64,
    offload: bool | None = None,
    precision: str = "mixed",
    shared_groups: int | None = None,
    checkpointing: bool | None = None,
    min_micro_batch: int = MIN_MICRO_BATCH_WITHOUT_CHECKPOINTING,
    **kwargs,
) -> Recommendation:
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
        raise ValueError(
            f"gpu_memory_bytes={gpu_memory_bytes!r} is not allowed: expected the GPU's memory in bytes, e.g. 16 * 2**30"
        )
    if not isinstance(headroom, (int, float)) or not 0 < headroom <= 1:
        raise ValueError(f"headroom={headroom!r} is not allowed: expected a fraction in (0, 1], e.g. 0.85")
    check_positive_int("max_micro_batch", max_micro_batch)
    check_positive_int("min_micro_batch", min_micro_batch)
    budget = int(headroom * gpu_memory_bytes)
    settings = dict(
        optimizer=optimizer,
        seq_len=seq_len,
        offload=offload,
        precision=precision,
        shared_groups=shared_groups,
        **kwargs,
    )
    estimate(model, **settings)  # checks the arguments once, with clear errors

    def at(micro_batch: int, checkpointing: bool, **changes) -> MemoryEstimate:
        return estimate(model, micro_batch=micro_batch, checkpointing=checkpointing, **{**settings, **changes})

    if checkpointing not in (None, True, False):
        raise ValueError(f"checkpointing={checkpointing!r} is not allowed: expected True, False or None (choose)")
    where = f"{format_bytes(budget)} budget ({headroom:.0%} of {format_bytes(gpu_memory_bytes)})"
    plain = 0 if checkpointing is True else _largest_that_fits(at, False, budget, max_micro_batch)
    checkpointed = 0 if checkpointing is False else _largest_that_fits(at, True, budget, max_micro_batch)
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
        reason = (
            f"micro-batch {checkpointed} with gradient checkpointing: {format_bytes(chosen.gpu_bytes)} of the {where}"
        )
        if checkpointing is None:
            reason += f" (without it, only {plain} would fit)" if plain else " (without it, not one sample fits)"
        return Recommendation(checkpointed, True, chosen, True, reason, int(gpu_memory_bytes), budget)

    smallest = at(1, checkpointing is not False)
    how = "with" if smallest.checkpointing else "without"
    reason = (
        f"does not fit: micro-batch 1 {how} checkpointing needs {format_bytes(smallest.gpu_bytes)} on the GPU, "
        f"more than the {where}; {_what_would_fit(at, smallest, budget)}"
    )
    return Recommendation(1, smallest.checkpointing, smallest, False, reason, int(gpu_memory_bytes), budget)


def _largest_that_fits(
    at: Callable[..., MemoryEstimate], checkpointing: bool, budget: int, max_micro_batch: int
) -> int:
    """The largest micro-batch in [1, max_micro_batch] whose estimate ``at(micro_batch, checkpointing)`` fits the
    budget (memory grows with it: a binary search), 0 if none."""
    low, high = 0, max_micro_batch
    while low < high:
        middle = (low + high + 1) // 2
        if at(middle, checkpointing).gpu_bytes <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def _what_would_fit(at: Callable[..., MemoryEstimate], smallest: MemoryEstimate, budget: int) -> str:
    """Advice for a model of which not one sample fits: the changes of optimizer and offloading that would fit, each
    with what it takes, then what else to try."""
    current = dict(optimizer=smallest.optimizer, offload=smallest.offload)
    fixes, tried = [], [current]
    for name, changes in (
        ("the 8-bit optimizer (optimizer='8bit')", dict(optimizer="8bit")),
        ("offloading the optimizer to the CPU (offload=True)", dict(offload=True)),
        ("the 8-bit optimizer and offloading", dict(optimizer="8bit", offload=True)),
    ):
        if {**current, **changes} in tried:
            continue  # already so, or already suggested
        tried.append({**current, **changes})
        option = at(1, smallest.checkpointing, **changes)
        if option.gpu_bytes <= budget:
            fixes.append(f"{name}: {format_bytes(option.gpu_bytes)}")
    advice = "it would fit with " + "; or ".join(fixes) + ". Otherwise try " if fixes else "try "
    return advice + (
        "a smaller model (preset 'small', a smaller catalogue size), shared layers, or a GPU with more memory"
    )


# ---------------------------------------------------------------------------------------------
# a peer's device and the settings that fit it


@dataclass
class DeviceFit:
    """Where a peer trains and what fits there (``fit_to_device``).

    :param plan: the device plan to train with (the CPU's when the GPU cannot hold the model)
    :param recommendation: the micro-batch and checkpointing for that device
    :param note: why the plan differs from the one asked for, in one sentence (None: it does not)
    """

    plan: DevicePlan
    recommendation: Recommendation
    note: str | None = None

    def apply(self, config):
        """``config`` (a RunConfig) with the micro-batch and reversible layers chosen for a GPU. On the CPU the
        preset's micro-batch stays (a CPU computes a large one no faster), and its reversible layers are turned off
        when the RAM holds that micro-batch's activations without them: they rebuild each layer in backward, a step
        of the toy preset's 16 samples took 1.0 s with them and 0.7 s without on one core. Otherwise ``config`` is
        returned as it is (tests/memory/test_memory.py::test_a_cpu_with_ram_to_spare_trains_without_reversible_layers).
        """
        if self.plan.device.type == "cpu":
            recommendation = self.recommendation
            if (
                not config.model.reversible
                or not recommendation.fits
                or recommendation.checkpointing
                or recommendation.micro_batch < config.optimizer.batch_size_per_step
            ):
                return config
            return dataclasses.replace(config, model=dataclasses.replace(config.model, reversible=False))
        return dataclasses.replace(
            config,
            model=dataclasses.replace(config.model, reversible=bool(self.recommendation.checkpointing)),
            optimizer=dataclasses.replace(config.optimizer, batch_size_per_step=int(self.recommendation.micro_batch)),
        )


def recommend_for_plan(config, plan: DevicePlan, ram_available_bytes: int) -> Recommendation:
    """The micro-batch and checkpointing for ``plan``'s device: the GPU's memory, or the RAM free now.

    The kit's checkpointing is its reversible layers, so the choice is made for the model with plain layers: with
    checkpointing means reversible layers (which keep fewer activations than checkpointing counts), without means plain
    ones; estimated with reversible layers, every choice would read "without checkpointing". Shown by
    tests/memory/test_memory.py::test_a_cpu_with_ram_to_spare_trains_without_reversible_layers."""
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, reversible=False))
    on_gpu = plan.device.type == "cuda"
    budget = plan.memory_bytes if on_gpu else ram_available_bytes
    # a GPU computes a larger micro-batch in about the time of a small one, so it takes the largest that fits;
    # a CPU does not, so there the preset's micro-batch is kept unless memory is short
    largest = 64 if on_gpu else config.optimizer.batch_size_per_step
    return recommend_settings(
        config,
        budget,
        optimizer="8bit",
        max_micro_batch=largest,
        offload=config.optimizer.offload_optimizer,
        precision="fp32" if plan.precision == "fp32" else "mixed",
    )


def fit_to_device(
    config, plan: DevicePlan, facts: DeviceFacts, ram_available_bytes: int, device_asked: str = "auto"
) -> DeviceFit:
    """``plan`` with the settings that fit its device; a GPU that "auto" chose and that cannot hold one sample of the
    model (with checkpointing) is given up for the CPU, and the note says so. A GPU asked for by name is kept: the
    caller asked, and the out-of-memory error will say the rest (tests/memory/test_memory.py::
    test_a_device_plan_takes_what_fits_its_gpu_and_gives_up_one_too_small)."""
    recommendation = recommend_for_plan(config, plan, ram_available_bytes)
    if plan.device.type == "cuda" and not recommendation.fits and str(device_asked).strip().lower() == "auto":
        note = (
            f"the {plan.name}'s {format_bytes(plan.memory_bytes)} cannot hold this model "
            f"({recommendation.reason}): training on the CPU"
        )
        cpu = dataclasses.replace(choose_device("cpu", "auto", facts), reason="the GPU cannot hold the model")
        return DeviceFit(cpu, recommend_for_plan(config, cpu, ram_available_bytes), note)
    return DeviceFit(plan, recommendation)
