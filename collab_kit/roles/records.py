"""What a volunteer reports of its training: each global epoch, each load of the swarm's state, a warning when it trains
alone while others train, and the history of a ``train`` call (with its plot).

``EpochRecord`` and ``RestoreRecord`` travel as JSON in the command line's events (``collab-kit join --events``) and
as the live view's rows; ``LoneTrainingWatch`` decides, from the epoch records, when a volunteer is told it is alone
and why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from collab_kit.addresses import all_on_this_machine
from collab_kit.config import RunConfig
from collab_kit.units import format_bytes


@dataclass
class EpochRecord:
    """What one peer saw of one global epoch."""

    epoch: int  # the global epoch these local steps belonged to
    loss: float  # mean loss of this peer's local steps in that epoch
    local_steps: int
    samples: int  # samples this peer contributed
    averaged: bool  # gradients of this epoch were averaged with at least one other training peer
    group_size: int  # training peers in the gradient averaging group, this one included (1 = local gradients only)
    num_peers: int  # peers the swarm reported when the epoch ended (anchors included)
    seconds: float
    anchors: int = 0  # anchors in the round (collab_kit.swarm.anchor: peers that reduce for others, with no samples)
    training_peers: int = 1  # peers that trained in the swarm when the epoch ended, this one included
    problem: str | None = None  # why the round failed or came back in part (None: it did not)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RestoreRecord:
    """One time this peer loaded (or tried to load) the swarm's parameters and optimizer state."""

    # "behind_swarm" (it joined or came back late, or its last global step was not the swarm's) or "non_finite" (its
    # loss, gradients or parameters)
    reason: str
    problem: str  # what was seen, in words
    loaded: bool  # a peer gave its state; False: none could, the local state was kept
    epoch_before: int
    epoch_after: int
    local_step: int  # local steps this peer had taken when it happened

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoneWarning:
    """Said when a volunteer's global steps go unaveraged while other peers train: it is training alone.

    :param epoch: the global epoch at which it was said
    :param epochs: global epochs in a row that were not averaged
    :param training_peers: peers that trained in the swarm meanwhile (this one included)
    :param reason: why, as far as this peer can tell
    :param advice: what to do about it
    """

    epoch: int
    epochs: int
    training_peers: int
    reason: str
    advice: str

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"training alone: the last {self.epochs} global steps were not averaged with any other peer, although "
            f"{self.training_peers - 1} other peer(s) train in the swarm. Why: {self.reason}. What to do: "
            f"{self.advice}"
        )


def undialable_reason(config: RunConfig, reachability) -> str | None:
    """Why the swarm may be unable to dial a peer that accepts connections, or None: a peer made to accept them
    (``swarm.client_mode=False``) while its initial peers are on other machines, and announcing no address a probe
    found (a probe that got through announces the address the swarm saw), was never checked."""
    swarm = config.swarm
    if (
        swarm.client_mode
        or reachability is not None
        or swarm.announce_maddrs
        or not swarm.initial_peers
        or all_on_this_machine(swarm.initial_peers)
    ):
        return None
    return (
        f"it was set to accept connections (--no-client-mode) on {swarm.host}, so the swarm never checked that "
        f"it can dial it back"
    )


LONE_AFTER_EPOCHS = 3  # unaveraged global epochs in a row, while others train, before a volunteer is told it is alone


class LoneTrainingWatch:
    """Notices a volunteer that trains alone while others are present, and says why (once per stretch).

    hivemind goes on with a peer's own gradients when its averaging round fails, so such a volunteer
    would otherwise believe it trains with the swarm. After ``after_epochs`` global epochs in a row
    that were not averaged while other training peers were present, ``observe`` returns a LoneWarning;
    the next one comes only after an averaged epoch ended the stretch.

    :param after_epochs: unaveraged epochs in a row (with others present) before saying so
    """

    def __init__(self, after_epochs: int = LONE_AFTER_EPOCHS):
        self.after_epochs = after_epochs
        self.streak = 0
        self.reason: str | None = None  # why the epochs of the current stretch were not averaged (None: averaged)
        self._warned = False

    def observe(
        self,
        record: EpochRecord,
        client_mode: bool,
        anchors_in_swarm: int,
        averaging_timeout: float,
        matchmaking_time: float,
        undialable: str | None = None,
    ) -> LoneWarning | None:
        """Count one epoch; returns the warning when a stretch of lone epochs reaches ``after_epochs``.

        :param undialable: why the swarm may be unable to dial this peer although it accepts connections (None: it
          was checked, or it is in client mode)
        """
        if record.averaged or record.training_peers <= 1:
            self.streak, self.reason, self._warned = 0, None, False
            return None
        self.streak += 1
        self.reason, advice = self.diagnose(
            record, client_mode, anchors_in_swarm, averaging_timeout, matchmaking_time, undialable
        )
        if self.streak < self.after_epochs or self._warned:
            return None
        self._warned = True
        return LoneWarning(
            epoch=record.epoch,
            epochs=self.streak,
            training_peers=record.training_peers,
            reason=self.reason,
            advice=advice,
        )

    @staticmethod
    def diagnose(
        record: EpochRecord,
        client_mode: bool,
        anchors_in_swarm: int,
        averaging_timeout: float,
        matchmaking_time: float,
        undialable: str | None = None,
    ) -> tuple[str, str]:
        """Why an epoch was not averaged, as far as this peer can tell, and what to do about it: (reason, advice).

        A round that failed while nobody checked that the swarm can dial this peer is blamed on that, not on the
        link (tests/roles/test_lone_training.py::test_failed_rounds_of_a_peer_nobody_checked_blame_the_dialling)."""
        if client_mode and not anchors_in_swarm and not record.anchors:
            return (
                "this peer is behind NAT or a firewall (client mode) and no peer of the swarm accepts connections, "
                "so no averaging group can hold it",
                "the run's organizer starts `collab-kit monitor` on a machine others can dial (it runs the run's "
                "anchor, which volunteers behind NAT average through); or join from a machine with a public "
                "address or a forwarded port",
            )
        if record.problem and undialable:
            return (
                f"its averaging rounds fail ({record.problem}), and the swarm's peers may be unable to dial this "
                f"one: {undialable}",
                "leave --client-mode and --host out, so that the swarm checks whether it can dial this peer back "
                "(a peer it cannot dial joins in client mode and averages through the run's anchor), or forward "
                "its port and announce it (--set swarm.announce_maddrs=...)",
            )
        if record.problem:
            return (
                f"its averaging rounds fail ({record.problem})",
                f"on a slow or unsteady link, give rounds more time: --set optimizer.averaging_timeout=... and "
                f"optimizer.matchmaking_time=... (now {averaging_timeout:g} s and {matchmaking_time:g} s; every "
                f"peer of the run needs the same); check the link (a speed test, another network)",
            )
        return (
            "its averaging groups held no other training peer (the others joined other rounds)",
            "check that every peer runs the same --preset, --run-id and --set options; if it goes on, restart "
            "this peer",
        )


@dataclass
class TrainingHistory:
    epochs: list[EpochRecord] = field(default_factory=list)
    restores: list[RestoreRecord] = field(default_factory=list)
    lone_warnings: list[LoneWarning] = field(default_factory=list)  # stretches of training alone while others trained
    skipped_steps: int = 0  # local steps dropped because their loss or gradients were not finite
    link_outages: int = 0  # times training waited for the link to the swarm to come back
    start_epoch: int = 0  # the global epoch this peer started at (> 0 when it joined late)
    final_epoch: int = 0
    local_steps: int = 0
    averaged_rounds: int = 0
    # bytes this peer's averagers sent to other peers over the run (rounds, and states served to others), and of those
    # the states it served (to late joiners, to the monitor's checkpoints)
    bytes_sent: int = 0
    bytes_served: int = 0
    interrupted: bool = False
    # where it trained, and in what precision (collab_kit.model.device); local steps an fp16 overflow skipped
    device: str = "cpu"
    precision: str = "fp32"
    overflow_steps: int = 0
    # seconds of the local steps' forward and backward passes, and of the pauses after them (train's max_load)
    compute_seconds: float = 0.0
    paused_seconds: float = 0.0
    # local-update mode with overlap_rounds: inner steps taken while a round of this peer averaged in the background
    overlapped_steps: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """One line: epochs trained, loss from first to last epoch, rounds averaged with peers, bytes sent to them."""
        if not self.epochs:
            return f"no global epoch completed (epochs {self.start_epoch}->{self.final_epoch})"
        overflows = f", {self.overflow_steps} fp16 overflow(s) skipped" if self.overflow_steps else ""
        return (
            f"epochs {self.start_epoch}->{self.final_epoch}: loss {self.epochs[0].loss:.4f} -> "
            f"{self.epochs[-1].loss:.4f}, {self.averaged_rounds} of {len(self.epochs)} global steps averaged "
            f"with other peers, {format_bytes(self.bytes_sent)} sent to them, on {self.device} in "
            f"{self.precision}{overflows}{' (interrupted)' if self.interrupted else ''}"
        )

    def plot(self, ax=None):
        """Loss per global epoch; epochs averaged with other peers in green, lone ones in grey.

        :param ax: a matplotlib Axes to draw on (default: a new figure)
        :returns: the Axes
        """
        # lazy: matplotlib takes a second to import; only a plot needs it
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        if ax is None:
            _, ax = plt.subplots(figsize=(6, 3.5))
        epochs = [record.epoch for record in self.epochs]
        ax.plot(epochs, [record.loss for record in self.epochs], color="tab:blue", zorder=1, label="loss")
        for averaged, color, label in ((True, "tab:green", "averaged with peers"), (False, "tab:gray", "alone")):
            chosen = [record for record in self.epochs if record.averaged == averaged]
            if chosen:
                ax.scatter([r.epoch for r in chosen], [r.loss for r in chosen], color=color, zorder=2, label=label)
        ax.set_xlabel("global epoch")
        ax.set_ylabel("mean loss of this peer's steps (nats per token)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # epochs are whole
        ax.set_title("training together")
        ax.legend()
        return ax
