"""The peers a run is made of, and how a maintainer starts them.

- ``volunteer``: ``Volunteer``, a training peer: joins, loads the swarm's state, trains, averages, recovers from a
  non-finite step, reports its epochs (the notebooks' and ``collab-kit join``'s peer).
- ``monitor``: ``Monitor``, the swarm's first peer: polls metrics, keeps the run history, saves checkpoints, runs
  the anchor for peers behind NAT.
- ``run_history``: the monitor's SQLite database: loss, peers, throughput, the contributors' leaderboard.
- ``processes``: a peer as a child process that reports events (``PeerProcess``), for the demo, services and tests.
- ``services``: a maintainer's one-call start of the monitor, the auth server and volunteers, with join lines.
"""
from collab_kit.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "volunteer": ["Volunteer", "NonFiniteTrainingError", "TrainingHistory", "EpochRecord", "LONE_AFTER_EPOCHS"],
    "monitor": ["Monitor", "MonitorSettings", "MonitorError"],
    "run_history": ["RunHistory"],
    "processes": ["PeerProcess", "PeerFailed", "emit_event"],
    "services": ["start_monitor", "start_auth_server", "start_volunteer_process", "stop_all", "running_services",
                 "ServiceError"],
})
