"""The monitor's optional log to Weights & Biases (``collab-kit monitor --wandb-project NAME``): each poll, as a W&B
run named after the run id."""

from __future__ import annotations

from collab_kit.config import RunConfig
from collab_kit.roles.monitor_settings import MonitorError
from collab_kit.swarm.metrics import SwarmSnapshot


def require_wandb(project: str):
    """The ``wandb`` module; :raises MonitorError: saying how to install it, when it is not installed."""
    try:
        # lazy: wandb is optional (`pip install wandb`), needed only with a W&B project
        import wandb
    except ImportError:
        raise MonitorError(
            f"--wandb-project {project}: Weights & Biases is not installed. Install it with "
            f"`pip install wandb` and log in with `wandb login`, or leave out --wandb-project "
            f"(and unset WANDB_PROJECT)"
        ) from None
    return wandb


class WandbLogger:
    """Logs each poll to a Weights & Biases run named after the run id (resumed after a restart)."""

    def __init__(self, project: str, config: RunConfig):
        wandb = require_wandb(project)
        self.run = wandb.init(
            project=project,
            name=config.swarm.run_id,
            id=config.swarm.run_id,
            resume="allow",
            job_type="monitor",
            config=config.to_dict(),
        )

    def log(self, snapshot: SwarmSnapshot, contributors: int) -> None:
        values = dict(
            epoch=snapshot.epoch,
            alive_peers=snapshot.alive_peers,
            samples_per_second=snapshot.samples_per_second,
            contributors=contributors,
        )
        if snapshot.loss is not None:
            values["loss"] = snapshot.loss
        self.run.log(values)

    def close(self) -> None:
        self.run.finish()
