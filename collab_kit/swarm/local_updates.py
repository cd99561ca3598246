"""Local-update mode (DiLoCo): peers train on their own and average only once a round, through hivemind.

DiLoCo (Douillard et al., 2023): H inner steps, then the pseudo-gradients (global minus local parameters) are
averaged and one outer Nesterov SGD step is taken, about H times fewer bytes (``OptimizerConfig.local_steps`` = H):

- A round ends when the swarm has processed ``OptimizerConfig.round_samples``; a slow peer holds nobody back, and
  each pseudo-gradient is weighted by its samples.
- The global parameters are hivemind's offloaded CPU copy, stepped by the outer optimizer; the inner 8-bit LAMB
  steps the model at every local batch.
- Pseudo-gradients travel through the gradient averager, in 8 bits or in 4 bits with error feedback
  (collab_kit.swarm.four_bit), reduced by the mean or CenteredClip (collab_kit.swarm.robust).
- Anchors (collab_kit.swarm.anchor) take no inner steps and add no pseudo-gradient: they reduce and take the outer step.
- ``OptimizerConfig.overlap_rounds``: the round averages in the background, its outer step applied one round late
  under the inner progress made meanwhile (Streaming DiLoCo).
- ``OptimizerConfig.fragments`` = F: one fragment averaged a round, in turn (collab_kit.swarm.fragments).

The two modes never average together: this mode's averagers carry ``LocalUpdateRoundsMixin``'s RPC prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, TypeAlias

import torch
from hivemind.averaging.control import AveragingStage, StepControl

from collab_kit.config import OptimizerConfig
from collab_kit.swarm.averagers import ANCHOR_ROLE, compose_averager
from collab_kit.swarm.four_bit import ErrorFeedback
from collab_kit.swarm.fragments import FragmentStepMixin, fragment_of_tensors, fragment_rounds_mixin, round_fragment
from collab_kit.swarm.lamb import HoldableStepMixin, linear_warmup_then_decay, make_lamb8bit, make_scheduler_factory

if TYPE_CHECKING:  # the type checker's view: what LocalUpdatesMixin is put before
    from collab_kit.swarm.optimizer import CollaborativeOptimizer

    _OptimizerBase: TypeAlias = CollaborativeOptimizer
else:
    _OptimizerBase = object

logger = logging.getLogger(__name__)


class OuterNesterovSGD(HoldableStepMixin, torch.optim.SGD):
    """The outer optimizer: SGD with Nesterov momentum on the averaged pseudo-gradient, without weight decay (the inner
    optimizer applies it).

    A step whose averaged pseudo-gradient is not finite is dropped by every peer alike; ``hold_next_step`` makes the
    next step a no-op. Shown by
    tests/swarm/test_local_updates.py::test_the_outer_step_is_nesterov_sgd_and_drops_a_non_finite_average.
    """

    def __init__(self, params, lr: float, momentum: float):
        super().__init__(params, lr=lr, momentum=momentum, nesterov=momentum > 0, weight_decay=0.0)
        self.dropped_steps = 0  # outer steps dropped for a non-finite pseudo-gradient
        # with fragments (collab_kit.swarm.fragments): the parameters the next steps move, by the groups' order; the
        # others, and their momentum, stay as they are. None: all
        self.fragment_mask: list[bool] | None = None

    @torch.no_grad()
    def step(self, closure=None):
        if self._step_is_held():
            return None
        params = [p for group in self.param_groups for p in group["params"]]
        mask = self.fragment_mask if self.fragment_mask is not None else [True] * len(params)
        left_out = [(p, p.grad) for p, inside in zip(params, mask) if not inside]
        grads = [p.grad for p, inside in zip(params, mask) if inside and p.grad is not None]
        if grads and not all(bool(torch.isfinite(grad).all()) for grad in grads):
            self.dropped_steps += 1
            logger.warning("the averaged pseudo-gradient is not finite: this round's outer step is dropped")
            return None
        try:
            for param, _ in left_out:
                param.grad = None  # torch's SGD passes over a parameter without a gradient, momentum and all
            return super().step(closure)
        finally:
            for param, grad in left_out:
                param.grad = grad


def make_outer_sgd(params: Iterable, config: OptimizerConfig) -> OuterNesterovSGD:
    """The outer optimizer of ``config`` on ``params`` (parameter groups keep their other keys, weight decay is 0)."""
    groups = [dict(group, weight_decay=0.0) if isinstance(group, dict) else group for group in params]
    return OuterNesterovSGD(groups, lr=config.outer_learning_rate, momentum=config.outer_momentum)


def swarm_optimizer_factory(config: OptimizerConfig):
    """The optimizer the swarm's shared state holds (what hivemind's state averager steps and peers download): 8-bit
    LAMB in synchronous mode, the outer Nesterov SGD in local-update mode."""
    return partial(make_outer_sgd if config.local_updates else make_lamb8bit, config=config)


def swarm_scheduler_factory(config: OptimizerConfig):
    """The schedule of that optimizer: LAMB's warm-up and decay by global step; none for the outer SGD (DiLoCo keeps
    its outer rate constant; the inner optimizer follows the schedule, see LocalUpdatesMixin)."""
    return None if config.local_updates else make_scheduler_factory(config)


class LocalUpdateRoundsMixin:
    """Put before an averager of a peer in local-update mode: its RPCs carry this prefix, so that its rounds (and its
    state downloads) never mix with a synchronous peer's."""

    rpc_name_prefix = "LocalUpdates"


def mode_averager_class(averager_class: type, config: OptimizerConfig, gradients: bool = True) -> type:
    """``averager_class`` as the mode of ``config`` needs it: itself in synchronous mode, with LocalUpdateRoundsMixin
    in front in local-update mode, and with fragments (collab_kit.swarm.fragments) a gradient averager's rounds
    average one fragment each, and a state averager (``gradients`` False) copies the stepped fragment alone."""
    if not config.local_updates:
        return averager_class
    mixins: list[type] = [LocalUpdateRoundsMixin]
    if config.fragments > 1:
        mixins.append(fragment_rounds_mixin(config.fragments) if gradients else FragmentStepMixin)
    return compose_averager(averager_class, *mixins, qualname=f"LocalUpdates{averager_class.__qualname__}")


@dataclass(frozen=True)
class AppliedRound:
    """What a round that averaged in the background did, kept by its epoch until the volunteer reports that epoch:
    by then the next round may have begun or ended and replaced the optimizer's ``last_*`` figures."""

    group_size: int  # training peers in the round, this one included
    anchors: int
    problem: str | None
    averaged: bool  # with at least one other training peer


class LocalUpdatesMixin(_OptimizerBase):
    """Put before CollaborativeOptimizer (or a subclass): DiLoCo's local-update mode (see the module's docstring).

    Each local step is an inner step; at a round's end the pseudo-gradient goes where hivemind keeps accumulated
    gradients, weighted by the round's samples, and hivemind averages it and takes the outer step.

    :param inner_param_groups: the model's parameter groups for the inner optimizer (collab_kit.swarm.lamb
      .parameter_groups); None for a peer that trains nothing (an anchor)
    """

    local_config: OptimizerConfig  # set by with_local_updates

    def __init__(self, inner_param_groups: list[dict] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.inner_optimizer = None
        if inner_param_groups is not None and self.round_role != ANCHOR_ROLE:
            self.inner_optimizer = make_lamb8bit(inner_param_groups, self.local_config)
        self.inner_steps = 0  # inner steps taken since this peer started
        self.dropped_pseudo_gradients = 0  # rounds whose own pseudo-gradient was not finite (sent as zero weight)
        self.overlap = bool(self.local_config.overlap_rounds and self.inner_optimizer is not None)
        # the round averaging in the background (overlap): (its StepControl, the epoch it ends), until applied
        self._round_in_flight: tuple[StepControl, int] | None = None
        # overlap: the model's parameters when the round in flight was sent (on the CPU), to keep the progress since
        self._sent_parameters: list[torch.Tensor] | None = None
        self.overlapped_steps = 0  # inner steps taken while a round of this peer averaged in the background
        # 4-bit pseudo-gradients: what rounding dropped from this peer's last one, added to its next
        self.error_feedback: ErrorFeedback | None = None
        if self.local_config.pseudo_gradient_bits == 4 and self.inner_optimizer is not None:
            self.error_feedback = ErrorFeedback(self.local_config.compression_threshold)
        self.applied_rounds = 0  # rounds whose outcome this peer has applied (an outer step taken, alone or not)
        # why this peer's global parameters are an epoch older than its epoch (a download hivemind moved on), until a
        # download at its epoch replaces them
        self._behind_swarm: str | None = None
        self.applied_in_background: dict[int, AppliedRound] = {}  # by epoch, until the volunteer reports it (pop)
        # fragments (collab_kit.swarm.fragments): the fragment of each parameter, by the optimizer's order
        self._fragment_of: tuple[int, ...] | None = None
        self._step_mask: list[bool] | None = None  # the fragment the next outer steps move (None: all)
        if self.local_config.fragments > 1:
            self._fragment_of = fragment_of_tensors(
                [param.numel() for param in self.state_averager.main_parameters], self.local_config.fragments
            )

    @property
    def local_epoch(self) -> int:
        """The epoch this peer trains in: its global parameters' epoch, plus one while a round averages in the
        background (the samples of the next round already count towards the swarm's next epoch)."""
        return self.state_averager.local_epoch + (getattr(self, "_round_in_flight", None) is not None)

    @property
    def epoch_in_flight(self) -> int | None:
        """The epoch of the round averaging in the background, if any (its outcome is not known yet)."""
        return None if self._round_in_flight is None else self._round_in_flight[1]

    def _state_averager_class(self) -> type:
        return mode_averager_class(super()._state_averager_class(), self.local_config, gradients=False)

    @property
    def global_batch(self) -> int:
        """The swarm's global batch now: H per round ended, and those of this round the swarm has processed so far."""
        config = self.local_config
        in_round = int(self.tracker.global_progress.samples_accumulated // config.target_batch_size)
        return self.local_epoch * config.epoch_batches + min(config.epoch_batches - 1, max(0, in_round))

    def _check_and_accumulate_gradients(self, batch_size: int, grad_scaler) -> bool:
        if self.inner_optimizer is None:
            return super()._check_and_accumulate_gradients(batch_size, grad_scaler)
        config = self.local_config
        rate = config.learning_rate * linear_warmup_then_decay(
            self.global_batch, config.warmup_steps, config.total_steps
        )
        for group in self.inner_optimizer.param_groups:
            group["lr"] = rate
        self.inner_optimizer.step()
        self.inner_steps += 1
        averager = self.grad_averager
        averager.local_samples_accumulated += batch_size
        if self._round_in_flight is not None:
            self.overlapped_steps += 1
            if self._round_in_flight[0].done():
                self._apply_round_in_flight()
        self.tracker.report_local_progress(self.local_epoch, averager.local_samples_accumulated)
        return True

    # An outer step must start from the swarm's global parameters: a peer behind the swarm's epoch loads its state
    # (with overlapped rounds, one epoch behind is allowed: its round joins the others')
    # (tests/swarm/test_local_updates.py::test_peers_end_every_round_with_equal_global_parameters).

    def _should_load_state_from_peers(self) -> bool:
        allowed_lag = 1 if self.overlap and self._loaded is None else 0
        if (
            self.inner_optimizer is not None
            and not self._resync_requested
            and self.local_epoch < self.tracker.global_epoch - allowed_lag
        ):
            self._loaded = None  # a download that the swarm overtook is not gone on from, as the synchronous mode does
            self.request_resync(
                f"the swarm is at epoch {self.tracker.global_epoch}, this peer at {self.local_epoch}: "
                f"its next outer step must start from the swarm's global parameters"
            )
        return super()._should_load_state_from_peers()

    def load_state_from_peers(self, **kwargs) -> bool:
        self._drop_round_in_flight()  # the state downloaded replaces what its average would have changed
        self._select_fragment(None)  # every parameter of the model takes the state's
        loaded = super().load_state_from_peers(**kwargs)
        if loaded and self.error_feedback is not None:
            self.error_feedback.reset()  # what its own rounds dropped is of no use from the swarm's parameters
        downloaded = self.state_averager.last_downloaded_epoch
        if self.inner_optimizer is None:
            return loaded
        if loaded and downloaded is not None and downloaded < self.local_epoch:
            # hivemind moved this peer on to the swarm's epoch after a download one epoch older
            self._behind_swarm = f"the state downloaded was of epoch {downloaded}, the swarm's of {self.local_epoch}"
            self.request_resync(self._behind_swarm)
        elif loaded:
            self._behind_swarm = None
        elif self._behind_swarm is not None:
            # refused (the sharers' round was still in flight, their state one epoch old): asked again at the next step
            self.request_resync(self._behind_swarm)
        return loaded

    def _follow_round_epoch(self, result, parameters_from_swarm: bool) -> None:
        if self.inner_optimizer is not None and result.epoch() == self.local_epoch + 1:
            self.request_resync(
                f"this peer's round was the swarm's round of epoch {self.local_epoch + 1}, and its "
                f"global parameters were of epoch {self.local_epoch}"
            )
            return
        epochs = [member.get("epoch") for member in result.values() if isinstance(member, dict)]
        later = [epoch for epoch in epochs if isinstance(epoch, int) and epoch > self.local_epoch]
        if self.inner_optimizer is not None and result.epoch() is None and later:
            self.request_resync(f"this peer's round of epoch {self.local_epoch} had a member at epoch {max(later)}")
            return
        if self.inner_optimizer is not None and self._fragment_of is not None and result.epoch() != self.local_epoch:
            # the group averaged the fragment of its own epoch, and this peer stepped its epoch's
            self.request_resync(f"this peer's round was of epoch {self.local_epoch}, its group's of {result.epoch()}")
            return
        super()._follow_round_epoch(result, parameters_from_swarm)

    def _maybe_schedule_gradient_averaging(self) -> None:
        # one matchmaking at a time: a second, queued by hivemind, would meet the swarm's next round
        if self._round_in_flight is None:
            super()._maybe_schedule_gradient_averaging()

    def _update_global_epoch(self, grad_scaler) -> None:
        if self.inner_optimizer is None:
            self._select_fragment(self.local_epoch)
            return super()._update_global_epoch(grad_scaler)
        if self._round_in_flight is not None:
            self._apply_round_in_flight()  # the last round first: this one's pseudo-gradient starts from its result
        self._select_fragment(self.local_epoch)
        self._load_pseudo_gradient()
        if self.overlap and self.tracker.global_progress.num_peers > 1 and not self._resync_requested:
            self._send_round_in_background(grad_scaler)
        else:  # alone, or loading the swarm's state next: the round (if any) and its outer step at once
            super()._update_global_epoch(grad_scaler)
            self.applied_rounds += 1

    def _send_round_in_background(self, grad_scaler) -> None:
        """Start this round's averaging and go on to the next round's inner steps; _apply_round_in_flight takes the
        outer step once the average is in."""
        epoch = self.local_epoch
        with self.tracker.pause_updates():
            with torch.no_grad():
                parameters = self.state_averager.main_parameters
                if self._sent_parameters is None:
                    self._sent_parameters = [torch.empty_like(param, device="cpu") for param in parameters]
                for sent, param in zip(self._sent_parameters, parameters):
                    sent.copy_(param.detach())
            # the last round's figures (last_group_size, ...) stay until this round's outcome replaces them
            control = self.scheduled_grads if self._trigger_gradient_round(grad_scaler) else None
            if control is None:  # hivemind could not start the round: the peer steps with its own pseudo-gradient now
                self.grad_averager.load_accumulators_into_averager_()
                self._take_outer_step(round_control=None, epoch=epoch)
                return
            self._round_in_flight, self.scheduled_grads = (control, epoch), None
            if self.on_averaging_start is not None:
                self.on_averaging_start(epoch, self._round_in_flight[0].stage.name.lower())
            self.grad_averager.reset_accumulated_grads_()  # the next round's samples count from zero
            self.tracker.update_epoch(new_epoch=epoch + 1)
            self._should_check_synchronization_on_update = True

    def _apply_round_in_flight(self) -> None:
        """The outer step of the round that averaged in the background (waiting for it, up to its timeout, if it is
        not over), with the inner progress made since it was sent kept on top of the new global parameters."""
        assert self._round_in_flight is not None and self._sent_parameters is not None  # callers check; sent with it
        control, epoch = self._round_in_flight
        mask = self._select_fragment(epoch)  # the model's other fragments are not touched: they keep their progress
        with self.tracker.pause_updates(), torch.no_grad():
            samples = self.grad_averager.local_samples_accumulated
            pairs = zip(self._sent_parameters, self.state_averager.main_parameters)
            stepped = [pair for index, pair in enumerate(pairs) if mask is None or mask[index]]
            for sent, param in stepped:
                sent.sub_(param.detach().to(sent.device)).neg_()  # now the progress since the round was sent
            self._round_in_flight = None  # from here the peer's epoch is its global parameters' again
            averaged_before = self.averaged_rounds
            self._take_outer_step(control, epoch)
            self.applied_in_background[epoch] = AppliedRound(
                self.last_group_size,
                self.last_anchors_in_group,
                self.last_round_problem,
                averaged=self.averaged_rounds > averaged_before,
            )
            for progress, param in stepped:
                param.add_(progress.to(param.device))
            self.grad_averager.local_samples_accumulated = samples  # this round's, so far

    def _select_fragment(self, epoch: int | None) -> list[bool] | None:
        """With fragments: the next outer steps (of the round that ends ``epoch``) move that round's fragment alone,
        and copy it alone into the model; ``epoch`` None: every parameter (a download). Returns the mask, None without
        fragments."""
        if self._fragment_of is None:
            return None
        fragment = None if epoch is None else round_fragment(epoch, self.local_config.fragments)
        mask = None if fragment is None else [owner == fragment for owner in self._fragment_of]
        self._step_mask = self.state_averager.step_fragment = self.state_averager.optimizer.fragment_mask = mask
        return mask

    def _take_outer_step(self, round_control, epoch: int) -> None:
        """Read the round's outcome (CollaborativeOptimizer's accounting) and step the global parameters, which the
        state averager copies into the model."""
        self.last_group_size = int(self.round_role != ANCHOR_ROLE)
        self.last_anchors_in_group, self.last_round_problem, self.last_received = 0, None, 1.0
        self.last_round_epoch = epoch
        self._average_gradients_and_load_into_optimizer(round_control)
        self.state_averager.step(increment_epoch=True, optimizer_step=True, delay_optimizer_step=False)
        self.applied_rounds += 1
        if not self.client_mode:
            self.state_averager.state_sharing_priority = self.state_averager.local_epoch

    def _drop_round_in_flight(self) -> None:
        """Leave the round in flight to its group (waiting for it, up to its timeout) without taking its step: a
        download of the swarm's state follows."""
        if self._round_in_flight is None:
            return
        control, epoch = self._round_in_flight
        self._round_in_flight = None
        if control.stage == AveragingStage.LOOKING_FOR_GROUP:
            control.cancel()  # no group waits for this peer's part yet
        try:
            control.result(self.averaging_timeout)
        except BaseException as e:  # a cancelled or failed round: nothing of it is used either way
            logger.debug(f"the round of epoch {epoch} dropped for a download ended with {e!r}")
        self.grad_averager.notify_used_averaged_gradients()

    def finish_round_in_flight(self) -> None:
        """Wait for the round averaging in the background, if any, and take its outer step (a peer that stops)."""
        if self._round_in_flight is not None:
            self._apply_round_in_flight()

    @torch.no_grad()
    def _load_pseudo_gradient(self) -> None:
        """Put this round's pseudo-gradient (global minus local parameters) where hivemind keeps the accumulated
        gradients, weighted by the samples this peer processed in the round."""
        averager = self.grad_averager
        global_parameters = [param for group in self.state_averager.optimizer.param_groups for param in group["params"]]
        local_parameters = self.state_averager.main_parameters
        finite = True
        for accumulator, global_param, local_param in zip(
            averager._grad_accumulators(), global_parameters, local_parameters
        ):
            accumulator.copy_(global_param).sub_(local_param.to(accumulator.device))
            finite = finite and bool(torch.isfinite(accumulator).all())
        if not finite:
            self.dropped_pseudo_gradients += 1
            logger.warning(
                f"this peer's pseudo-gradient of round {self.local_epoch} is not finite: it takes part "
                f"in the round with weight 0, and goes on from the swarm's parameters"
            )
            # every fragment's: an outer step copies only the fragment it moves, and an overlapped one keeps progress
            for global_param, local_param in zip(global_parameters, local_parameters):
                local_param.copy_(global_param.to(local_param.device))
            assert self.inner_optimizer is not None  # only a training peer loads a pseudo-gradient
            self.inner_optimizer.state.clear()  # moments of a blown-up step would blow up the next: they start anew
        if not finite or averager.local_samples_accumulated == 0:
            for accumulator in averager._grad_accumulators():
                accumulator.zero_()
            averager.local_samples_accumulated = averager.local_times_accumulated = 0
            if not finite and self.error_feedback is not None:
                self.error_feedback.reset()
        else:
            # hivemind divides the accumulators by the times they were added to: the pseudo-gradient is one whole
            averager.local_times_accumulated = 1
            if self.error_feedback is not None:  # on the 4-bit grid already: the averager's rounding changes nothing
                mask = self._step_mask  # with fragments, only the tensors this round sends
                sent = None if mask is None else [index for index, inside in enumerate(mask) if inside]
                self.error_feedback.quantize_(list(averager._grad_accumulators()), sent=sent)


def with_local_updates(optimizer_class: type, config: OptimizerConfig) -> type:
    """``optimizer_class`` (CollaborativeOptimizer or a subclass) in local-update mode with ``config``'s settings."""
    return type(
        f"LocalUpdates{optimizer_class.__name__}",
        (LocalUpdatesMixin, optimizer_class),
        {"__module__": __name__, "local_config": config},
    )


def local_update_kwargs(config: OptimizerConfig) -> dict:
    """What hivemind.Optimizer takes differently in local-update mode.

    - ``target_batch_size``: a round is H global batches of the swarm's samples.
    - ``offload_optimizer``: the offloaded copy holds the global parameters, which the model's own leave behind as it
      trains (DiLoCo's extra copy, kept on the CPU).
    - ``delay_optimizer_step`` and ``delay_state_averaging`` off: a step or a state round applied later would write the
      global parameters over the model's in the middle of the next round's inner steps.
    """
    return dict(
        target_batch_size=config.round_samples,
        offload_optimizer=True,
        delay_optimizer_step=False,
        delay_state_averaging=False,
    )
