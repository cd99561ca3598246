"""What a volunteer reports of each global epoch: its record (loss, samples, the round that ended it), the warning
when it trains alone while others train, and its metrics for the monitor. A mixin of collab_kit.roles.volunteer
.Volunteer, whose attributes (optimizer, config, metrics, plan, _lone_watch, _undialable) it reads."""

from __future__ import annotations

import logging
from collections.abc import Callable

from collab_kit.roles.records import EpochRecord, LoneWarning, TrainingHistory

logger = logging.getLogger(__name__)


class EpochReportsMixin:
    """Put before the volunteer's other bases: its epoch records, lone-training warnings and metrics."""

    def _epoch_record(self, epoch_before: int, rounds_before: int, losses: list[float], seconds: float) -> EpochRecord:
        """What this peer saw of the global epoch its last step ended: its loss, samples, and the round that ended
        it."""
        optimizer = self.optimizer
        averaged = optimizer.averaged_rounds > rounds_before
        # an epoch that ended by loading the swarm's state (this peer was behind) had no round of its own; a round of
        # the swarm's next epoch ended that one (this peer's losses went into its gradients)
        if averaged or optimizer.last_round_epoch in (epoch_before, epoch_before + 1):
            return self._record(
                optimizer.last_round_epoch,
                losses,
                seconds,
                averaged,
                optimizer.last_group_size,
                optimizer.last_anchors_in_group,
                optimizer.last_round_problem,
            )
        return self._record(epoch_before, losses, seconds, averaged, 1, 0, "this peer was behind the swarm")

    def _background_epoch_record(self, epoch: int, losses: list[float], seconds: float) -> EpochRecord:
        """The record of an epoch whose round averaged in the background (overlapped rounds), from that round's own
        outcome, never from the optimizer's last figures, which may be the next round's by now. A round left for a
        download of the swarm's state has none: the epoch is reported as not averaged
        (tests/roles/test_volunteer.py::test_a_background_rounds_epoch_is_reported_with_its_own_outcome)."""
        applied = self.optimizer.applied_in_background.pop(epoch, None)
        if applied is None:
            return self._record(epoch, losses, seconds, False, 1, 0, "its round was left for the swarm's state")
        return self._record(
            epoch, losses, seconds, applied.averaged, applied.group_size, applied.anchors, applied.problem
        )

    def _record(
        self,
        epoch: int,
        losses: list[float],
        seconds: float,
        averaged: bool,
        group_size: int,
        anchors: int,
        problem: str | None,
    ) -> EpochRecord:
        return EpochRecord(
            epoch=epoch,
            loss=sum(losses) / len(losses),
            local_steps=len(losses),
            samples=len(losses) * self.config.optimizer.batch_size_per_step,
            averaged=averaged,
            group_size=group_size,
            num_peers=self.global_progress.num_peers,
            seconds=seconds,
            anchors=anchors,
            training_peers=max(1, self.optimizer.tracker.training_peers),
            problem=problem,
        )

    def _report_epoch(
        self,
        record: EpochRecord,
        history: TrainingHistory,
        on_epoch: Callable[[EpochRecord], None] | None,
        on_lone: Callable[[LoneWarning], None] | None,
    ) -> None:
        """Keep the epoch's record, say so when this peer trains alone while others train, publish its metrics."""
        history.epochs.append(record)
        warning = self._lone_watch.observe(
            record,
            bool(self.config.swarm.client_mode),
            self.optimizer.tracker.anchor_peers,
            self.config.optimizer.averaging_timeout,
            self.config.optimizer.matchmaking_time,
            self._undialable,
        )
        if warning is not None:
            logger.warning(str(warning))
            history.lone_warnings.append(warning)
            if on_lone is not None:
                on_lone(warning)
        self._publish_metrics(record)
        if on_epoch is not None:
            on_epoch(record)

    def _publish_metrics(self, record: EpochRecord) -> None:
        """Count the epoch's work and publish this peer's metrics record (a failure only logs: training goes on)."""
        self.metrics.add_work(record.samples, record.seconds)
        try:
            self.metrics.publish(
                epoch=self.local_epoch,
                loss=record.loss,
                mini_steps=record.local_steps,
                samples_per_second=record.samples / max(record.seconds, 1e-6),
                wait=False,
                averaged_with=record.group_size - 1,
                lone_epochs=self._lone_watch.streak,
                lone_reason=self._lone_watch.reason,
                device=self.plan.name,
                precision=self.plan.precision,
            )
        except Exception as e:  # the DHT may be shutting down or unreachable for a moment
            logger.warning(f"could not publish this peer's metrics: {e}")
