"""Robust gradient aggregation: CenteredClip instead of the mean when peers average their gradients.

With the plain mean one peer sending its gradients times -1000 turns every step into gradient ascent. CenteredClip
(Karimireddy, He, Jaggi 2020) repeats ``v <- v + sum_i w_i (x_i - v) min(1, tau / ||x_i - v||) / sum_i w_i``, so a
far vector pulls ``v`` by at most ``tau`` times its share of the weight. ``CenteredClipReducer`` is hivemind 1.1.12's
``TensorPartReducer`` with CenteredClip in place of the weighted mean, part by part.

Choices:
- Start at the weighted coordinate-wise median (inside the honest cluster), then 30 iterations by default.
- Radius: ``clip_tau`` times the median distance from the start, so one setting fits every tensor and scale.
- Weights: no sender counts for more than the group's median sender (``cap_weights``), so a busy attacker cannot
  hold half of the weight.
- Groups of at least 3 (MIN_GROUP_SIZE): in a group of 2 an attacker holds half of the weight.

Limits: honest peers must hold more than half of the weight; state averaging is still the plain mean; reported
weights and reducers are trusted (authentication decides who joins); a part with a NaN or an infinity gets no weight.
Shown by tests/swarm/test_robust.py::test_hivemind_allreduce_with_centered_clip_resists_one_peer_times_1000.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import TensorPartReducer
from hivemind.optim.grad_averager import GradientAverager

from collab_kit.swarm.averagers import compose_averager
from collab_kit.swarm.runners import RunnerChoiceMixin, StandInAllReduceRunner

logger = logging.getLogger(__name__)

AGGREGATIONS = ("mean", "centered_clip")
MIN_GROUP_SIZE = 3  # the smallest averaging group in which one attacker can be outweighed


# ---------------------------------------------------------------------------------------------
# the pure functions


def _check_vectors_and_weights(vectors: torch.Tensor, weights: torch.Tensor) -> None:
    if not isinstance(vectors, torch.Tensor) or vectors.ndim != 2 or vectors.shape[0] == 0:
        raise ValueError(
            f"vectors must be a tensor [n, d] with n >= 1 (one row per peer), "
            f"got {getattr(vectors, 'shape', type(vectors).__name__)}"
        )
    if not vectors.is_floating_point():
        raise ValueError(f"vectors must be floating point, got {vectors.dtype}")
    if not isinstance(weights, torch.Tensor) or weights.shape != (vectors.shape[0],):
        raise ValueError(
            f"weights must be a tensor [n] with one weight per row of vectors ({vectors.shape[0]}), "
            f"got {getattr(weights, 'shape', type(weights).__name__)}"
        )
    if not torch.isfinite(weights).all() or (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all zero, got {weights.tolist()}")


def weighted_median(vectors: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The weighted coordinate-wise median of the rows of ``vectors``.

    The midpoint of the lower and upper weighted medians, so equal weights give the usual median; the lower one
    alone would lean towards the smaller values. Rows of weight 0 never count.

    :param vectors: [n, d] floating point, finite
    :param weights: [n] finite, >= 0, not all zero
    :returns: [d]
    """
    _check_vectors_and_weights(vectors, weights)
    weights = weights.to(vectors.dtype)
    values, order = vectors.sort(dim=0)
    cumulative = weights[order].cumsum(dim=0)
    # the first sorted row whose cumulative weight reaches / passes half of the column's total: either way a row
    # that raises the cumulative weight, so never one of weight 0 (the last entry is the total, as summed here)
    half, last = cumulative[-1:] / 2, vectors.shape[0] - 1
    lower = (cumulative < half).sum(dim=0, keepdim=True).clamp_(max=last)
    upper = (cumulative <= half).sum(dim=0, keepdim=True).clamp_(max=last)
    return (values.gather(0, lower) + values.gather(0, upper)).squeeze(0) / 2


def centered_clip(
    vectors: torch.Tensor, weights: torch.Tensor, tau: float, iterations: int, start: torch.Tensor | None = None
) -> torch.Tensor:
    """CenteredClip: a weighted mean in which every row's pull is clipped to ``tau``.

    A far row moves the result by at most ``tau * w_i / sum_i w_i`` per iteration. Rows with a NaN or an infinity
    get no weight; if all have one, the result is the plain weighted mean.

    :param vectors: [n, d], one row per peer
    :param weights: [n], each peer's weight (its sample count), >= 0, not all zero
    :param tau: the clipping radius in the units of the vectors (L2 norm), >= 0; 0 returns the start
    :param iterations: L >= 0; 0 returns the start
    :param start: [d], where to start; default: the weighted coordinate-wise median (see the module docstring)
    :returns: [d], in the dtype of ``vectors``
    """
    _check_vectors_and_weights(vectors, weights)
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau >= 0 or tau == float("inf"):
        raise ValueError(f"tau={tau!r} is not allowed: expected a finite number >= 0 (the clipping radius)")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
        raise ValueError(f"iterations={iterations!r} is not allowed: expected an integer >= 0")
    if start is not None and start.shape != vectors.shape[1:]:
        raise ValueError(f"start must have shape {tuple(vectors.shape[1:])}, got {tuple(start.shape)}")

    weights = weights.to(vectors.dtype)
    finite = torch.isfinite(vectors).all(dim=1)
    if not finite.any() or weights[finite].sum() <= 0:
        return (weights[:, None] * vectors).sum(0) / weights.sum()
    if not finite.all():
        # a row that cannot be clipped gets no weight; zeros keep it out of every sum and of the median
        weights = torch.where(finite, weights, torch.zeros_like(weights))
        vectors = torch.where(finite[:, None], vectors, torch.zeros_like(vectors))

    v = weighted_median(vectors, weights) if start is None else start.to(vectors.dtype).clone()
    total = weights.sum()
    for _ in range(iterations):
        differences = vectors - v
        distances = differences.norm(dim=1)
        # min(1, tau / ||x_i - v||), written so that a row at v (distance 0) gets 1 rather than 0/0
        scales = torch.where(
            distances > tau, tau / distances.clamp_min(torch.finfo(distances.dtype).tiny), torch.ones_like(distances)
        )
        v = v + (weights * scales) @ differences / total
    return v


def cap_weights(weights: torch.Tensor) -> torch.Tensor:
    """Each weight capped at the (lower) median of the positive ones: no sender counts more than the median sender.

    :param weights: [n], finite, >= 0
    """
    positive = weights[weights > 0]
    if positive.numel() == 0:
        return weights
    return torch.minimum(weights, positive.median())


def clipped_aggregate(
    vectors: torch.Tensor, weights: torch.Tensor, relative_tau: float, iterations: int
) -> torch.Tensor:
    """CenteredClip with a relative radius: what each part of an all-reduce is reduced with.

    Caps the weights (``cap_weights``), starts at the weighted median, clips at ``relative_tau`` times the median
    distance from it.

    :param vectors: [n, d], one row per sender
    :param weights: [n], >= 0, not all zero
    :param relative_tau: > 0, the radius as a multiple of the median distance
    :param iterations: L >= 0
    """
    _check_vectors_and_weights(vectors, weights)
    finite = torch.isfinite(vectors).all(dim=1)
    if not finite.any() or weights[finite].sum() <= 0:
        return centered_clip(vectors, weights, 0.0, 0)  # nothing usable: the plain mean, as hivemind's would be
    clean_weights = cap_weights(torch.where(finite, weights.to(vectors.dtype), torch.zeros((), dtype=vectors.dtype)))
    clean = torch.where(finite[:, None], vectors, torch.zeros((), dtype=vectors.dtype))
    start = weighted_median(clean, clean_weights)
    distances = (clean - start).norm(dim=1)
    radius = float(relative_tau) * float(weighted_median(distances[:, None], clean_weights))
    return centered_clip(clean, clean_weights, radius, iterations, start=start)


# ---------------------------------------------------------------------------------------------
# hivemind: the reducer, the all-reduce runner, the averager


class _PartCollector:
    """Stands in for TensorPartReducer's accumulator: keeps each sender's part instead of summing it.

    hivemind's ``accumulate_part`` calls ``add_(part, alpha=weight)`` once per sender, so its bookkeeping of failed
    senders stays hivemind's. A part broadcasts to the shape (an anchor's one-value stand-in).

    :param shape: the shape of the part being reduced
    """

    def __init__(self, shape: torch.Size):
        self.shape = shape
        self.parts: list[torch.Tensor] = []
        self.weights: list[float] = []

    def add_(self, tensor_part: torch.Tensor, alpha: float = 1.0) -> _PartCollector:
        self.parts.append(tensor_part.expand(self.shape))
        self.weights.append(float(alpha))
        return self


class CenteredClipReducer(TensorPartReducer):
    """TensorPartReducer that reduces each part across senders with CenteredClip instead of the mean.

    Negative or non-finite weights count as 0; if no weight is left, the senders count equally.

    :param part_shapes: shapes of the parts this peer reduces
    :param num_senders: how many peers send parts
    :param relative_tau: the clipping radius, as a multiple of the median distance from the start
    :param iterations: CenteredClip iterations per part
    """

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, *, relative_tau: float, iterations: int):
        self.relative_tau, self.iterations = relative_tau, iterations
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _PartCollector(self.part_shapes[self.current_part_index])

    def check_current_part_finished(self):
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            self.current_part_future.set_result(self._aggregate(self.accumulator))
            self.reset_accumulators()

    def _aggregate(self, collector: _PartCollector) -> torch.Tensor:
        shape = self.part_shapes[self.current_part_index]
        if not collector.parts:  # every sender failed: hivemind's mean would be 0 / 0 as well
            return torch.full(shape, float("nan"))
        vectors = torch.stack([part.reshape(-1).float() for part in collector.parts])
        weights = torch.tensor(collector.weights, dtype=torch.float32)
        weights = torch.where(torch.isfinite(weights) & (weights > 0), weights, torch.zeros(()))
        if weights.sum() <= 0:
            weights = torch.ones_like(weights)
        return clipped_aggregate(vectors, weights, self.relative_tau, self.iterations).reshape(shape)


class CenteredClipAllReduceRunner(StandInAllReduceRunner):
    """StandInAllReduceRunner whose reducer is a CenteredClipReducer (everything else is hivemind's).

    :param clip_tau: relative clipping radius (CenteredClipReducer's relative_tau)
    :param clip_iterations: CenteredClip iterations per part
    :param kwargs: AllReduceRunner's arguments
    """

    tensor_part_reducer: TensorPartReducer  # hivemind's, set by AllReduceRunner's __init__

    def __init__(self, *, clip_tau: float, clip_iterations: int, **kwargs):
        super().__init__(**kwargs)
        # replace the unused reducer; marked finished, it does not warn "received 0.0% of input tensors"
        unused = self.tensor_part_reducer
        unused.finished.set()
        self.tensor_part_reducer = CenteredClipReducer(
            unused.part_shapes, unused.num_senders, relative_tau=clip_tau, iterations=clip_iterations
        )


class CenteredClipAveragerMixin(RunnerChoiceMixin):
    """Makes a DecentralizedAverager (sub)class reduce with CenteredClip in its all-reduce rounds.

    Put it before the averager class; it overrides only ``make_allreduce_runner``, so it combines with other mixins.
    Its RPC prefix keeps peers that take the plain mean out of its rounds: every peer of a run must use the same
    classes. Shown by tests/swarm/test_robust.py::test_the_centered_clip_mixin_combines_with_other_averager_classes.

    :param clip_tau: the clipping radius relative to the median distance of the senders' parts from their median
    :param clip_iterations: CenteredClip iterations per part
    :param kwargs: the averager's own arguments; ``min_group_size`` defaults to 3 (MIN_GROUP_SIZE)
    """

    rpc_name_prefix = "CenteredClip"
    # hivemind caches RPC handlers in class attributes: each class fills its own
    _rpc_handlers = None
    _stub_type = None

    def __init__(self, *args, clip_tau: float = 0.5, clip_iterations: int = 30, **kwargs):
        if isinstance(clip_tau, bool) or not isinstance(clip_tau, (int, float)) or not 0 < clip_tau < float("inf"):
            raise ValueError(f"clip_tau={clip_tau!r} is not allowed: expected a positive number")
        if isinstance(clip_iterations, bool) or not isinstance(clip_iterations, int) or clip_iterations < 1:
            raise ValueError(f"clip_iterations={clip_iterations!r} is not allowed: expected an integer >= 1")
        # set before the averager's __init__, which starts its background process (a fork of this one)
        self.clip_tau, self.clip_iterations = float(clip_tau), clip_iterations
        # in a group of 2 an attacker holds half of the weight
        kwargs.setdefault("min_group_size", MIN_GROUP_SIZE)
        super().__init__(*args, **kwargs)

    def make_allreduce_runner(self, **kwargs) -> AllReduceRunner:
        return CenteredClipAllReduceRunner(clip_tau=self.clip_tau, clip_iterations=self.clip_iterations, **kwargs)


# a DecentralizedAverager, and hivemind's GradientAverager, that average with CenteredClip
CenteredClipAverager = compose_averager(
    DecentralizedAverager, CenteredClipAveragerMixin, qualname="CenteredClipAverager"
)
CenteredClipGradientAverager = compose_averager(
    GradientAverager, CenteredClipAveragerMixin, qualname="CenteredClipGradientAverager"
)


def with_centered_clip(averager_class: type[DecentralizedAverager]) -> type[DecentralizedAverager]:
    """``averager_class`` with CenteredClipAveragerMixin in front (itself if it already has it)."""
    if issubclass(averager_class, CenteredClipAveragerMixin):
        return averager_class
    if averager_class is GradientAverager:
        return CenteredClipGradientAverager
    # a class made here lives in this process and its forks (hivemind's averagers are forked, never pickled)
    return compose_averager(averager_class, CenteredClipAveragerMixin)


def robust_grad_averager_factory(
    tau: float, iterations: int, averager_class: type[GradientAverager] = GradientAverager, **averager_kwargs
):
    """A ``grad_averager_factory`` for hivemind.Optimizer whose gradient averager uses CenteredClip.

    :param tau: relative clipping radius (see the module docstring)
    :param iterations: CenteredClip iterations per part
    :param averager_class: the GradientAverager (sub)class to extend, e.g. one that checks who calls it
    :param averager_kwargs: more fixed arguments of the averager (e.g. ``request_timeout``)
    """
    # a Callable: mypy's partial cannot call a type[Any] (hivemind has no type hints)
    build: Callable[..., GradientAverager] = with_centered_clip(averager_class)
    return partial(build, clip_tau=tau, clip_iterations=iterations, **averager_kwargs)


def grad_averager_factory(
    aggregation: str,
    tau: float,
    iterations: int,
    averager_class: type[GradientAverager] = GradientAverager,
    **averager_kwargs,
):
    """The ``grad_averager_factory`` for an OptimizerConfig's ``aggregation`` ("mean" or "centered_clip").

    "mean" is ``averager_class`` itself, untouched: hivemind's weighted mean, exactly.

    :param aggregation: "mean" or "centered_clip"
    :param tau: relative clipping radius (only for "centered_clip")
    :param iterations: CenteredClip iterations per part (only for "centered_clip")
    :param averager_class: the GradientAverager (sub)class to build
    :param averager_kwargs: more fixed arguments of the averager (e.g. ``request_timeout``)
    """
    if aggregation == "mean":
        build: Callable[..., GradientAverager] = averager_class  # as in robust_grad_averager_factory
        return partial(build, **averager_kwargs)
    if aggregation == "centered_clip":
        return robust_grad_averager_factory(tau, iterations, averager_class, **averager_kwargs)
    raise ValueError(f"aggregation={aggregation!r} is not allowed: choose one of {', '.join(AGGREGATIONS)}")
