"""What a volunteer does with a local step whose loss, gradients or parameters are not finite (nan, inf).

Such a step never reaches the optimizer: its gradients would be averaged into every peer's step and poison the
whole swarm. The volunteer drops them and loads the swarm's parameters and optimizer state instead
(``NonFiniteRecoveryMixin._recover_from_non_finite_step``); shown by tests/roles/test_faults.py and
tests/roles/test_volunteer.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from collab_kit.errors import CollabKitError
from collab_kit.model.transformer import non_finite_parameters
from collab_kit.roles.records import RestoreRecord, TrainingHistory

logger = logging.getLogger(__name__)


class NonFiniteTrainingError(CollabKitError, RuntimeError):
    """Training cannot go on: the model is not finite and no peer could give its state, or every step stays nan."""


class NonFiniteRecoveryMixin:
    """The volunteer's checks of non-finite steps and its recovery from them (it has ``model``, ``optimizer``,
    ``config``, ``local_epoch`` and a ``_non_finite_streak`` counter)."""

    # local steps in a row whose loss or gradients may be non-finite, each followed by loading the swarm's
    # state, before giving up: beyond that the fault is not in the parameters but in the data or the settings
    max_non_finite_steps = 5

    def _non_finite_step_problem(self, loss: torch.Tensor) -> str | None:
        """What is not finite after this local step's backward pass: the loss or the gradients (None: all finite)."""
        if not torch.isfinite(loss.detach()).all():
            return f"the loss is {loss.item()}"
        grads = [param.grad for param in self.model.parameters() if param.grad is not None]
        # one norm over all gradients: nan or inf anywhere makes it non-finite, with one sync instead of one per tensor
        if grads and not torch.isfinite(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))):
            return "the gradients are not finite"
        return None

    def _non_finite_parameters_problem(self) -> str | None:
        """Which of the model's parameters hold nan or inf (None: all finite)."""
        bad = non_finite_parameters(self.model)
        if not bad:
            return None
        return f"parameters are not finite: {', '.join(bad[:3])}{' and more' if len(bad) > 3 else ''}"

    def _recover_from_non_finite_step(
        self,
        problem: str,
        history: TrainingHistory,
        on_restore: Callable[[RestoreRecord], None] | None = None,
        step_dropped: bool = True,
    ) -> None:
        """Drop this step's gradients (they never reach the optimizer, so they are never averaged with the swarm's)
        and load the swarm's parameters and optimizer state in place of this peer's.

        If no peer can give its state, training goes on from the local state as long as the parameters are
        finite (the bad step is simply skipped); with non-finite parameters there is nothing to go on from.

        :param step_dropped: a local step's gradients are dropped (False: found by the check of the parameters after
          a global step, when no local step is dropped)
        :raises NonFiniteTrainingError: non-finite parameters and no peer gave its state, or ``max_non_finite_steps``
          steps in a row were not finite
        """
        self.optimizer.zero_grad()
        history.skipped_steps += int(step_dropped)
        self._non_finite_streak += 1
        if self._non_finite_streak > self.max_non_finite_steps:
            raise NonFiniteTrainingError(
                f"{problem} for {self._non_finite_streak} local steps in a row, and loading the swarm's state did not "
                f"help: the fault is likely in the data or the settings (try a lower optimizer.learning_rate)"
            )
        epoch_before = self.local_epoch
        logger.warning(
            f"{problem} after {history.local_steps} local steps (epoch {epoch_before}): dropping this "
            f"step's gradients and loading the swarm's parameters and optimizer state"
        )
        loaded = self.optimizer.load_state_from_peers()
        record = RestoreRecord(
            reason="non_finite",
            problem=problem,
            loaded=loaded,
            epoch_before=epoch_before,
            epoch_after=self.local_epoch,
            local_step=history.local_steps,
        )
        self._record_restore(history, record, on_restore)
        still_bad = self._non_finite_parameters_problem()
        if loaded:
            if still_bad is None:
                logger.warning(f"loaded the swarm's state (epoch {self.local_epoch}): training goes on")
            else:  # the next step tries again (another peer may answer), up to max_non_finite_steps times
                logger.warning(f"the state a peer gave is not finite either ({still_bad}): the swarm may have diverged")
            return
        if still_bad is not None:
            raise NonFiniteTrainingError(
                f"{still_bad}, and no peer of run {self.config.swarm.run_id!r} could give its state: restart from a "
                f"checkpoint (or with peers that train), and consider a lower optimizer.learning_rate"
            )
        logger.warning(
            "no peer could give its state: this step is skipped, training goes on from the local state "
            "(its parameters are finite)"
        )

    @staticmethod
    def _record_restore(
        history: TrainingHistory, record: RestoreRecord, on_restore: Callable[[RestoreRecord], None] | None
    ) -> None:
        history.restores.append(record)
        if on_restore is not None:
            on_restore(record)
