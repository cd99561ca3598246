"""The peers a run is made of, and how a maintainer starts them.

- ``volunteer``: ``Volunteer``, a training peer: joins, loads the swarm's state, trains, averages, recovers from a
  non-finite step, reports its epochs (the notebooks' and ``collab-kit join``'s peer); ``recovery``: its checks of
  non-finite steps and the swarm's state loaded in their place; ``epoch_reports``: its epoch records (reported once
  their round is over), lone-training warnings and metrics.
- ``records``: what a volunteer reports: epoch records, state loads, lone-training warnings, the history.
- ``monitor``: ``Monitor``, the swarm's first peer: polls metrics, keeps the run history, runs the anchor for peers
  behind NAT; ``monitor_settings``: what it keeps and how often; ``monitor_address``: its identity and port, kept
  across restarts; ``checkpointer``: its checkpoints.
- ``run_history``: the monitor's SQLite database: loss, peers, throughput, the contributors' leaderboard.
- ``live_status``: what the monitor's live page shows, built once a poll (peers gone, leaderboard, the join line);
  ``live_page``: the page and its JSON API, served by a process of the monitor's (``--dashboard-port``);
  ``wandb_log``: the monitor's optional log to Weights & Biases.
- ``processes``: a peer as a child process that reports events (``PeerProcess``), for the demo, services and tests.
- ``services``: a maintainer's one-call start of the monitor, the auth server and volunteers, with join lines.
"""

from collab_kit.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "volunteer": ["Volunteer"],
        "recovery": ["NonFiniteTrainingError", "NonFiniteRecoveryMixin"],
        "monitor": ["Monitor"],
        "monitor_settings": ["MonitorSettings", "MonitorError"],
        "checkpointer": ["Checkpointer"],
        "records": ["EpochRecord", "RestoreRecord", "TrainingHistory", "LoneWarning", "LONE_AFTER_EPOCHS"],
        "run_history": ["RunHistory"],
        "live_page": ["LivePage", "LivePageError"],
        "processes": ["PeerProcess", "PeerFailed", "emit_event"],
        "services": [
            "start_monitor",
            "start_auth_server",
            "start_volunteer_process",
            "stop_all",
            "running_services",
            "ServiceError",
        ],
    },
)
