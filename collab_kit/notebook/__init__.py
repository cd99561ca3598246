"""What the notebooks show: checks before joining, the live view while training, the run's dashboard.

- ``preflight``: ``run_preflight``, the machine (GPU, RAM, disk, bitsandbytes), reachability and the swarm checked
  before a volunteer joins, each finding one sentence that says what to change.
- ``live_view``: ``LiveView``, the loss and peers plot and text lines a training cell updates as epochs end.
- ``dashboard``: the monitor's database as plots, a leaderboard, the anchors and a static HTML page.
- ``dashboard_plots``: the dashboard's plots (loss, alive peers, throughput), on an Axes or as a PNG.
"""

from collab_kit.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "preflight": ["run_preflight", "PreflightReport", "Finding"],
        "live_view": ["LiveView"],
        "dashboard": ["load", "write_page", "render_page", "show", "show_plots", "show_leaderboard", "DashboardData"],
    },
)
