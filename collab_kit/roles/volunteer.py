"""A volunteer: the DHT, the model, the data stream and the collaborative optimizer, and the loop.

    with Volunteer.from_config(get_preset("small"), data_shards="demo/shards") as volunteer:
        history = volunteer.train(max_epochs=5)

Each local step computes gradients on one local batch and hands them to hivemind.Optimizer, which
accumulates them until the swarm as a whole has processed ``target_batch_size`` samples; then peers
average their gradients and take one global step together (one "global epoch").

A local step whose loss or gradients are not finite (nan, inf) never reaches the optimizer: its gradients
would be averaged into every peer's step and poison the whole swarm. The volunteer drops them and loads
the swarm's parameters and optimizer state instead (collab_kit.roles.recovery).

What it reports (epoch records, restores, lone-training warnings, the history) is collab_kit.roles.records.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

import psutil
import torch
from tqdm.auto import tqdm

from collab_kit import memory
from collab_kit.config import RunConfig, SettingProblem
from collab_kit.data.stream import ShardStream, batches, peer_data_seed, peer_stream
from collab_kit.data.synthetic import SYNTHETIC_SAMPLES
from collab_kit.model.checkpoint import save_checkpoint
from collab_kit.model.device import DeviceFacts, DevicePlan, LossScaler, choose_device, fp32_plan, read_device_facts
from collab_kit.model.transformer import TextToImageTransformer, initial_model
from collab_kit.roles.epoch_reports import EpochReportsMixin
from collab_kit.roles.records import (
    EpochRecord,
    LoneTrainingWatch,
    LoneWarning,
    RestoreRecord,
    TrainingHistory,
    undialable_reason,
)
from collab_kit.roles.recovery import NonFiniteRecoveryMixin, NonFiniteTrainingError  # noqa: F401 (its error)
from collab_kit.swarm.dht import join_instructions
from collab_kit.swarm.dht import wait_for_peers as wait_for_peers_in_swarm
from collab_kit.swarm.membership import SwarmMembership
from collab_kit.swarm.metrics import MetricsPublisher
from collab_kit.swarm.optimizer import CollaborativeOptimizer, make_optimizer
from collab_kit.swarm.run_card import data_for_peer
from collab_kit.swarm.watchdog import SwarmWatchdog

logger = logging.getLogger(__name__)

# seconds training waits after a step that could not get the swarm's state, before the next step tries again; each
# failure in a row takes the next wait, the last one repeating. Without a wait a peer behind would try at every batch,
# spending its data and a core (tests/roles/test_faults.py::
# test_a_peer_that_cannot_get_the_swarms_state_waits_longer_between_tries_instead_of_spinning)
STATE_RETRY_WAITS = (1.0, 2.0, 4.0, 8.0, 15.0)


class Volunteer(EpochReportsMixin, NonFiniteRecoveryMixin):
    """One peer of a collaborative run: trains its model with the swarm, step by step, and reports each epoch.

    ``Volunteer.from_config(config)`` builds every part (what ``collab-kit join`` and the notebooks do); the
    constructor takes them built, so a test or a script can give its own (a model that goes wrong on purpose, an
    optimizer built another way). The volunteer owns its parts: ``close`` shuts them down.

    :param config: the run's configuration, with client mode found out (``membership.config``)
    :param membership: this peer's membership of the run (its DHT, token binding and averagers' gate)
    :param model: the model to train (every peer starts from the same one: collab_kit.model.initial_model)
    :param stream: this peer's stream of samples (collab_kit.data.stream.ShardStream)
    :param optimizer: the collaborative optimizer of ``model`` on ``membership.dht`` (collab_kit.swarm.optimizer)
    :param metrics: this peer's signed metrics record for the monitor (None: a publisher on the membership's DHT)
    :param plan: the device and precision it trains with (collab_kit.model.device; None: fp32 where the model is)
    """

    def __init__(
        self,
        config: RunConfig,
        membership: SwarmMembership,
        model: TextToImageTransformer,
        stream: ShardStream,
        optimizer: CollaborativeOptimizer,
        metrics: MetricsPublisher | None = None,
        plan: DevicePlan | None = None,
    ):
        self.config, self.membership, self.model, self.stream, self.optimizer = (
            config,
            membership,
            model,
            stream,
            optimizer,
        )
        # where the model, the batches, the loss and the gradients live, and in what precision (the optimizer's
        # offloaded state stays on the CPU); fp16's loss scale is this peer's own
        self.plan = plan if plan is not None else fp32_plan(next(model.parameters()).device)
        self.scaler = LossScaler(self.plan, model.parameters())
        self.dht, self.authorizer, self.reachability = membership.dht, membership.authorizer, membership.reachability
        run_card = membership.run_card
        self.join_line = join_instructions(self.dht, config, data=run_card.data if run_card is not None else None)
        # this peer's signed record for the monitor (collab_kit.swarm.metrics), refreshed every global epoch
        self.metrics = (
            metrics
            if metrics is not None
            else MetricsPublisher(self.dht, config.swarm.run_id, username=membership.username)
        )
        # back in the DHT when it lost its neighbours; a cut link said, waited out and followed by loading the state
        self._watchdog = SwarmWatchdog(
            self.dht, config.swarm.initial_peers, on_link_down=self._on_link_down, on_link_back=self._on_link_back
        )
        optimizer.serve_state_to_anchors(config.swarm)
        optimizer.on_state_download = self._report_state_download  # the monitor's page shows it until the next epoch
        self._closed = False
        self._stop_requested = threading.Event()
        self._non_finite_streak = 0
        self._failed_loads = 0  # steps in a row that found this peer behind and could not get the swarm's state
        self._lone_watch = LoneTrainingWatch()
        self._undialable = undialable_reason(config, self.reachability)
        self.data_description = "training on its own stream"  # what from_config chose, in words
        self.device_note: str | None = None  # why from_config trains elsewhere than asked (a GPU too small)

    def _report_state_download(self) -> None:
        try:
            self.metrics.publish_activity(
                "downloading_state", self.optimizer.local_epoch, self.plan.name, self.plan.precision
            )
        except Exception as e:  # the DHT may be out of reach: the download goes on all the same
            logger.debug(f"could not say that this peer downloads the state: {e!r}")

    @classmethod
    def from_config(
        cls,
        config: RunConfig,
        data_shards: str | None = None,
        data_seed: int | None = None,
        num_threads: int | None = None,
        verbose: bool = False,
        authorizer=None,
        model: TextToImageTransformer | None = None,
        optimizer_factory: Callable[..., CollaborativeOptimizer] = make_optimizer,
        data_setting: str = "--data",
        synthetic_fallback: bool = False,
        synthetic_samples: int = SYNTHETIC_SAMPLES,
        device: str = "auto",
        precision: str = "auto",
        fit_settings: bool = True,
        device_facts: DeviceFacts | None = None,
    ) -> Volunteer:
        """Join the run and build every part of a volunteer from its configuration.

        Before it builds anything, the peer checks that it fits the run (collab_kit.swarm.run_card: run id, preset,
        shared settings, and the data's codebook, grid, tokenizer and format) and says what does not in one
        sentence; with no data of its own it streams the run's. The swarm's first peer publishes the run's card.

        :param config: the run's configuration (a preset from collab_kit.config.get_preset, possibly changed)
        :param data_shards: a folder or glob of parquet shards, a Hub dataset id, or "synthetic"; defaults to
          ``config.data.shards``, then to the run's data
        :param data_seed: the order in which this peer reads the data; default: derived from its peer id
        :param num_threads: torch CPU threads for this peer (None leaves torch's default)
        :param verbose: log every stage of hivemind's global steps
        :param authorizer: a HubAuthorizer that has joined already (default: log in, in an authorized run)
        :param model: the model to train (default: the run's initial model)
        :param optimizer_factory: builds the optimizer, called as ``make_optimizer`` is
        :param data_setting: how the user names the data, for messages (``--data``; ``DATA_SHARDS`` in a notebook)
        :param synthetic_fallback: with no data named by this peer or the run, train on synthetic data, for a swarm of
          its own or one on this machine (never for a run elsewhere that did not choose it)
        :param synthetic_samples: samples of synthetic data to make, when it trains on them
        :param device: "auto" (the GPU when there is one), "cpu", "cuda" or "cuda:N" (collab_kit.model.device)
        :param precision: "auto" (bf16 on Ampere and newer, fp16 with loss scaling on older cards, fp32 on the CPU),
          "fp32", "bf16" or "fp16"
        :param fit_settings: on a GPU, train with the micro-batch and reversible layers that fit its memory, as the
          preflight chooses them (collab_kit.memory.fit_to_device); on the CPU, without reversible layers when the RAM
          holds the preset's micro-batch without them; False keeps ``config``'s. Whatever this says, a GPU
          that "auto" chose and that cannot hold the model is given up for the CPU, with a warning that says why
        :param device_facts: the machine's GPUs (None: read from torch); a test gives a card this machine lacks
        :raises collab_kit.errors.CollabKitError: the run refused this peer, no initial peer answered, the run is
          another or has other settings, or the data cannot be read or does not fit (each message says what to do)
        """
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        device_facts = device_facts if device_facts is not None else read_device_facts()
        plan = choose_device(device, precision, device_facts)  # a device not here: one sentence, before anything starts
        fit = memory.fit_to_device(config, plan, device_facts, int(psutil.virtual_memory().available), device)
        if fit.note is not None:
            logger.warning(fit.note)
        plan = fit.plan
        membership = SwarmMembership(config, authorizer=authorizer)
        try:
            config = membership.config
            if fit_settings:  # a peer's own settings: after the run's card was compared
                fitted = fit.apply(config)
                if fitted.model.reversible != config.model.reversible and plan.device.type == "cpu":
                    logger.info(f"training without reversible layers: {fit.recommendation}")
                config = fitted
            data = data_for_peer(
                data_shards or config.data.shards,
                membership.run_card,
                config,
                data_setting,
                synthetic_fallback,
                synthetic_samples,
            )
            if membership.is_first_peer:  # others join this swarm through this peer: they read its card
                membership.announce_run(data.source)
            if model is None:
                model = initial_model(config.model, config.swarm.run_id)
            model.to(plan.device)  # before the optimizer: hivemind keeps its offloaded copy on the CPU
            if data_seed is None:
                data_seed = peer_data_seed(membership.dht.peer_id.to_bytes(), config.data.seed)
            stream = peer_stream(config, data.shards, data_seed)
            optimizer = optimizer_factory(
                model,
                membership.dht,
                config.swarm.run_id,
                config.optimizer,
                client_mode=config.swarm.client_mode,
                verbose=verbose,
                peer_gate=membership.peer_gate,
            )
            volunteer = cls(config, membership, model, stream, optimizer, plan=plan)
            volunteer.data_description = data.description
            volunteer.device_note = fit.note
            return volunteer
        except BaseException:
            membership.close()
            raise

    def request_stop(self):
        """Ask ``train`` to stop after the current step (safe to call from a signal handler or a thread)."""
        self._stop_requested.set()

    # -- a cut link (called by the watchdog's thread) -------------------------------------------

    def _on_link_down(self) -> None:
        """The round under way cannot finish without the link: give it up now rather than at its timeout, so that
        nothing of this peer waits for it when the link is back."""
        optimizer = getattr(self, "optimizer", None)  # None while the constructor still builds it
        if optimizer is not None and optimizer.cancel_pending_round():
            logger.info("gave up the averaging round under way: it cannot finish while the link is down")

    def _on_link_back(self) -> None:
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None:
            optimizer.request_resync("its link to the swarm was down, and the swarm went on meanwhile")

    # -- the swarm's view -----------------------------------------------------------------------

    @property
    def local_epoch(self) -> int:
        return self.optimizer.local_epoch

    @property
    def global_progress(self):
        return self.optimizer.tracker.global_progress

    def catch_up(self, timeout: float = 30.0) -> bool:
        """If the swarm is ahead, download its current parameters and optimizer state.

        :param timeout: seconds to wait for the swarm's progress before deciding (a busy machine or a thin link can
          take several); without it, this peer starts at its own epoch and its first step finds it behind
        :returns: True if state was loaded from peers
        """
        if not self.optimizer.tracker.fetched_global_progress_this_epoch.wait(timeout):
            logger.info(
                f"the swarm's progress did not come within {timeout:.0f} s: starting at this peer's epoch "
                f"({self.local_epoch}); its first step loads the swarm's state if the swarm is ahead"
            )
        if self.optimizer.local_epoch < self.optimizer.tracker.global_epoch:
            logger.info(f"the swarm is at epoch {self.optimizer.tracker.global_epoch}: loading its state")
            if self.optimizer.load_state_from_peers():
                return True
            logger.warning(
                f"the swarm is at epoch {self.optimizer.tracker.global_epoch} but no peer gave its "
                f"state: starting from this peer's own (epoch {self.local_epoch})"
            )
        return False

    # -- training -------------------------------------------------------------------------------

    def train(
        self,
        epochs: int | None = None,
        max_epochs: int | None = None,
        max_steps: int | None = None,
        progress: bool = True,
        on_epoch: Callable[[EpochRecord], None] | None = None,
        wait_for_peers: int = 1,
        wait_timeout: float = 120.0,
        on_restore: Callable[[RestoreRecord], None] | None = None,
        on_lone: Callable[[LoneWarning], None] | None = None,
        on_link: Callable[[str], None] | None = None,
        max_load: float = 1.0,
    ) -> TrainingHistory:
        """Train with the swarm until one of the limits is reached.

        Ctrl-C (or ``request_stop()``) stops training between steps and returns what was done so far
        (``interrupted=True``); the swarm goes on without this peer.

        :param epochs: train this many global epochs from the swarm's current epoch
        :param max_epochs: stop once the swarm's global epoch reaches this number
        :param max_steps: stop after this many local steps
        :param progress: show a progress bar with loss, global epoch, samples accumulated and peers
        :param on_epoch: called with an EpochRecord each time a global epoch ends
        :param wait_for_peers: first wait until this many peers (this one included) are ready to train, unless
          the swarm is already past its first epoch
        :param wait_timeout: seconds to wait for them before raising SwarmConnectionError
        :param on_restore: called with a RestoreRecord each time this peer loads (or tries to load) the swarm's
          state: when it starts behind the swarm, when a step finds it behind or apart from the swarm, and after a
          step whose loss or gradients were not finite
        :param on_lone: called with a LoneWarning when this peer's global steps go unaveraged for a few epochs while
          others train (also logged as a warning, whatever this is)
        :param on_link: called with "down" when training stops to wait for the link to the swarm (no initial peer
          accepts a connection), and with "back" when it goes on
        :param max_load: the share of its time this peer computes, in (0, 1]: below 1 it pauses after each local step
          for as long again as the step's passes took, times ``1 / max_load - 1`` (a machine its owner keeps using, or
          a slower one: the swarm sees the lower throughput and plans its epochs with it;
          tests/roles/test_volunteer.py::test_a_volunteer_at_a_quarter_load_pauses_three_times_as_long_as_it_computes)
        :raises NonFiniteTrainingError: the model is not finite and no peer can give its state, or the loss stays
          non-finite for ``max_non_finite_steps`` steps in a row
        """
        if epochs is None and max_epochs is None and max_steps is None:
            raise ValueError("train() needs epochs, max_epochs or max_steps, otherwise it would never stop")
        if not 0.0 < max_load <= 1.0:
            raise SettingProblem(
                f"max_load={max_load!r} is not allowed: give the share of its time this peer computes, "
                f"more than 0 and at most 1 (1: all of it)"
            )
        history = TrainingHistory()
        bar = None
        try:
            epoch_before = self.local_epoch
            if self.catch_up():
                self._record_restore(
                    history,
                    RestoreRecord(
                        reason="behind_swarm",
                        problem=f"the swarm was at epoch {self.local_epoch}",
                        loaded=True,
                        epoch_before=epoch_before,
                        epoch_after=self.local_epoch,
                        local_step=0,
                    ),
                    on_restore,
                )
            if epochs is not None:
                max_epochs = (
                    self.local_epoch + epochs if max_epochs is None else min(max_epochs, self.local_epoch + epochs)
                )
            stream = batches(self.stream, self.config.optimizer.batch_size_per_step)
            first_batch = next(stream)  # the data pipeline is warm before the others are told we are ready
            # a swarm past epoch 0 is already training: a peer that joins or comes back late starts at once (the
            # others announced themselves when they started, and those records have long expired)
            if wait_for_peers > 1 and self.optimizer.tracker.global_epoch == 0:
                present = wait_for_peers_in_swarm(
                    self.dht, self.config.swarm.run_id, wait_for_peers, wait_timeout, stop=self._stop_requested
                )
                logger.info(f"{present} peers are ready to train")
            history.start_epoch = self.local_epoch
            history.device, history.precision = str(self.plan.device), self.plan.precision
            bar = tqdm(
                total=max(0, max_epochs - self.local_epoch) if max_epochs is not None else max_steps,
                disable=not progress,
                unit="epoch" if max_epochs is not None else "step",
                desc="training",
                dynamic_ncols=True,
            )
            self._run_steps(
                itertools.chain([first_batch], stream),
                history,
                bar,
                max_epochs,
                max_steps,
                on_epoch,
                on_restore,
                on_lone,
                on_link,
                max_load,
            )
        except KeyboardInterrupt:
            logger.warning("interrupted: stopping training (the swarm goes on without this peer)")
            history.interrupted = True
        finally:
            if bar is not None:
                bar.close()
        history.final_epoch = self.local_epoch
        history.averaged_rounds = self.optimizer.averaged_rounds
        history.overlapped_steps = self.optimizer.overlapped_steps
        history.bytes_sent, history.bytes_served = self.optimizer.sent_bytes()
        return history

    def _run_steps(
        self,
        stream,
        history: TrainingHistory,
        bar,
        max_epochs: int | None,
        max_steps: int | None,
        on_epoch: Callable[[EpochRecord], None] | None,
        on_restore: Callable[[RestoreRecord], None] | None = None,
        on_lone: Callable[[LoneWarning], None] | None = None,
        on_link: Callable[[str], None] | None = None,
        max_load: float = 1.0,
    ) -> None:
        """The training loop proper: one local step per batch until a limit is reached."""
        epoch_losses: list[float] = []
        epoch_start = time.perf_counter()
        # with overlapped rounds (local-update mode), an epoch is reported once its round's outcome is in:
        # (epoch, its losses, its seconds)
        pending: list[tuple] = []
        self.model.train()

        def limit_reached() -> bool:
            return (max_epochs is not None and self.local_epoch >= max_epochs) or (
                max_steps is not None and history.local_steps >= max_steps
            )

        def report_pending(wait: bool) -> None:
            if wait:
                self.optimizer.finish_round_in_flight()
            while pending and self.optimizer.epoch_in_flight != pending[0][0]:
                record = self._background_epoch_record(*pending.pop(0))
                self._report_epoch(record, history, on_epoch, on_lone)

        for batch in stream:
            # a peer whose last step reached its limit is done, link or no link: when the others stop at the same
            # epoch, their leaving looks like a cut link, and waiting for it to come back would be waiting for ever
            if self._watchdog.link_down.is_set() and not limit_reached():
                self._wait_for_link(history, on_link)
                epoch_losses, epoch_start = [], time.perf_counter()  # the swarm's state replaces what came before
            if self._stop_requested.is_set():
                raise KeyboardInterrupt
            if limit_reached():
                report_pending(wait=True)  # the last round's outer step, before this peer stops
                return
            epoch_before, rounds_before = self.local_epoch, self.optimizer.averaged_rounds
            passes_start = time.perf_counter()
            with self.plan.autocast():
                loss = self.model(**self.plan.move(batch)).loss
            finite_loss = bool(torch.isfinite(loss.detach()))
            scaled_step_taken = finite_loss and self.scaler.backward_and_unscale(loss)
            self._pause_for_load(time.perf_counter() - passes_start, max_load, history)
            if finite_loss and not scaled_step_taken:
                # fp16 gradients that overflowed: the scaler skipped the step and lowered its scale (a normal event of
                # fp16 training, not a fault: nothing is reloaded, and the swarm never sees them)
                self.optimizer.zero_grad()
                history.overflow_steps += 1
                continue
            problem = self._non_finite_step_problem(loss)  # the loss, or the true (unscaled) gradients
            if problem is not None:
                self._recover_from_non_finite_step(problem, history, on_restore)
                # the losses so far belong to the state just replaced
                epoch_losses, epoch_start = [], time.perf_counter()
                continue
            self._non_finite_streak = 0
            self.optimizer.step()  # accumulates; when the swarm has target_batch_size samples, a global step
            self.optimizer.zero_grad()
            history.local_steps += 1
            loads = self._record_step_loads(history, on_restore)
            if loads and not loads[-1]["loaded"]:
                self._wait_before_loading_again()
            elif loads:
                self._failed_loads = 0
            epoch_losses.append(loss.item())

            report_pending(wait=False)
            if self.local_epoch != epoch_before:
                seconds = time.perf_counter() - epoch_start
                if self.optimizer.epoch_in_flight == epoch_before:  # its round averages in the background
                    pending.append((epoch_before, epoch_losses, seconds))
                else:
                    record = self._epoch_record(epoch_before, rounds_before, epoch_losses, seconds)
                    self._report_epoch(record, history, on_epoch, on_lone)
                epoch_losses, epoch_start = [], time.perf_counter()
                self.optimizer.serve_state_to_anchors(self.config.swarm)  # an anchor that joined since
                if max_epochs is not None:
                    bar.update(self.local_epoch - epoch_before)
                # a global step changed the parameters: once per epoch, check them (a nan in a row of the
                # embeddings that no batch has used yet does not show in the loss)
                problem = self._non_finite_parameters_problem()
                if problem is not None:
                    self._recover_from_non_finite_step(problem, history, on_restore, step_dropped=False)
            if max_epochs is None:
                bar.update(1)
            swarm = self.global_progress
            bar.set_postfix(
                loss=f"{loss.item():.3f}",
                epoch=self.local_epoch,
                samples=f"{swarm.samples_accumulated}/{swarm.target_batch_size}",
                peers=swarm.num_peers,
                refresh=False,
            )
        report_pending(wait=True)  # the data ran out

    def _pause_for_load(self, passes_seconds: float, max_load: float, history: TrainingHistory) -> None:
        """After a step's passes that took ``passes_seconds``: wait so that computing is ``max_load`` of the time (a
        stop request ends the wait)."""
        history.compute_seconds += passes_seconds
        if max_load < 1.0:
            pause = passes_seconds * (1.0 / max_load - 1.0)
            self._stop_requested.wait(pause)
            history.paused_seconds += pause

    def _wait_for_link(self, history: TrainingHistory, on_link: Callable[[str], None] | None = None) -> None:
        """Training waits while the link to the swarm is down: steps taken meanwhile could be averaged with nobody, and
        the swarm's state (loaded when the link is back) would replace them anyway."""
        history.link_outages += 1
        if on_link is not None:
            on_link("down")
        while self._watchdog.link_down.is_set() and not self._stop_requested.is_set():
            self._stop_requested.wait(0.2)
        if not self._stop_requested.is_set() and on_link is not None:
            on_link("back")

    def _record_step_loads(
        self, history: TrainingHistory, on_restore: Callable[[RestoreRecord], None] | None
    ) -> list[dict]:
        """Report the swarm's states that the step just taken loaded (this peer found itself behind or apart from the
        swarm: it joined while the swarm's progress was still unknown to it, missed a round, or its link was cut), and
        return them (each says whether a peer gave its state: ``loaded``)."""
        loads, self.optimizer.step_loads = self.optimizer.step_loads, []
        for load in loads:
            self._record_restore(
                history, RestoreRecord(reason="behind_swarm", local_step=history.local_steps, **load), on_restore
            )
        return loads

    def _wait_before_loading_again(self) -> None:
        """A step could not get the swarm's state: wait (STATE_RETRY_WAITS) before the next step tries again, or until a
        stop is asked for or the link is found down (the loop then waits for it)."""
        wait = STATE_RETRY_WAITS[min(self._failed_loads, len(STATE_RETRY_WAITS) - 1)]
        self._failed_loads += 1
        logger.info(
            f"no peer gave the swarm's state ({self._failed_loads} time(s) in a row): trying again in {wait:.0f} s"
        )
        deadline = time.monotonic() + wait
        while not self._stop_requested.is_set() and not self._watchdog.link_down.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._stop_requested.wait(min(left, 0.2))

    # -- the model as it is now -----------------------------------------------------------------

    def _apply_pending_update(self) -> None:
        """Wait for an optimizer step running in the background (delayed updates) and apply it to the model."""
        self.optimizer.state_averager.step(wait_for_delayed_updates=True, apply_delayed_updates=True)

    def parameters_snapshot(self) -> dict[str, torch.Tensor]:
        """The model's current parameters, after any optimizer step still running in the background."""
        self._apply_pending_update()
        return {name: param.detach().clone() for name, param in self.model.named_parameters()}

    def save_checkpoint(self, folder: str, metadata: dict | None = None) -> str:
        """Write the model as it is now, with the run's configuration, as a checkpoint folder
        (collab_kit.model.checkpoint: what ``generate_images`` and ``load_checkpoint`` read)."""

        self._apply_pending_update()
        metadata = dict(dict(global_epoch=self.local_epoch, run_id=self.config.swarm.run_id), **(metadata or {}))
        return save_checkpoint(self.model, self.config, folder, metadata=metadata)

    # -- shutdown -------------------------------------------------------------------------------

    def close(self):
        """Leave the swarm: stop the optimizer's averagers, then the DHT and its p2p daemon."""
        if self._closed:
            return
        self._closed = True
        try:
            self._watchdog.stop()
            self.optimizer.shutdown()
        finally:
            self.membership.close()

    def __enter__(self) -> Volunteer:
        return self

    def __exit__(self, *exc_info):
        self.close()
