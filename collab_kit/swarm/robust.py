"""Robust gradient aggregation: CenteredClip instead of the mean when peers average their gradients.

What it defends against. With the plain (weighted) mean, a single peer can move the swarm's
gradient anywhere: sending its gradients multiplied by -1000 turns every global step of every peer
into gradient ascent. CenteredClip (Karimireddy, He, Jaggi 2020, "Learning from History for
Byzantine Robust Optimization") bounds what any one peer can do: starting from a point ``v``, it
repeats ``L`` times

    v <- v + sum_i w_i * (x_i - v) * min(1, tau / ||x_i - v||) / sum_i w_i

so a vector far from the others pulls ``v`` by at most ``tau`` times its share of the weight,
however far it is, while vectors within ``tau`` of ``v`` count fully, as in the mean.

How it fits in hivemind 1.1.12. In an all-reduce every peer of the group reduces one span of the
flattened gradients: it receives that span from every sender, cut into parts (pieces of one tensor
of at most ``part_size_bytes`` after compression, 2^19 bytes by default), and reduces each part
across senders in ``TensorPartReducer``. ``CenteredClipReducer`` is that reducer with CenteredClip
in place of the weighted mean; ``CenteredClipAveragerMixin`` makes an averager's all-reduce use it.
Parts arrive decompressed (8-bit or fp16, collab_kit.swarm.lamb.gradient_compression); weights are the
senders' sample counts, as for the mean.

Choices:
- Start: the weighted coordinate-wise median, not the mean. With honest peers holding most of the
  weight, each coordinate's median lies within the honest values, so ``v`` starts inside the honest
  cluster; from the mean, which one outlier drags arbitrarily far, each iteration could only walk
  back about ``tau``. The median itself is biased toward the attacker's side coordinate by
  coordinate, so the iterations matter: 5 left honest tiny-preset peers beside one sending x -1000
  with a rising loss, 30 (the default) let it fall as without an attacker. (The paper starts from the previous round's
  estimate, with momentum; hivemind's spans and parts change with every group, so there is no
  stable history to start from.)
- Radius: ``clip_tau`` is relative. Each part is clipped at ``clip_tau`` times the weighted median
  of the senders' distances from that start, so one setting fits a bias of 32 values and a slice
  of an embedding of 2^17, early and late in training, whatever the scale of the gradients. Its
  default (OptimizerConfig.clip_tau = 0.5) is small because an attacker pulls the result by up to
  about ``radius * its weight / the honest weight`` the same way every step, which adds up when the
  honest signal is weak beside the noise of each peer's batch.
- Weights: no sender counts for more than the group's median sender (``cap_weights``). The weights are
  sample counts, and a peer that accumulated more samples than the others together (a fast machine,
  or others busy with their last round) would hold half of the weight and decide the median on its
  own: in the swarm test, an attacker that computed 51% of one epoch's samples, or 80% of another's,
  set that step's direction for all, and the honest loss ratio came out 0.998 and 1.002 instead of
  about 0.987. Among honest peers the result leans a little less towards the busiest one.
- Groups: at least 3 peers (MIN_GROUP_SIZE, the averager's ``min_group_size``). In a group of 2 an
  attacker holds half of the weight; rather than averaging there, hivemind's optimizer then steps
  on the local gradients.

Limits:
- It needs honest peers to hold more than half of the weight (and the more, the smaller the
  bias): with half or more, the median itself belongs to the attackers.
- Only the gradients: hivemind.Optimizer's state averaging (the parameters, every
  ``average_state_every`` epochs) is still the plain mean, which a malicious peer can poison by
  sending its own parameters.
- It trusts the weights senders report (their sample counts) up to the median sender's: several
  attackers that each claim a large weight can still raise the median. It trusts reducers too: the
  peer that reduces a span can return anything for it. Authentication (who may join) and, beyond
  this kit, verification of reducers (Gorbunov et al. 2021, "Secure Distributed Training at
  Scale") address those.
- Clipping is per part, not over the whole gradient: an attacker's total influence is bounded
  part by part, by about ``tau`` times its share of the weight in each.
- A part that holds a NaN or an infinity gets no weight (it could not be clipped); if every sender
  sent one, the result is their mean, as hivemind's would be.
- When honest peers disagree (small batches, very different data), the result sits between their
  weighted mean and their median: CenteredClip is the mean only when every vector lies within the
  radius of the result.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Sequence

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

    In each coordinate, the midpoint of the lower weighted median (the first sorted value at which the
    cumulative weight reaches half of the total) and the upper one (the first at which it passes half):
    with equal weights, the usual median, also for an even count. The lower one alone would lean
    towards the smaller values: with 3 honest peers and an attacker far below, it is the smallest
    honest value in every coordinate. Rows of weight 0 never count.

    :param vectors: [n, d] floating point, finite
    :param weights: [n] finite, >= 0, not all zero
    :returns: [d]
    """
    _check_vectors_and_weights(vectors, weights)
    weights = weights.to(vectors.dtype)
    values, order = vectors.sort(dim=0)
    cumulative = weights[order].cumsum(dim=0)
    # the first sorted index whose cumulative weight reaches half of the column's total (the last entry:
    # the same float sum for every coordinate's comparison, whatever the order of summation)
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

    Repeats ``iterations`` times ``v <- v + sum_i w_i (x_i - v) min(1, tau / ||x_i - v||) / sum_i w_i``.
    With every row within ``tau`` of the result it is the weighted mean; a row far away moves the
    result by at most ``tau * w_i / sum_i w_i`` per iteration. Rows that hold a NaN or an infinity
    get no weight; if all do, the result is the plain weighted mean (non-finite, as the mean would be).

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
    """Each weight capped at the median of the positive ones (the lower median for an even count): one
    sender, however many samples it reports, counts at most as much as the group's median sender.

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

    Caps the weights at the median sender's (``cap_weights``), starts at the weighted coordinate-wise
    median and clips at ``relative_tau`` times the weighted median of the rows' distances from it (see
    the module docstring for why).

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

    TensorPartReducer.accumulate_part (hivemind 1.1.12) calls ``accumulator.add_(part, alpha=weight)``
    once per sender, between its own bookkeeping of waiting, failed and banned senders; collecting the
    parts here leaves all of that bookkeeping to hivemind. A part broadcasts to the part's shape, as in hivemind's
    accumulator (an anchor's stand-in of one value, collab_kit.swarm.runners.StandInRunnerMixin).

    :param shape: the shape of the part being reduced
    """

    def __init__(self, shape: torch.Size):
        self.shape = shape
        self.parts, self.weights = [], []

    def add_(self, tensor_part: torch.Tensor, alpha: float = 1.0) -> _PartCollector:
        self.parts.append(tensor_part.expand(self.shape))
        self.weights.append(float(alpha))
        return self


class CenteredClipReducer(TensorPartReducer):
    """TensorPartReducer that reduces each part across senders with CenteredClip instead of the mean.

    The parts of the span this peer reduces are reduced one by one, each on its own (per-part
    clipping, see the module docstring). Weights a sender reports that are negative or not finite
    count as 0; if no weight is left, the senders count equally.

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

    def __init__(self, *, clip_tau: float, clip_iterations: int, **kwargs):
        super().__init__(**kwargs)
        # the runner builds its reducer in __init__ and nothing has used it yet: replace it. Marked finished, the
        # discarded one does not warn, when collected, that it "received 0.0% of input tensors"
        unused = self.tensor_part_reducer
        unused.finished.set()
        self.tensor_part_reducer = CenteredClipReducer(
            unused.part_shapes, unused.num_senders, relative_tau=clip_tau, iterations=clip_iterations
        )


class CenteredClipAveragerMixin(RunnerChoiceMixin):
    """Makes a DecentralizedAverager (sub)class reduce with CenteredClip in its all-reduce rounds.

    Put it before the averager class: ``class MyAverager(CenteredClipAveragerMixin, GradientAverager)``.
    It overrides only ``make_allreduce_runner`` (RunnerChoiceMixin), so it combines with mixins that override other
    methods (for instance ``rpc_join_group`` / ``rpc_aggregate_part`` to check who calls):
    ``class Both(AuthMixin, CenteredClipAveragerMixin, GradientAverager)``.

    hivemind names an averager's RPCs after its class (``CenteredClipGradientAverager.rpc_join_group``): peers
    whose averagers are of classes with different names never find each other. So every peer of a run must
    build its averager from the same classes: a peer with ``aggregation="mean"`` and one with
    ``"centered_clip"`` do not average together (each trains on its own gradients), and a mixin combined with
    this one must be combined the same way on every peer.

    :param clip_tau: the clipping radius relative to the median distance of the senders' parts from their median
    :param clip_iterations: CenteredClip iterations per part
    :param kwargs: the averager's own arguments; ``min_group_size`` defaults to 3 (MIN_GROUP_SIZE)
    """

    # a round that reduces with CenteredClip is another protocol: peers that take the plain mean must not join it
    rpc_name_prefix = "CenteredClip"
    # hivemind caches a class's RPC handlers and stub in these class attributes, and a subclass would inherit
    # its base's cache (with the base's RPC names) if the base had filled it first: each class fills its own
    _rpc_handlers = None
    _stub_type = None

    def __init__(self, *args, clip_tau: float = 0.5, clip_iterations: int = 30, **kwargs):
        if isinstance(clip_tau, bool) or not isinstance(clip_tau, (int, float)) or not 0 < clip_tau < float("inf"):
            raise ValueError(f"clip_tau={clip_tau!r} is not allowed: expected a positive number")
        if isinstance(clip_iterations, bool) or not isinstance(clip_iterations, int) or clip_iterations < 1:
            raise ValueError(f"clip_iterations={clip_iterations!r} is not allowed: expected an integer >= 1")
        # set before the averager's __init__, which starts its background process (a fork of this one)
        self.clip_tau, self.clip_iterations = float(clip_tau), clip_iterations
        # in a group of 2 an attacker holds half of the weight and CenteredClip cannot tell who is honest: groups
        # of 3 or more, or no averaging at all (hivemind's optimizer then steps with the local gradients)
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
    return partial(with_centered_clip(averager_class), clip_tau=tau, clip_iterations=iterations, **averager_kwargs)


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
        return partial(averager_class, **averager_kwargs)
    if aggregation == "centered_clip":
        return robust_grad_averager_factory(tau, iterations, averager_class, **averager_kwargs)
    raise ValueError(f"aggregation={aggregation!r} is not allowed: choose one of {', '.join(AGGREGATIONS)}")
