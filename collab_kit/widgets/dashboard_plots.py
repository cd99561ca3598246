"""The dashboard's plots (collab_kit.widgets.dashboard): loss, alive peers and throughput over the run, each drawn on an
Axes you give it, or as a PNG.

Figures are ``matplotlib.figure.Figure`` objects, not pyplot's: PNGs are written through the Agg canvas whatever
backend the process has (none is needed), and no global state is touched.
"""

from __future__ import annotations

import datetime
import io
from collections.abc import Sequence
from typing import TYPE_CHECKING

import matplotlib.dates as mdates
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

if TYPE_CHECKING:
    from collab_kit.swarm.metrics import SwarmSnapshot

# one colour per plot, used nowhere else on the page (the screenshot test finds each plot by its colour)
COLORS = {"loss": "#1f77b4", "alive_peers": "#2ca02c", "throughput": "#ff7f0e"}
PLOT_SIZE = (6.4, 2.8)  # inches; at PLOT_DPI, 640 x 280 pixels on the page
PLOT_DPI = 100
LOSS_X = ("time", "epoch")


def _times(points: Sequence[SwarmSnapshot]) -> list:
    return [datetime.datetime.fromtimestamp(point.time, tz=datetime.timezone.utc) for point in points]


def _time_axis(ax) -> None:
    locator = mdates.AutoDateLocator(tz=datetime.timezone.utc)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, tz=datetime.timezone.utc))
    ax.set_xlabel("time (UTC)")


def _nothing_yet(ax, message: str):
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])
    return ax


def plot_loss(ax, series: Sequence[SwarmSnapshot], x: str = "time"):
    """The swarm's loss (the alive peers' mean, weighted by their local steps) over time or global epochs.

    :param ax: the matplotlib Axes to draw on
    :param series: RunHistory.series()
    :param x: "time" or "epoch"
    """

    if x not in LOSS_X:
        raise ValueError(f"x={x!r}: expected one of {LOSS_X}")
    ax.set_title("loss")
    points = [point for point in series if point.loss is not None]  # polls with no alive peer have no loss
    if not points:
        return _nothing_yet(ax, "no loss reported yet" if series else "no polls yet")
    xs = _times(points) if x == "time" else [point.epoch for point in points]
    ax.plot(xs, [point.loss for point in points], color=COLORS["loss"], linewidth=2, marker="o", markersize=3)
    ax.set_ylabel("loss (nats per token)")
    ax.grid(alpha=0.3)
    if x == "time":
        _time_axis(ax)
    else:
        ax.set_xlabel("global epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # epochs are whole
    return ax


def plot_alive_peers(ax, series: Sequence[SwarmSnapshot]):
    """How many training peers had a live metrics record at each poll."""

    ax.set_title("alive peers")
    if not series:
        return _nothing_yet(ax, "no polls yet")
    # a step: the count holds until the next poll sees a change
    ax.plot(
        _times(series),
        [point.alive_peers for point in series],
        color=COLORS["alive_peers"],
        linewidth=2,
        marker="o",
        markersize=3,
        drawstyle="steps-post",
    )
    ax.set_ylim(bottom=0, top=max(point.alive_peers for point in series) + 1)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_ylabel("peers")
    ax.grid(alpha=0.3)
    _time_axis(ax)
    return ax


def plot_throughput(ax, series: Sequence[SwarmSnapshot]):
    """The whole swarm's samples per second (the sum of the alive peers' throughputs)."""
    ax.set_title("throughput")
    if not series:
        return _nothing_yet(ax, "no polls yet")
    times, values = _times(series), [point.samples_per_second for point in series]
    ax.fill_between(times, values, color=COLORS["throughput"], alpha=0.15, linewidth=0)
    ax.plot(times, values, color=COLORS["throughput"], linewidth=2, marker="o", markersize=3)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("samples/s")
    ax.grid(alpha=0.3)
    _time_axis(ax)
    return ax


PLOTS = {"loss": plot_loss, "alive_peers": plot_alive_peers, "throughput": plot_throughput}


def dashboard_figure(series: Sequence[SwarmSnapshot], loss_x: str = "time"):
    """The three plots, one under the other, in one matplotlib Figure."""
    figure = Figure(figsize=(PLOT_SIZE[0] * 1.25, PLOT_SIZE[1] * 3), dpi=PLOT_DPI, layout="constrained")
    loss_ax, peers_ax, throughput_ax = figure.subplots(3, 1)
    plot_loss(loss_ax, series, x=loss_x)
    plot_alive_peers(peers_ax, series)
    plot_throughput(throughput_ax, series)
    return figure


def figure_png(figure) -> bytes:
    """A Figure as PNG bytes (through the Agg canvas: no display needed)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=PLOT_DPI, facecolor="white")
    return buffer.getvalue()


def plot_png(kind: str, series: Sequence[SwarmSnapshot], loss_x: str = "time") -> bytes:
    """One plot ("loss", "alive_peers" or "throughput") as a PNG of PLOT_SIZE."""
    figure = Figure(figsize=PLOT_SIZE, dpi=PLOT_DPI, layout="constrained")
    ax = figure.subplots()
    if kind == "loss":
        plot_loss(ax, series, x=loss_x)
    else:
        PLOTS[kind](ax, series)
    return figure_png(figure)
