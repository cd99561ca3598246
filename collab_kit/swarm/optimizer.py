"""The paper's optimizer: hivemind.Optimizer around 8-bit LAMB, offloaded to CPU (section 3.3).

- ``hivemind.Optimizer`` steps once the swarm has processed ``target_batch_size`` samples: one large batch.
- 8-bit LAMB (collab_kit.swarm.lamb): about 4x less optimizer memory; its trust ratio makes huge batches trainable.
- ``offload_optimizer`` and ``delay_optimizer_step``: the step runs on the CPU, in the background.
- Size-adaptive compression (collab_kit.swarm.lamb): large tensors travel in 8 bits, small ones in fp16.

Its averagers are collab_kit.swarm.averagers; ``OptimizerConfig.local_steps`` > 0 is DiLoCo
(collab_kit.swarm.local_updates).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import InvalidStateError

import hivemind
import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.compression import Float16Compression, NoCompression
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager

from collab_kit.config import OptimizerConfig, SwarmConfig
from collab_kit.swarm import robust
from collab_kit.swarm.anchor_records import anchor_validators, read_anchor_addresses
from collab_kit.swarm.averagers import (
    ANCHOR_ROLE,
    CLIENT_JOIN_ANSWER_TIMEOUT,
    STATE_DOWNLOAD_PART_TIMEOUT,
    TRAINER_ROLE,
    RoundResult,
    recording_state_averager_class,
    round_report_averager_class,
)
from collab_kit.swarm.bindings import authorized_averager_class
from collab_kit.swarm.dht import initial_peer_ids
from collab_kit.swarm.keys import state_averager_prefix
from collab_kit.swarm.lamb import gradient_compression, parameter_groups
from collab_kit.swarm.local_updates import (
    local_update_kwargs,
    mode_averager_class,
    swarm_optimizer_factory,
    swarm_scheduler_factory,
    with_local_updates,
)
from collab_kit.swarm.progress import SwarmProgressTracker

logger = logging.getLogger(__name__)


NO_STATE_AVERAGING = 2**62  # an average_state_every no epoch reaches


class CollaborativeOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer that counts the global steps averaged with other training peers, and idles when alone.

    The count tells that peers really trained together. A peer alone does not pre-schedule matchmaking (hivemind
    would run it every epoch for nothing). A group of this peer and anchors only counts as a lone step.

    :param peer_gate: in an authorized run, a collab_kit.swarm.bindings.PeerGate for the averagers
    :param on_averaging_start: called with the global epoch and the round's stage each time this peer begins
      averaging its gradients with other peers, before the round is over: "looking_for_group" (matchmaking
      goes on), "awaiting_trigger" (the group is formed) or "running_allreduce"; also settable later as an
      attribute. ``collab-kit join --events`` reports it, so that tests can act in the middle of a round.
    """

    round_role = TRAINER_ROLE
    scheduled_grads: StepControl | None  # hivemind.Optimizer's, set in its __init__

    def __init__(self, peer_gate=None, on_averaging_start: Callable[[int, str], None] | None = None, **kwargs):
        self.peer_gate = peer_gate  # read by _make_state_averager, which hivemind calls inside __init__
        self.on_averaging_start = on_averaging_start
        self.on_state_download: Callable[[], None] | None = None  # called as each download of the state begins
        super().__init__(**kwargs)
        if self.client_mode or self.round_role == ANCHOR_ROLE:
            # no state averaging: a missed state round would hold up the next gradient round; such peers load the
            # swarm's state after a failed gradient round instead
            self.average_state_every = NO_STATE_AVERAGING
        # read from the state averager: a method of the optimizer would make a reference cycle
        state_averager = self.state_averager
        self.grad_averager.round_epoch = lambda: state_averager.local_epoch
        self.grad_averager.client_join_timeout = self.averaging_timeout
        self.averaged_rounds = 0  # global steps whose gradients were averaged with at least one other training peer
        # training peers in the last gradient round, this one included when it trains (anchors are not counted)
        self.last_group_size = int(self.round_role != ANCHOR_ROLE)
        self.last_anchors_in_group = 0  # anchors in the last gradient round
        self.last_round_problem: str | None = None  # why the last gradient round failed (None: it did not)
        self.last_received = 1.0  # the share of the last round's average that came back to this peer
        # the epoch the last global step ended: this peer's own, or the next one when its round was the next one's
        self.last_round_epoch: int | None = None
        self._resync_requested = False
        self._resync_reason: str | None = None
        self._loaded: tuple | None = None  # (epoch, seconds) of a state just loaded, until the next step's check
        self._parameters_from_swarm = False  # a state loaded (or an epoch adopted with it) since the last global step
        self._load_reason: str | None = None  # why a step decided to load the swarm's state, until it did
        # the loads steps decided on: dicts of problem, loaded, epoch_before, epoch_after, for the caller to take
        self.step_loads: list[dict] = []

    # a peer asked to resync takes no state averaging round: it would hand out diverged parameters, and its download
    # would wait for that round (tests/swarm/test_optim.py::
    # test_a_peer_apart_from_the_swarm_takes_no_state_round_before_it_loads_the_swarms_state)
    @property
    def average_state_every(self) -> int:
        if getattr(self, "_resync_requested", False):
            return NO_STATE_AVERAGING
        return self._average_state_every

    @average_state_every.setter
    def average_state_every(self, every: int) -> None:
        self._average_state_every = every

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        # hivemind.Optimizer._make_progress_tracker (1.1.12), with the counting tracker
        return SwarmProgressTracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )

    def load_state_from_peers(self, **kwargs) -> bool:
        """Download the newest parameters and optimizer state from a peer of the run (hivemind's method).

        :returns: True if a peer gave a state at this peer's epoch or later, which replaced the local one;
          False if no peer could (alone in the swarm, or every download failed): the local state is unchanged
        """
        self.state_averager.last_downloaded_epoch = None
        epoch_before = self.local_epoch
        control = self.scheduled_grads
        if control is not None and not control.done() and control.stage == AveragingStage.LOOKING_FOR_GROUP:
            # a round still looking for its group loses nothing by a cancel; tagging along would keep the averager busy
            control.cancel()
            self.scheduled_grads = None
        started = time.monotonic()
        reason, self._load_reason = self._load_reason, None
        if self.on_state_download is not None:
            self.on_state_download()
        super().load_state_from_peers(**kwargs)
        downloaded = self.state_averager.last_downloaded_epoch
        # hivemind refuses a state from an epoch behind this peer's (and keeps its own)
        loaded = downloaded is not None and downloaded >= epoch_before
        if loaded:
            self._loaded = (self.local_epoch, time.monotonic() - started)
            self._parameters_from_swarm = True
        if reason is not None:
            self.step_loads.append(
                dict(problem=reason, loaded=loaded, epoch_before=epoch_before, epoch_after=self.local_epoch)
            )
        return loaded

    def adopt_epoch(self, epoch: int, parameters_from_swarm: bool = False) -> None:
        """Go on at ``epoch`` with the parameters held now (hivemind's catching up, for any distance).

        :param parameters_from_swarm: whether those parameters are a state this peer just loaded from the swarm (they
          then count as the swarm's until its next global step, see _follow_round_epoch); False for parameters of
          its own (an anchor resuming from a checkpoint, or going on without a download)
        """
        self._parameters_from_swarm = parameters_from_swarm
        with self.tracker.pause_updates():
            self.state_averager.local_epoch = epoch
            self.tracker.report_local_progress(epoch, samples_accumulated=0)
            if not self.client_mode:
                self.state_averager.state_sharing_priority = epoch

    def _state_averager_class(self) -> type:
        """The state averager's class before the authorization gate (the local-update mode names it apart)."""
        return recording_state_averager_class()

    def sent_bytes(self) -> tuple[int, int]:
        """Bytes this peer's averagers have sent to other peers so far: its gradient (or pseudo-gradient) rounds, its
        state averaging rounds and the states it served to peers that downloaded them; and of those, the states served
        (collab_kit.swarm.averagers.SentBytesMixin). Read from the averagers' processes; once they have shut down, the
        last counts read."""
        sent = served = 0
        for name in ("grad_averager", "state_averager"):
            averager = getattr(self, name, None)
            if averager is not None:
                averager_sent, averager_served = averager.bytes_sent()
                sent, served = sent + averager_sent, served + averager_served
        return sent, served

    @property
    def bytes_sent(self) -> int:
        """Every byte this peer's averagers have sent to other peers so far (see ``sent_bytes``)."""
        return self.sent_bytes()[0]

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        """hivemind's state averager, which remembers what it downloads (DownloadRecorderMixin); in an authorized
        run, one that lets only bound peers download the state or average parameters with it
        (collab_kit.swarm.bindings.AuthorizedAveragerMixin)."""
        averager_class = self._state_averager_class()
        if self.peer_gate is not None:
            averager_class = authorized_averager_class(averager_class, self.peer_gate)
        # rounds keep hivemind's timeouts; only a download's next part waits STATE_DOWNLOAD_PART_TIMEOUT
        round_timeouts = dict(sender_timeout=self.next_chunk_timeout, reducer_timeout=2 * self.next_chunk_timeout)
        round_timeouts.update(kwargs)
        return averager_class(
            dht=self.dht,
            prefix=state_averager_prefix(self.run_id),
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=max(self.next_chunk_timeout, STATE_DOWNLOAD_PART_TIMEOUT),
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **round_timeouts,
        )

    # hivemind 1.1.12 (pinned in pyproject): these hooks are methods of hivemind.Optimizer
    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        # every global step passes here (alone too): what the last round did is reset to "local gradients only"
        self.last_group_size = int(self.round_role != ANCHOR_ROLE)
        self.last_anchors_in_group, self.last_round_problem, self.last_received = 0, None, 1.0
        self.last_round_epoch = self.local_epoch
        began = self._trigger_gradient_round(grad_scaler)
        if began and self.on_averaging_start is not None:
            control = self.scheduled_grads  # the round just triggered (hivemind's StepControl)
            self.on_averaging_start(self.local_epoch, control.stage.name.lower() if control is not None else "unknown")
        return began

    def _trigger_gradient_round(self, grad_scaler) -> bool:
        """Start this epoch's gradient round (hivemind's way: the pre-scheduled group, or a new search)."""
        return super()._begin_averaging_gradients(grad_scaler)

    def _maybe_schedule_gradient_averaging(self) -> None:
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_gradient_averaging()

    def _maybe_schedule_state_averaging(self) -> None:
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_state_averaging()

    # the one place where a gradient round's outcome is known in the trainer's process
    def _average_gradients_and_load_into_optimizer(self, maybe_step_control):
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        parameters_from_swarm, self._parameters_from_swarm = self._parameters_from_swarm, False
        if maybe_step_control is None:
            return  # alone in the swarm: nothing to average
        result = RoundResult()  # what the round's members said, when it finished
        if not maybe_step_control.done() or maybe_step_control.cancelled():
            self.last_round_problem = "the averaging round did not finish"
        elif maybe_step_control.exception() is not None:
            error = maybe_step_control.exception()
            self.last_round_problem = str(error) or type(error).__name__
        else:
            gathered = maybe_step_control.result() or {}
            result = gathered if isinstance(gathered, RoundResult) else RoundResult(gathered)
            roles = result.roles()  # this peer's own role is among them
            self.last_anchors_in_group = sum(role == ANCHOR_ROLE for role in roles) - (self.round_role == ANCHOR_ROLE)
            self.last_group_size = sum(role != ANCHOR_ROLE for role in roles)  # a peer of another kit counts as one
            self.last_received = float(getattr(result, "received", 1.0))
            if self.last_received < 1.0:
                share = f"{self.last_received:.1%}" if self.last_received < 0.9995 else "not all"
                self.last_round_problem = (
                    f"only {share} of the average came back (a peer that reduces part of it "
                    f"failed, or gave up waiting for this one)"
                )
        others = self.last_group_size - (self.round_role != ANCHOR_ROLE)
        if others >= 1 and self.last_received >= 0.5:
            self.averaged_rounds += 1
        # a step apart from the swarm's (failed or partial round, or alone while others trained): load the state next
        diverged = self.last_round_problem is not None or (
            others == 0 and self.last_anchors_in_group == 0 and self.tracker.training_peers > 1
        )
        if diverged and self.round_role != ANCHOR_ROLE:
            self._resync_requested = True
        elif self.round_role != ANCHOR_ROLE and self.last_round_problem is None:
            self._follow_round_epoch(result, parameters_from_swarm)

    def _follow_round_epoch(self, result: RoundResult, parameters_from_swarm: bool) -> None:
        """After a round that averaged: a peer whose group was at a later epoch took part in that epoch's round, and
        ends that epoch with the others (hivemind's step adds one to the epoch set here).

        Only a peer holding the swarm's parameters (loaded since its last step) follows; one with parameters of its own
        missed a step, and loads the swarm's state instead. Shown by tests/swarm/test_optim.py::
        test_a_peer_whose_group_was_at_the_next_epoch_ends_that_epoch_with_the_others_if_it_holds_their_state."""
        if result.epoch() != self.local_epoch + 1:  # one epoch ahead only: the reading lags by a moment, no more
            return
        if not parameters_from_swarm:
            logger.info(
                f"this peer's round was the swarm's round of epoch {self.local_epoch + 1} (this peer was at "
                f"{self.local_epoch}, with parameters of its own): it stays a round behind and loads the "
                f"swarm's state"
            )
            return
        logger.info(
            f"this peer's round was the swarm's round of epoch {self.local_epoch + 1} (this peer was at "
            f"{self.local_epoch}): it ends that epoch with the others"
        )
        # not adopt_epoch: hivemind's step, under way, reports the epoch it ends at (this one plus one)
        self.state_averager.local_epoch += 1
        self.last_round_epoch = self.local_epoch  # the epoch this step ends: what its losses are reported under

    def request_resync(self, reason: str) -> None:
        """Load the swarm's state at the next step (safe to call from another thread): this peer's parameters may no
        longer be the swarm's."""
        self._resync_reason = reason
        self._resync_requested = True

    def serve_state_to_anchors(self, swarm: SwarmConfig) -> None:
        """In client mode, let the peers this one joined through and the run's anchors in the DHT now download its
        state: an anchor started again takes the newest state from the volunteers behind NAT, and an anchor that only
        reduces serves theirs (direct_state.DirectStateMixin)."""
        if not swarm.client_mode:
            return
        if not self._reads_anchor_records:
            self.dht.add_validators(anchor_validators(swarm.run_id))  # the anchors' records are signed
            self._reads_anchor_records = True
        try:
            anchors = initial_peer_ids(
                [address for each in read_anchor_addresses(self.dht, swarm.run_id) for address in each]
            )
        except Exception as e:  # a busy link: the join line's anchors still read it, the next call tries again
            logger.debug(f"the run's anchors could not be read: {e!r}")
            anchors = []
        self.state_averager.serve_state_to([*initial_peer_ids(swarm.initial_peers), *anchors])

    _reads_anchor_records = False  # whether this peer's DHT validates the anchors' records (serve_state_to_anchors)

    # a round runs in the background only in the local-update mode, with overlap_rounds (collab_kit.swarm.local_updates)
    @property
    def epoch_in_flight(self) -> int | None:  # the epoch of the round averaging in the background, if any
        return None

    overlapped_steps = 0  # local steps taken while a round of this peer averaged in the background

    def finish_round_in_flight(self) -> None:
        """Wait for the round averaging in the background, if any, and take its step (a peer that stops)."""

    def shutdown(self) -> None:
        """hivemind's shutdown, after this peer cancels its rounds still looking for a group itself.

        hivemind cancels such a round without asking whether it is done. A round that the state averager's thread, or
        ``cancel_pending_round``, already cancelled would be cancelled twice and raise InvalidStateError, and the peer
        would exit with an error after a whole run
        (tests/swarm/test_optim.py::test_a_round_already_cancelled_is_not_cancelled_again_at_shutdown).
        """
        for name in ("scheduled_grads", "scheduled_state"):
            control = getattr(self, name, None)
            if control is None or not (control.done() or control.stage == AveragingStage.LOOKING_FOR_GROUP):
                continue
            if not control.done():
                try:
                    control.cancel()
                except InvalidStateError:  # cancelled meanwhile by another thread: nothing left to cancel
                    pass
            setattr(self, name, None)
        super().shutdown()

    def cancel_pending_round(self) -> bool:
        """Give up the gradient round under way or scheduled, if any (safe to call from another thread): the step that
        waits for it goes on with this peer's own gradients at once, instead of at the round's timeout. Returns whether
        a round was cancelled."""
        control = self.scheduled_grads
        if control is None or control.done():
            return False
        return bool(control.cancel())

    def _should_load_state_from_peers(self) -> bool:
        self._load_reason = None  # set by _wants_swarm_state for the load that hivemind's step makes when this is True
        if (
            self._loaded is not None
            and self._loaded[0] == self.local_epoch > self.tracker.global_epoch
            and not self._resync_requested
        ):
            # the state just loaded is newer than the tracker's last reading: no new download until it reads the swarm
            # again. Shown by tests/swarm/test_optim.py::
            # test_a_peer_just_loaded_does_not_download_again_before_it_has_read_the_swarms_progress
            return False
        wanted = self._wants_swarm_state()
        loaded, self._loaded = self._loaded, None
        if wanted and loaded is not None and loaded[0] == self.local_epoch < self.tracker.global_epoch:
            # the swarm moved on during the download: go on at its epoch, a few updates short, rather than download
            # again (on a slow link every epoch would go to downloading)
            epoch, seconds = loaded
            logger.warning(
                f"the swarm moved from epoch {epoch} to {self.tracker.global_epoch} while this peer "
                f"downloaded its state ({seconds:.0f} s): it goes on at epoch {self.tracker.global_epoch} "
                f"without downloading again (its parameters miss {self.tracker.global_epoch - epoch} "
                f"update(s))"
            )
            self.adopt_epoch(self.tracker.global_epoch, parameters_from_swarm=True)  # the download's, a few behind
            self._load_reason = None  # no load follows
            return False
        if wanted and self._load_reason is None:
            self._load_reason = f"the swarm was at epoch {self.tracker.global_epoch}, this peer at {self.local_epoch}"
        return wanted

    def _wants_swarm_state(self) -> bool:
        """Whether this peer's parameters are behind or apart from the swarm's (hivemind's rule and the kit's)."""
        if self._resync_requested:
            self._resync_requested = False
            reason = self._resync_reason or (
                f"its last global step was not the swarm's ({self.last_round_problem or 'no group'})"
            )
            self._resync_reason = None
            logger.info(f"this peer loads the swarm's state: {reason}")
            self._load_reason = reason
            return True
        if self.client_mode and self.tracker.anchor_peers > 0 and self.local_epoch < self.tracker.global_epoch:
            # in client mode the swarm's epoch is the anchor's, which moves on only after its round: a peer behind it
            # missed that round (hivemind's one-epoch leeway would keep it an update behind for good)
            self._load_reason = (
                f"the anchor was at epoch {self.tracker.global_epoch}, this peer at "
                f"{self.local_epoch} (it missed a round)"
            )
            logger.info(f"this peer loads the swarm's state: {self._load_reason}")
            return True
        return super()._should_load_state_from_peers()


def make_optimizer(
    model: torch.nn.Module,
    dht: hivemind.DHT,
    run_id: str,
    config: OptimizerConfig,
    client_mode: bool = False,
    verbose: bool = False,
    peer_gate=None,
    optimizer_class: type[CollaborativeOptimizer] = CollaborativeOptimizer,
    **kwargs,
) -> CollaborativeOptimizer:
    """Build the collaborative optimizer for ``model``, connected to the swarm through ``dht``.

    :param model: the model whose parameters the swarm trains
    :param dht: this peer's DHT (see collab_kit.swarm.dht.start_dht)
    :param run_id: peers with the same run_id train together; others ignore each other
    :param config: hyperparameters (collab_kit.config.OptimizerConfig)
    :param client_mode: True if this peer cannot accept incoming connections
    :param verbose: log each stage of every global step
    :param peer_gate: in an authorized run, a collab_kit.swarm.bindings.PeerGate: the gradient and state averagers then
      serve only peers bound to a valid access token
    :param optimizer_class: CollaborativeOptimizer or a subclass (collab_kit.swarm.anchor.AnchorOptimizer); with
      ``config.local_steps`` > 0, it is put in local-update mode (collab_kit.swarm.local_updates.with_local_updates)
    :param kwargs: passed to hivemind.Optimizer (for instance ``grad_averager_factory``, which then replaces the
        one ``config.aggregation`` chooses)
    """
    # a peer in client mode leads no group, so a long request cannot deadlock: its wait is set by the link
    request_timeout = CLIENT_JOIN_ANSWER_TIMEOUT if client_mode else min(3.0, config.matchmaking_time / 2)
    averager_class = mode_averager_class(
        round_report_averager_class(GradientAverager, optimizer_class.round_role), config
    )
    mode_settings = {}
    if config.local_updates:  # collab_kit.swarm.local_updates: DiLoCo's rounds on the same averagers
        mode_settings = local_update_kwargs(config)
        if optimizer_class.round_role != ANCHOR_ROLE:
            mode_settings["inner_param_groups"] = parameter_groups(model, config.weight_decay)
        optimizer_class = with_local_updates(optimizer_class, config)
    if peer_gate is not None:
        averager_class = authorized_averager_class(averager_class, peer_gate)
    averager_kwargs = dict(
        request_timeout=request_timeout,
        # local-update mode: the pseudo-gradient is computed on the CPU, no second device copy of the model
        **(dict(accumulate_grads_on=torch.device("cpu")) if config.local_updates else {}),
        # a download of the state need not carry the last averaged gradients (nothing uses them)
        allow_state_sharing=False,
    )
    if client_mode:
        # its reducer (the anchor) returns a first part only when every member's is in: the round's deadline holds
        averager_kwargs["reducer_timeout"] = max(config.averaging_timeout, 2 * config.chunk_timeout)
    if optimizer_class.round_role == ANCHOR_ROLE:
        # the anchor reduces every volunteer's whole vector over slow links: a stalled sender gets more time
        averager_kwargs["sender_timeout"] = max(config.chunk_timeout, config.averaging_timeout / 2)
    kwargs.setdefault(
        "grad_averager_factory",
        robust.grad_averager_factory(
            config.aggregation, config.clip_tau, config.clip_iterations, averager_class, **averager_kwargs
        ),
    )
    settings = dict(
        peer_gate=peer_gate,
        dht=dht,
        run_id=run_id,
        target_batch_size=config.target_batch_size,
        batch_size_per_step=config.batch_size_per_step,
        params=parameter_groups(model, config.weight_decay),
        optimizer=swarm_optimizer_factory(config),  # 8-bit LAMB, or the outer SGD in local-update mode
        scheduler=swarm_scheduler_factory(config),
        offload_optimizer=config.offload_optimizer,
        delay_optimizer_step=config.delay_optimizer_step,
        delay_grad_averaging=False,
        average_state_every=config.average_state_every,
        grad_compression=gradient_compression(config.compression_threshold, config.pseudo_gradient_bits),
        state_averaging_compression=Float16Compression() if config.state_compression == "fp16" else NoCompression(),
        matchmaking_time=config.matchmaking_time,
        averaging_timeout=config.averaging_timeout,
        next_chunk_timeout=config.chunk_timeout,
        load_state_timeout=config.load_state_timeout,
        averager_opts=dict(request_timeout=request_timeout),
        tracker_opts=dict(
            default_refresh_period=config.progress_refresh_period,
            min_refresh_period=config.progress_refresh_period / 6,
            max_refresh_period=config.progress_refresh_period * 10 / 3,
            min_report_period=config.progress_refresh_period / 2,
        ),
        client_mode=client_mode,
        verbose=verbose,
    )
    return optimizer_class(**{**settings, **mode_settings, **kwargs})
