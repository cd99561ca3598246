"""The anchor: the public peer that volunteers behind NAT average through and load the swarm's state from.

hivemind's client-mode averagers only join groups in which some peer accepts connections, so volunteers all behind
NAT form no group. The anchor is a training peer that contributes no samples and accepts connections:

- while some training peer is in client mode, it joins every gradient round with weight 0 and reduces; otherwise it
  stands by;
- it applies the averaged gradients, so late joiners and the monitor's checkpoints take the swarm's state from it
  (beside another anchor it only reduces: ``reduces_only``);
- its progress record has a throughput of exactly 0, and sets the global epoch for peers in client mode;
- it tells each group it is an anchor, so a volunteer with no other trainer knows it trained alone.

``collab-kit monitor`` starts one (collab_kit.roles.monitor). Its link carries about 2 x volunteers x the compressed
gradients per global step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import hivemind
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.utils import get_dht_time

from collab_kit.config import RunConfig
from collab_kit.errors import CollabKitError
from collab_kit.model.transformer import initial_model
from collab_kit.swarm.averagers import ANCHOR_ROLE
from collab_kit.swarm.optimizer import CollaborativeOptimizer, make_optimizer
from collab_kit.swarm.progress import SwarmProgressTracker

logger = logging.getLogger(__name__)


class AnchorError(CollabKitError, RuntimeError):
    """The anchor cannot work here (the message says what to do)."""


class AnchorProgressTracker(SwarmProgressTracker):
    """The anchor's progress record: published although it accumulates no samples, with a throughput of exactly 0.

    hivemind publishes a record only once samples are accumulated; for peers in client mode the anchor's sets the
    global epoch, so it must be there all the time.
    """

    @property
    def trainers_epoch(self) -> int:
        """The highest epoch a training peer reports."""
        return max((epoch for _, epoch in self.trainer_records), default=0)

    @property
    def ready_to_update_epoch(self) -> bool:
        """The anchor follows the training peers: its epoch ends when they have accumulated the target batch, when one
        of them has moved on, or at the estimated end of an epoch to which they have contributed samples.

        An anchor ending an empty epoch at its estimated time would run ahead of late peers, taking client-mode peers
        with it.
        """
        progress = self.global_progress
        return (
            progress.samples_accumulated >= self.target_batch_size
            or max(self.global_epoch, self.trainers_epoch) > self.local_progress.epoch
            or (progress.samples_accumulated > 0 and get_dht_time() >= progress.eta_next_epoch)
        )

    def trainers_in_epoch(self, epoch: int) -> list[bytes]:
        """The training peers expected in the round of ``epoch`` (their ids): those whose record is at that epoch or one
        before it (a record lags its peer by a report, so a peer that has just moved on may still show the epoch
        before). A peer further behind loads the swarm's state instead of joining this round."""
        return [peer_id for peer_id, trainer_epoch in self.trainer_records if trainer_epoch >= epoch - 1]

    def _get_local_progress(self, local_epoch: int, samples_accumulated: int):
        return super()._get_local_progress(local_epoch, samples_accumulated).copy(update=dict(samples_per_second=0.0))

    leading = False  # whether the anchor takes part in the swarm's rounds (AnchorOptimizer.leads_rounds)

    def set_leading(self, leading: bool) -> None:
        """Publish the anchor's record while it leads rounds, withdraw it while it stands by: a record counts as a peer
        in hivemind's reading of the swarm, and a peer that believes it has company looks for an averaging group."""
        if leading != self.leading:
            self.leading = leading
            self.should_report_progress.set()

    async def _progress_reporter(self):
        """Publish the record when it changes (a new epoch, leading or not) and before it expires (hivemind's
        cadence); while the anchor stands by, its record is withdrawn (stored as None, as hivemind does at shutdown)."""
        loop = asyncio.get_event_loop()
        withdrawn = True  # nothing published yet
        while not self.shutdown_triggered.is_set():
            if self.leading or not withdrawn:
                expiration_time = get_dht_time() + self.metadata_expiration
                value = self.local_progress.dict() if self.leading else None
                try:
                    await asyncio.wait_for(
                        self.dht.store(
                            key=self.training_progress_key,
                            subkey=self._local_public_key,
                            value=value,
                            expiration_time=expiration_time,
                            return_future=True,
                        ),
                        timeout=self.metadata_expiration,
                    )
                    withdrawn = value is None
                except Exception as e:  # a busy or cut link: the next report comes as usual
                    logger.debug(f"the anchor could not publish its progress: {e!r}")
            await loop.run_in_executor(None, self.should_report_progress.wait, self.metadata_expiration / 2)
            self.should_report_progress.clear()


def state_sources(trainer_records, epoch: int) -> tuple[bytes, ...]:
    """The training peers whose state an anchor that only reduces serves for them, the newest first: those whose record
    is at the swarm's ``epoch`` or a report behind it. A joiner that has not loaded the state yet is further behind: its
    initial parameters, relayed, would be handed back to joiners as the swarm's
    (tests/swarm/test_optim.py::test_an_anchor_serves_no_state_older_than_the_swarms).

    :param trainer_records: (peer id, local epoch) of each training peer's progress record
    :param epoch: the swarm's epoch, as the anchor holds it
    """
    current = [(peer_id, peer_epoch) for peer_id, peer_epoch in trainer_records if peer_epoch >= epoch - 1]
    return tuple(peer_id for peer_id, _ in sorted(current, key=lambda record: -record[1]))


class AnchorOptimizer(CollaborativeOptimizer):
    """A CollaborativeOptimizer that contributes no samples: it averages with weight 0 and steps like the others.

    Non-finite averaged gradients (a round of weight 0) are zeroed before the step; a round no training peer reached
    leaves its parameters as they are. Beside another anchor it only reduces (``reduces_only``, half the traffic) and
    serves the training peers' state (tests/swarm/test_robust.py::test_an_auxiliary_anchor_only_reduces).

    :param retry_state_every: seconds between two tries to download the swarm's state when the anchor is behind
    """

    round_role = ANCHOR_ROLE
    other_anchors = 0  # live anchors of the run besides this one (Anchor.set_other_anchors)
    state_is_swarms = True  # whether its parameters and optimizer state are the swarm's (not after reducing only)
    keeps_state = False  # whether nobody else holds the swarm's state (it took a checkpoint when nobody did)
    last_round_reduced_only = False  # whether its last round was announced as reducing only

    @property
    def reduces_only(self) -> bool:
        """Whether its next round only reduces (hivemind's auxiliary mode: nothing of its own out, nothing back): beside
        another anchor, unless nobody else holds the swarm's state (``keeps_state``), and while its state is not it."""
        return not self.state_is_swarms or (self.other_anchors > 0 and not self.keeps_state)

    def choose_round_mode(self) -> None:
        """Announce ``reduces_only`` in the next round's all-gather (read when a round is scheduled; every member's
        runner takes each member's announced mode: collab_kit.swarm.runners.RunnerChoiceMixin.round_modes)."""
        self.grad_averager.mode = AveragingMode.AUX if self.reduces_only else AveragingMode.NODE

    def _round_only_reduced(self, control: StepControl | None) -> bool:
        if control is None:
            return False
        _, mode, _ = self.grad_averager.serializer.loads(control.data_for_gather)
        return AveragingMode(mode) == AveragingMode.AUX

    def _serve_training_peers_state(self) -> None:
        """Serve the state of the training peers at the swarm's epoch (``state_sources``); with none, serve nothing (its
        own is not the swarm's)."""
        sources = state_sources(self.tracker.trainer_records, self.local_epoch)
        if sources == self._state_sources_sent:
            return
        self._state_sources_sent = sources
        if sources:
            self.state_averager.serve_state_of(sources)
        self.state_averager.allow_state_sharing = bool(sources)

    _state_sources_sent: tuple | None = None  # the training peers whose state it serves, as last sent

    def take_own_state(self, only_holder: bool = False) -> None:
        """Its parameters are the swarm's again: it serves them. ``only_holder`` (a checkpoint taken when nobody held
        the swarm's state): it keeps them, and takes whole rounds, until a round's training peers hold them too."""
        self.keeps_state = self.keeps_state or only_holder
        if not self.state_is_swarms:
            self.state_is_swarms, self._state_sources_sent = True, None
            self.state_averager.serve_state_of([])
            self.state_averager.allow_state_sharing = True

    def follow_training_peers(self) -> None:
        """While its state is not the swarm's, keep serving the state of the training peers there are now."""
        if not self.state_is_swarms:
            self._serve_training_peers_state()

    def __init__(self, retry_state_every: float = 30.0, **kwargs):
        self.retry_state_every = retry_state_every
        self._next_state_attempt = 0.0
        self.dropped_rounds = 0  # rounds whose averaged gradients were not finite (set to zero instead)
        self._triggered_early = None  # the round the anchor let start as soon as its group formed
        self.state_loads: list[tuple[int, int]] = []  # (epoch before, epoch after) of each newer state it took
        super().__init__(**kwargs)

    @property
    def leads_rounds(self) -> bool:
        """Whether the swarm needs the anchor in its gradient rounds: some training peer is in client mode, and can
        average only in a group that a peer accepting connections leads. While every training peer accepts
        connections, hivemind's own matchmaking needs no anchor, which then stands by (``stand_by``)."""
        return self.tracker.client_mode_trainers > 0

    def stand_by(self) -> None:
        """Take no part in rounds: give up a scheduled one and withdraw the progress record."""
        self.tracker.set_leading(False)
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self.scheduled_grads.cancel()
        self.scheduled_grads = self._triggered_early = None

    def trigger_formed_round(self) -> None:
        """Let the round start as soon as its group has formed: the anchor adds nothing (weight 0), and its members
        would otherwise wait for its reading of the swarm, and give up after next_chunk_timeout."""
        self.tracker.set_leading(True)
        control = self.scheduled_grads
        if control is None or control.triggered or control.done() or control.stage != AveragingStage.AWAITING_TRIGGER:
            return
        self.grad_averager.load_accumulators_into_averager_()  # zeros: the anchor accumulates nothing
        control.weight = 0.0
        control.allow_allreduce()
        self._triggered_early = control

    @property
    def early_round_pending(self) -> bool:
        """Whether this epoch's round was started when its group formed (``trigger_formed_round``) and the epoch has not
        ended with it yet."""
        return self.scheduled_grads is not None and self.scheduled_grads is self._triggered_early

    def _trigger_gradient_round(self, grad_scaler) -> bool:
        if self.early_round_pending:
            self._triggered_early = None
            return True  # started when its group formed (trigger_formed_round)
        return super()._trigger_gradient_round(grad_scaler)

    def _make_progress_tracker(self, target_batch_size: int, **kwargs):
        return AnchorProgressTracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )

    def _maybe_schedule_gradient_averaging(self) -> None:
        """hivemind's pre-scheduling, with a group that waits for the training peers at this epoch or the one before
        (counted afresh at every tick) and the run's other anchors (RoundReportMixin.expect_peers); at the latest
        ``next_chunk_timeout`` after the later of the estimated end and matchmaking_time from now."""
        if self.early_round_pending:
            # the early round stays this epoch's until the epoch ends; a round scheduled now would replace it
            return
        if self.tracker.global_progress.num_peers <= 1:
            return
        now, estimated_end = get_dht_time(), self.tracker.estimated_next_update_time
        if estimated_end - now > self.matchmaking_time:
            return
        anchors = [peer for peer, epoch in self.tracker.other_anchor_records if epoch >= self.local_epoch - 1]
        self.grad_averager.expect_peers(
            self.tracker.trainers_in_epoch(self.local_epoch), anchors, co_anchor_wait=self.matchmaking_time
        )
        if self.scheduled_grads is None or self.scheduled_grads.triggered or self.scheduled_grads.done():
            scheduled_time = max(estimated_end, now + self.matchmaking_time) + self.next_chunk_timeout
            self.scheduled_grads = self.grad_averager.schedule_step(
                scheduled_time=scheduled_time, timeout=self.averaging_timeout
            )

    def _check_and_accumulate_gradients(self, batch_size: int, grad_scaler) -> bool:
        return True  # nothing to accumulate: the anchor's share of every round is 0 samples

    @property
    def swarm_epoch(self) -> int:
        """The epoch of the swarm: hivemind's global epoch, or a training peer's when they are ahead (peers in client
        mode do not count in hivemind's)."""
        return max(self.tracker.global_epoch, self.tracker.trainers_epoch)

    def _should_load_state_from_peers(self) -> bool:
        if self.local_epoch >= self.swarm_epoch or time.monotonic() < self._next_state_attempt:
            return False
        if self.early_round_pending:
            # this epoch's round is under way or over: the epoch ends with it
            return False
        self._next_state_attempt = time.monotonic() + self.retry_state_every
        return True

    def load_state_from_peers(self, **kwargs) -> bool:
        """Download the swarm's state, first from the training peers ahead (DirectStateMixin), then from hivemind's
        sharers; when nobody gives it, take the swarm's epoch with the anchor's own parameters."""
        epoch_before = self.local_epoch
        ahead = sorted(
            (record for record in self.tracker.trainer_records if record[1] > epoch_before),
            key=lambda record: -record[1],
        )
        if ahead:
            self.state_averager.download_first_from([peer_id for peer_id, _ in ahead])
        loaded = super().load_state_from_peers(**kwargs)
        if loaded:
            self.take_own_state()
        if loaded and self.local_epoch > epoch_before:
            self.state_loads.append((epoch_before, self.local_epoch))
            logger.info(
                f"the anchor resumes from the state of epoch {self.local_epoch}, the swarm's newest (it held "
                f"epoch {epoch_before})"
            )
        if not loaded and self.local_epoch < self.swarm_epoch:
            logger.warning(
                f"no peer shares the swarm's state: the anchor goes on at the swarm's epoch "
                f"{self.swarm_epoch} with its own parameters (from epoch {self.local_epoch})"
            )
            self.adopt_epoch(self.swarm_epoch)
        return loaded

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control):
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        self.last_round_reduced_only = self._round_only_reduced(maybe_step_control)
        if self.last_round_reduced_only:
            # it got no average back: a step would move its state away from the swarm's, which it no longer holds
            self.state_averager.optimizer.hold_next_step()
            if self.state_is_swarms:
                self.state_is_swarms = False
                logger.info("another anchor shares the rounds: this one only reduces and serves the peers' state")
            self._serve_training_peers_state()
            return
        if self.last_group_size == 0 or self.last_round_problem is not None:
            # no training peer's gradients reached it: a step on zeros would still move it (momentum, weight decay)
            self.state_averager.optimizer.hold_next_step()
            return
        if self.keeps_state:  # the training peers of this whole round take the same step: they hold the state too
            self.keeps_state = False
        with torch.no_grad(), self.grad_averager.get_tensors() as averaged:
            if not all(bool(torch.isfinite(tensor).all()) for tensor in averaged):
                self.dropped_rounds += 1
                logger.warning(
                    f"the averaged gradients of epoch {self.local_epoch} are not finite (a round whose "
                    f"peers all had weight 0): the anchor steps without them"
                )
                for tensor in averaged:
                    tensor.zero_()


class Anchor:
    """Runs an AnchorOptimizer in a thread of its own: a step every ``tick`` seconds, rounds as the swarm makes them.

    Build it in the main thread (hivemind's averagers start processes that inherit signal handlers), then
    ``start()``; ``snapshot()`` gives the parameters between two steps, ``shutdown()`` leaves the swarm.

    :param config: the run's configuration: model and optimizer must be the volunteers'
    :param dht: this peer's DHT; it must accept connections (not client mode)
    :param peer_gate: in an authorized run, a collab_kit.swarm.bindings.PeerGate (only bound peers average through it)
    :param tick: seconds between two steps (how soon it notices the end of an epoch)
    :param on_round: called with (epoch, training peers in the group, problem or None) after each gradient round
    :param on_state: called with (the epoch it held, the epoch of the state) when it takes a newer state from the swarm
      (after a restart: the volunteers', who trained on meanwhile)
    :raises AnchorError: the DHT is in client mode
    """

    def __init__(
        self,
        config: RunConfig,
        dht: hivemind.DHT,
        peer_gate=None,
        tick: float = 0.1,
        on_round: Callable[[int, int, str | None], None] | None = None,
        on_state: Callable[[int, int], None] | None = None,
    ):
        if dht.client_mode:
            raise AnchorError(
                "an anchor must accept connections, and this peer is in client mode: run it on a "
                "machine others can dial (a public address, or a forwarded port)"
            )
        self.config, self.tick, self.on_round, self.on_state = config, tick, on_round, on_state
        self.model = initial_model(config.model, config.swarm.run_id)  # the volunteers' initial parameters
        self.optimizer: AnchorOptimizer = make_optimizer(
            self.model,
            dht,
            config.swarm.run_id,
            config.optimizer,
            client_mode=False,
            peer_gate=peer_gate,
            optimizer_class=AnchorOptimizer,
        )
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rounds = 0  # gradient rounds that held at least one training peer

    @property
    def local_epoch(self) -> int:
        return self.optimizer.local_epoch

    def set_other_anchors(self, count: int) -> None:
        """How many live anchors the run has besides this one (the monitor reads them at each poll): with one or more,
        this one's rounds only reduce (AnchorOptimizer.reduces_only)."""
        self.optimizer.other_anchors = count

    @property
    def lost_the_swarms_state(self) -> bool:
        """Whether it only reduced and no training peer is left to give the swarm's state: nobody holds it now, and the
        run goes on from the newest checkpoint (the monitor's ``_resume_anchor``)."""
        return not self.optimizer.state_is_swarms and not self.optimizer.tracker.trainer_records

    def resume_from(self, parameters: dict[str, torch.Tensor], epoch: int) -> None:
        """Start from a checkpoint of this run (the monitor's newest) when nobody else holds the swarm's state. The
        optimizer's statistics start anew; its epoch never goes back."""
        with self._lock:
            self._resume_from(parameters, max(epoch, self.local_epoch))
            self.optimizer.take_own_state(only_holder=True)

    def _resume_from(self, parameters: dict[str, torch.Tensor], epoch: int) -> None:
        averager = self.optimizer.state_averager
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.copy_(parameters[name])
            # the offloaded copy the optimizer steps on and shares (hivemind 1.1.12 keeps it beside the model's own)
            for main, offloaded in zip(averager.main_parameters, averager._averaged_parameters):
                offloaded.copy_(main)
        self.optimizer.adopt_epoch(epoch)
        logger.info(f"the anchor resumes from the checkpoint of epoch {epoch}")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="collab_kit-anchor")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    self.optimizer.follow_training_peers()
                    if not self.optimizer.leads_rounds:
                        self.optimizer.stand_by()
                    else:
                        epoch, loads = self.local_epoch, len(self.optimizer.state_loads)
                        self.optimizer.choose_round_mode()
                        self.optimizer.trigger_formed_round()
                        self.optimizer.step()
                        if len(self.optimizer.state_loads) != loads:  # a step that loads the state takes no round
                            self._report_state(*self.optimizer.state_loads[-1])
                        elif self.local_epoch != epoch:
                            self._report_round(epoch)
            except Exception as e:  # the swarm goes on: the next step tries again
                logger.warning(
                    f"the anchor's step failed ({type(e).__name__}: {e}); it goes on",
                    exc_info=logger.isEnabledFor(logging.DEBUG),
                )
            self._stop.wait(self.tick)

    def _report_round(self, epoch: int) -> None:
        trainers, problem = self.optimizer.last_group_size, self.optimizer.last_round_problem
        if trainers:
            self.rounds += 1
            logger.info(f"anchor: epoch {epoch} averaged the gradients of {trainers} training peer(s)")
        elif problem:
            logger.info(f"anchor: no round at epoch {epoch} ({problem})")
        if self.on_round is not None:
            self.on_round(epoch, trainers, problem)

    def _report_state(self, held_epoch: int, epoch: int) -> None:
        if self.on_state is not None:
            self.on_state(held_epoch, epoch)

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The swarm's parameters as the anchor holds them between two steps (a pending update applied) and their
        global epoch; an anchor that stands by (every training peer accepts connections) downloads them first, and one
        that only reduces gives the training peers' (AnchorOptimizer.reduces_only).

        :raises AnchorError: the anchor only reduces and no training peer gave its state"""
        with self._lock:
            optimizer = self.optimizer
            if not optimizer.state_is_swarms:
                return self._training_peers_snapshot()
            if not optimizer.leads_rounds and optimizer.local_epoch < optimizer.swarm_epoch:
                loads = len(optimizer.state_loads)
                optimizer.load_state_from_peers()
                if len(optimizer.state_loads) != loads:
                    self._report_state(*optimizer.state_loads[-1])
            optimizer.state_averager.step(wait_for_delayed_updates=True, apply_delayed_updates=True)
            return self.local_epoch, {name: param.detach().clone() for name, param in self.model.named_parameters()}

    def _training_peers_snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        averager = self.optimizer.state_averager
        served = averager.served_state(timeout=self.config.optimizer.load_state_timeout)
        if served is None:
            raise AnchorError("no training peer gave its state to the anchor, which only reduces: the next try may")
        metadata, tensors = served
        names = {id(param): name for name, param in self.model.named_parameters()}
        parameters = dict(zip((names[id(param)] for param in averager.main_parameters), tensors))
        own = dict(self.model.named_parameters())
        if len(parameters) != len(own) or any(parameters[name].shape != own[name].shape for name in own):
            raise AnchorError("the state a training peer gave does not fit this run's model")
        return int(metadata["epoch"]), {name: tensor.detach().clone() for name, tensor in parameters.items()}

    def shutdown(self) -> None:
        """Stop stepping and leave the swarm (safe to call twice)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.optimizer.averaging_timeout + 10)
            self._thread = None
        self.optimizer.shutdown()
