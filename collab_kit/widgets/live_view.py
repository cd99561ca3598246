"""A volunteer's live view in a notebook: the loss, the swarm's peers and this volunteer's contribution.

    view = LiveView(target_batch_size=config.optimizer.target_batch_size)
    history = volunteer.train(max_epochs=..., on_epoch=view.update)

Each global epoch redraws one figure of three panels in place (an IPython display handle, so a long run
leaves one picture, not hundreds): the loss of this peer's steps (green where its gradients were averaged
with others), how many peers trained in the swarm, and this peer's samples against the swarm's batch.
Outside a notebook it only keeps the records (``figure()`` still draws them).
"""

from __future__ import annotations

import io
import logging

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from collab_kit.auth.client import in_notebook
from collab_kit.roles.records import LONE_AFTER_EPOCHS

logger = logging.getLogger(__name__)


class LiveView:
    """Redraws the training figure after each global epoch.

    :param target_batch_size: samples the swarm gathers per global epoch (to show this peer's share)
    :param title: shown above the figure
    :param display: show the figure (default: only inside a notebook; False: keep the records, draw on request)
    """

    def __init__(
        self, target_batch_size: int | None = None, title: str = "training together", display: bool | None = None
    ):
        self.target_batch_size = target_batch_size
        self.title = title
        self.records: list = []  # collab_kit.roles.records.EpochRecord
        self.warnings: list = []  # collab_kit.roles.records.LoneWarning
        if display is None:
            display = in_notebook()
        self._display = display
        self._handle = None

    @property
    def contributed_samples(self) -> int:
        return sum(record.samples for record in self.records)

    def lone_epochs(self) -> int:
        """Global epochs in a row, up to the last, not averaged while other peers trained."""
        count = 0
        for record in reversed(self.records):
            if record.averaged or getattr(record, "training_peers", 1) <= 1:
                break
            count += 1
        return count

    def caption(self) -> str:
        """One line: the last epoch's loss, peers, and what this volunteer gave so far (or that it trains alone)."""
        if not self.records:
            return "waiting for the first global epoch..."
        alone = self.lone_epochs()
        if alone >= LONE_AFTER_EPOCHS:
            last = self.records[-1]
            return (
                f"TRAINING ALONE for {alone} epochs while {last.training_peers - 1} other peer(s) train: "
                f"{last.problem or 'no other training peer in its averaging groups'} (see the warning below)"
            )
        last = self.records[-1]
        share = (
            f", {last.samples / self.target_batch_size:.0%} of the swarm's last batch" if self.target_batch_size else ""
        )
        return (
            f"epoch {last.epoch}: loss {last.loss:.3f}, {last.num_peers} peer(s) in the swarm; "
            f"you contributed {self.contributed_samples} samples in {len(self.records)} epoch(s){share}"
        )

    def figure(self):
        """The three panels as a matplotlib Figure (not shown)."""
        figure = Figure(figsize=(11, 3.2), layout="constrained")
        loss_ax, peers_ax, share_ax = figure.subplots(1, 3)
        epochs = [record.epoch for record in self.records]
        loss_ax.plot(epochs, [r.loss for r in self.records], color="tab:blue", zorder=1)
        for averaged, color, label in ((True, "tab:green", "averaged with peers"), (False, "tab:gray", "alone")):
            chosen = [r for r in self.records if r.averaged == averaged]
            if chosen:
                loss_ax.scatter(
                    [r.epoch for r in chosen], [r.loss for r in chosen], color=color, zorder=2, label=label, s=16
                )
        loss_ax.set(title="loss of your steps", xlabel="global epoch", ylabel="loss (nats per token)")
        if self.records:
            loss_ax.legend(fontsize="small")
        peers_ax.step(
            epochs, [r.num_peers for r in self.records], where="mid", color="tab:purple", label="in the swarm"
        )
        # the others whose gradients were averaged with yours: 0 when you were alone (group_size counts you)
        peers_ax.step(
            epochs,
            [r.group_size - 1 if r.averaged else 0 for r in self.records],
            where="mid",
            color="tab:orange",
            label="averaged with you",
        )
        peers_ax.set(title="peers", xlabel="global epoch", ylabel="peers")
        peers_ax.set_ylim(bottom=0, top=max([r.num_peers for r in self.records] + [1]) + 0.5)
        peers_ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        if self.records:
            peers_ax.legend(fontsize="small")
        share_ax.bar(epochs, [r.samples for r in self.records], color="tab:green", label="your samples")
        if self.target_batch_size:
            share_ax.axhline(
                self.target_batch_size, color="black", linestyle="--", linewidth=1, label="the swarm's batch"
            )
        share_ax.set(title="your contribution", xlabel="global epoch", ylabel="samples")
        if self.records:
            share_ax.legend(fontsize="small")
        for ax in (loss_ax, peers_ax, share_ax):  # epochs are whole: no 0.5 ticks
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        figure.suptitle(
            f"{self.title}: {self.caption()}",
            fontsize="medium",
            color="tab:red" if self.lone_epochs() >= LONE_AFTER_EPOCHS else "black",
        )
        return figure

    def png(self) -> bytes:
        buffer = io.BytesIO()
        self.figure().savefig(buffer, format="png", dpi=80)
        return buffer.getvalue()

    def warn(self, warning) -> None:
        """Print a lone-training warning under the figure (text, so a saved notebook keeps it): pass as
        ``Volunteer.train(on_lone=view.warn)``."""
        self.warnings.append(warning)
        print(f"WARNING: {warning}", flush=True)

    def update(self, record) -> None:
        """Add an epoch's record and redraw: pass as ``Volunteer.train(on_epoch=view.update)``."""
        self.records.append(record)
        if not self._display:
            return
        try:
            # lazy: IPython is there only where a notebook runs
            from IPython.display import Image, display

            if self._handle is None:
                self._handle = display(Image(self.png()), display_id=True)
            else:
                self._handle.update(Image(self.png()))
        except Exception as error:  # a broken display must not stop training
            logger.warning(f"the live view could not draw: {error}")
            self._display = False
