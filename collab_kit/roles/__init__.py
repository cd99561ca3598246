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

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:  # editors and type checkers follow these; at run time each loads on first use
    from collab_kit.roles.checkpointer import Checkpointer as Checkpointer
    from collab_kit.roles.live_page import LivePage as LivePage
    from collab_kit.roles.live_page import LivePageError as LivePageError
    from collab_kit.roles.monitor import Monitor as Monitor
    from collab_kit.roles.monitor_settings import MonitorError as MonitorError
    from collab_kit.roles.monitor_settings import MonitorSettings as MonitorSettings
    from collab_kit.roles.processes import PeerFailed as PeerFailed
    from collab_kit.roles.processes import PeerProcess as PeerProcess
    from collab_kit.roles.processes import emit_event as emit_event
    from collab_kit.roles.records import LONE_AFTER_EPOCHS as LONE_AFTER_EPOCHS
    from collab_kit.roles.records import EpochRecord as EpochRecord
    from collab_kit.roles.records import LoneWarning as LoneWarning
    from collab_kit.roles.records import RestoreRecord as RestoreRecord
    from collab_kit.roles.records import TrainingHistory as TrainingHistory
    from collab_kit.roles.recovery import NonFiniteRecoveryMixin as NonFiniteRecoveryMixin
    from collab_kit.roles.recovery import NonFiniteTrainingError as NonFiniteTrainingError
    from collab_kit.roles.run_history import RunHistory as RunHistory
    from collab_kit.roles.services import ServiceError as ServiceError
    from collab_kit.roles.services import running_services as running_services
    from collab_kit.roles.services import start_auth_server as start_auth_server
    from collab_kit.roles.services import start_monitor as start_monitor
    from collab_kit.roles.services import start_volunteer_process as start_volunteer_process
    from collab_kit.roles.services import stop_all as stop_all
    from collab_kit.roles.volunteer import Volunteer as Volunteer
