"""Widgets and views the notebooks show: checks before joining, the live view while training, the run's dashboard.

- ``preflight``: ``run_preflight``, the machine (GPU, RAM, disk, bitsandbytes), reachability and the swarm checked
  before a volunteer joins, each finding one sentence that says what to change.
- ``live_view``: ``LiveView``, the loss and peers plot and text lines a training cell updates as epochs end.
- ``dashboard``: the monitor's database as plots, a leaderboard, the anchors and a static HTML page.
- ``dashboard_plots``: the dashboard's plots (loss, alive peers, throughput), on an Axes or as a PNG.
"""

from typing import TYPE_CHECKING

from collab_kit.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "preflight": ["run_preflight", "PreflightReport", "Finding"],
        "live_view": ["LiveView"],
        "dashboard": ["load", "write_page", "render_page", "show", "show_plots", "show_leaderboard", "DashboardData"],
    },
)

if TYPE_CHECKING:  # editors and type checkers follow these; at run time each loads on first use
    from collab_kit.widgets.dashboard import DashboardData as DashboardData
    from collab_kit.widgets.dashboard import load as load
    from collab_kit.widgets.dashboard import render_page as render_page
    from collab_kit.widgets.dashboard import show as show
    from collab_kit.widgets.dashboard import show_leaderboard as show_leaderboard
    from collab_kit.widgets.dashboard import show_plots as show_plots
    from collab_kit.widgets.dashboard import write_page as write_page
    from collab_kit.widgets.live_view import LiveView as LiveView
    from collab_kit.widgets.preflight import Finding as Finding
    from collab_kit.widgets.preflight import PreflightReport as PreflightReport
    from collab_kit.widgets.preflight import run_preflight as run_preflight
