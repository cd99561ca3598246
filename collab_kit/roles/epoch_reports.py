"""What a volunteer reports of each global epoch: its record (loss, samples, the round that ended it), the warning
when it trains alone while others train, and its metrics for the monitor. A mixin of collab_kit.roles.volunteer
.Volunteer, whose attributes (optimizer, config, metrics, plan, _lone_watch, _undialable) it reads."""
from __future__ import annotations

import logging
from typing import Callable, List, Optional

from collab_kit.roles.records import EpochRecord, LoneWarning, TrainingHistory

logger = logging.getLogger(__name__)


class EpochReportsMixin:
    """Put before the volunteer's other bases: its epoch records, lone-training warnings and metrics."""

    def _epoch_record(self, epoch_before: int, rounds_before: int, losses: List[float], seconds: float) -> EpochRecord:
        """What this peer saw of the global epoch its last step ended: its loss, samples, and the round that ended
        it."""
        optimizer = self.optimizer
        averaged = optimizer.averaged_rounds > rounds_before
        # an epoch that ended by loading the swarm's state (this peer was behind) had no round of its own; a round of
        # the swarm's next epoch ended that one (this peer's losses went into its gradients)
        in_round = averaged or optimizer.last_round_epoch in (epoch_before, epoch_before + 1)
        return EpochRecord(
            epoch=optimizer.last_round_epoch if in_round else epoch_before,
            loss=sum(losses) / len(losses), local_steps=len(losses),
            samples=len(losses) * self.config.optimizer.batch_size_per_step, averaged=averaged,
            group_size=optimizer.last_group_size if in_round else 1, num_peers=self.global_progress.num_peers,
            seconds=seconds, anchors=optimizer.last_anchors_in_group if in_round else 0,
            training_peers=max(1, optimizer.tracker.training_peers),
            problem=optimizer.last_round_problem if in_round else "this peer was behind the swarm")

    def _report_epoch(self, record: EpochRecord, history: TrainingHistory,
                      on_epoch: Optional[Callable[[EpochRecord], None]],
                      on_lone: Optional[Callable[[LoneWarning], None]]) -> None:
        """Keep the epoch's record, say so when this peer trains alone while others train, publish its metrics."""
        history.epochs.append(record)
        warning = self._lone_watch.observe(record, bool(self.config.swarm.client_mode),
                                           self.optimizer.tracker.anchor_peers,
                                           self.config.optimizer.averaging_timeout,
                                           self.config.optimizer.matchmaking_time, self._undialable)
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
            self.metrics.publish(epoch=self.local_epoch, loss=record.loss, mini_steps=record.local_steps,
                                 samples_per_second=record.samples / max(record.seconds, 1e-6), wait=False,
                                 averaged_with=record.group_size - 1, lone_epochs=self._lone_watch.streak,
                                 lone_reason=self._lone_watch.reason, device=self.plan.name,
                                 precision=self.plan.precision)
        except Exception as e:  # the DHT may be shutting down or unreachable for a moment
            logger.warning(f"could not publish this peer's metrics: {e}")
