"""A volunteer: the DHT, the model, the data stream and the collaborative optimizer, and the loop.

    with Volunteer(get_preset("small"), data_shards="demo/shards") as volunteer:
        history = volunteer.train(max_epochs=5)

Each local step computes gradients on one local batch and hands them to hivemind.Optimizer, which
accumulates them until the swarm as a whole has processed ``target_batch_size`` samples; then peers
average their gradients and take one global step together (one "global epoch").
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

import torch
from tqdm.auto import tqdm

from collab_kit.config import RunConfig
from collab_kit.data import ShardStream, batches, caption_tokenizer, peer_data_seed
from collab_kit.model import TextToImageTransformer
from collab_kit.optim import make_optimizer
from collab_kit.swarm import join_instructions, start_dht
from collab_kit.swarm import wait_for_peers as wait_for_peers_in_swarm

logger = logging.getLogger(__name__)


@dataclass
class EpochRecord:
    """What one peer saw of one global epoch."""

    epoch: int  # the global epoch these local steps belonged to
    loss: float  # mean loss of this peer's local steps in that epoch
    local_steps: int
    samples: int  # samples this peer contributed
    averaged: bool  # gradients of this epoch were averaged with at least one other peer
    group_size: int  # peers in the gradient averaging group (1 = local gradients only)
    num_peers: int  # peers the swarm reported when the epoch ended
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainingHistory:
    epochs: List[EpochRecord] = field(default_factory=list)
    start_epoch: int = 0  # the global epoch this peer started at (> 0 when it joined late)
    final_epoch: int = 0
    local_steps: int = 0
    averaged_rounds: int = 0
    interrupted: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """One line: epochs trained, loss from first to last epoch, rounds averaged with peers."""
        if not self.epochs:
            return f"no global epoch completed (epochs {self.start_epoch}->{self.final_epoch})"
        return (f"epochs {self.start_epoch}->{self.final_epoch}: loss {self.epochs[0].loss:.4f} -> "
                f"{self.epochs[-1].loss:.4f}, {self.averaged_rounds} of {len(self.epochs)} global steps averaged "
                f"with other peers{' (interrupted)' if self.interrupted else ''}")

    def plot(self, ax=None):
        """Loss per global epoch; epochs averaged with other peers in green, lone ones in grey.

        :param ax: a matplotlib Axes to draw on (default: a new figure)
        :returns: the Axes
        """
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(6, 3.5))
        epochs = [record.epoch for record in self.epochs]
        ax.plot(epochs, [record.loss for record in self.epochs], color="tab:blue", zorder=1, label="loss")
        for averaged, color, label in ((True, "tab:green", "averaged with peers"), (False, "tab:gray", "alone")):
            chosen = [record for record in self.epochs if record.averaged == averaged]
            if chosen:
                ax.scatter([r.epoch for r in chosen], [r.loss for r in chosen], color=color, zorder=2, label=label)
        ax.set_xlabel("global epoch")
        ax.set_ylabel("mean loss of this peer's steps")
        ax.set_title("training together")
        ax.legend()
        return ax


def authorize(swarm_config):
    """A HubAuthorizer holding this volunteer's first token when the run has an authentication server, else None.

    :raises collab_kit.auth.AuthorizationError: no Hugging Face token, or the server refused (its message says why)
    """
    if not swarm_config.auth_server:
        return None
    from collab_kit.auth import AuthorizationError, HubAuthorizer, login

    token = login()
    if token is None:
        raise AuthorizationError("log in to Hugging Face first (the form above), then run this again")
    authorizer = HubAuthorizer(swarm_config.auth_server, token)
    answer = authorizer.join()
    logger.info(f"joined run {swarm_config.run_id} as {answer.username}")
    return authorizer


def model_seed(run_id: str) -> int:
    """Every peer of a run builds the same initial parameters, so that averaged gradients keep them equal."""
    return zlib.crc32(run_id.encode())


class Volunteer:
    """One peer of a collaborative run: builds everything it needs, then trains with the swarm.

    :param config: the run's configuration (a preset from collab_kit.config.get_preset, possibly changed)
    :param data_shards: folder or glob of parquet shards; defaults to ``config.data.shards``
    :param data_seed: the order in which this peer reads the data; default: derived from its peer id
    :param num_threads: torch CPU threads for this peer (None leaves torch's default)
    :param verbose: log every stage of hivemind's global steps
    """

    def __init__(self, config: RunConfig, data_shards: Optional[str] = None, data_seed: Optional[int] = None,
                 num_threads: Optional[int] = None, verbose: bool = False, authorizer=None):
        self.config = config
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.authorizer = authorizer if authorizer is not None else authorize(config.swarm)
        self.dht = start_dht(config.swarm, **({"authorizer": self.authorizer} if self.authorizer else {}))
        self._binding_keeper = None
        try:
            peer_gate = None
            if self.authorizer is not None:
                from collab_kit.auth import BindingKeeper, PeerGate

                self._binding_keeper = BindingKeeper(self.dht, self.authorizer, config.swarm.run_id)
                peer_gate = PeerGate(self.dht, config.swarm.run_id, self.authorizer.server_public_key.to_bytes())
            self.join_line = join_instructions(self.dht, config.swarm.run_id)
            torch.manual_seed(model_seed(config.swarm.run_id))
            self.model = TextToImageTransformer(config.model)
            if data_seed is None:
                data_seed = peer_data_seed(self.dht.peer_id.to_bytes(), config.data.seed)
            tokenizer = caption_tokenizer(config.data.tokenizer, config.model.pad_token_id)
            if tokenizer.vocab_size > config.model.text_vocab_size:
                raise ValueError(f"the caption tokenizer {config.data.tokenizer!r} has {tokenizer.vocab_size} tokens "
                                 f"but the model reads {config.model.text_vocab_size}: set model.text_vocab_size")
            self.stream = ShardStream(data_shards or config.data.shards, config.model.text_length,
                                      config.model.image_length, tokenizer=tokenizer,
                                      shuffle_buffer=config.data.shuffle_buffer, seed=data_seed,
                                      codebook_size=config.model.codebook_size)
            self.optimizer = make_optimizer(self.model, self.dht, config.swarm.run_id, config.optimizer,
                                            client_mode=config.swarm.client_mode, verbose=verbose,
                                            peer_gate=peer_gate)
        except BaseException:
            if self._binding_keeper is not None:
                self._binding_keeper.stop()
            self.dht.shutdown()
            raise
        self._closed = False
        self._stop_requested = threading.Event()

    def request_stop(self):
        """Ask ``train`` to stop after the current step (safe to call from a signal handler or a thread)."""
        self._stop_requested.set()

    # -- the swarm's view -----------------------------------------------------------------------

    @property
    def local_epoch(self) -> int:
        return self.optimizer.local_epoch

    @property
    def global_progress(self):
        return self.optimizer.tracker.global_progress

    def catch_up(self, timeout: float = 10.0) -> bool:
        """If the swarm is ahead, download its current parameters and optimizer state.

        :param timeout: seconds to wait for the swarm's progress before deciding
        :returns: True if state was loaded from peers
        """
        self.optimizer.tracker.fetched_global_progress_this_epoch.wait(timeout)
        if self.optimizer.local_epoch < self.optimizer.tracker.global_epoch:
            logger.info(f"the swarm is at epoch {self.optimizer.tracker.global_epoch}: loading its state")
            self.optimizer.load_state_from_peers()
            return True
        return False

    # -- training -------------------------------------------------------------------------------

    def train(self, epochs: Optional[int] = None, max_epochs: Optional[int] = None, max_steps: Optional[int] = None,
              progress: bool = True, on_epoch: Optional[Callable[[EpochRecord], None]] = None,
              wait_for_peers: int = 1, wait_timeout: float = 120.0) -> TrainingHistory:
        """Train with the swarm until one of the limits is reached.

        Ctrl-C (or ``request_stop()``) stops training between steps and returns what was done so far
        (``interrupted=True``); the swarm goes on without this peer.

        :param epochs: train this many global epochs from the swarm's current epoch
        :param max_epochs: stop once the swarm's global epoch reaches this number
        :param max_steps: stop after this many local steps
        :param progress: show a progress bar with loss, global epoch, samples accumulated and peers
        :param on_epoch: called with an EpochRecord each time a global epoch ends
        :param wait_for_peers: first wait until this many peers (this one included) are ready to train
        :param wait_timeout: seconds to wait for them before raising SwarmConnectionError
        """
        if epochs is None and max_epochs is None and max_steps is None:
            raise ValueError("train() needs epochs, max_epochs or max_steps, otherwise it would never stop")
        history = TrainingHistory()
        bar = None
        try:
            self.catch_up()
            if epochs is not None:
                max_epochs = self.local_epoch + epochs if max_epochs is None else min(max_epochs,
                                                                                       self.local_epoch + epochs)
            stream = batches(self.stream, self.config.optimizer.batch_size_per_step)
            first_batch = next(stream)  # the data pipeline is warm before the others are told we are ready
            if wait_for_peers > 1:
                present = wait_for_peers_in_swarm(self.dht, self.config.swarm.run_id, wait_for_peers, wait_timeout,
                                                  stop=self._stop_requested)
                logger.info(f"{present} peers are ready to train")
            history.start_epoch = self.local_epoch
            bar = tqdm(total=max(0, max_epochs - self.local_epoch) if max_epochs is not None else max_steps,
                       disable=not progress, unit="epoch" if max_epochs is not None else "step", desc="training",
                       dynamic_ncols=True)
            self._run_steps(itertools.chain([first_batch], stream), history, bar, max_epochs, max_steps, on_epoch)
        except KeyboardInterrupt:
            logger.warning("interrupted: stopping training (the swarm goes on without this peer)")
            history.interrupted = True
        finally:
            if bar is not None:
                bar.close()
        history.final_epoch = self.local_epoch
        history.averaged_rounds = self.optimizer.averaged_rounds
        return history

    def _run_steps(self, stream, history: TrainingHistory, bar, max_epochs: Optional[int],
                   max_steps: Optional[int], on_epoch: Optional[Callable[[EpochRecord], None]]) -> None:
        """The training loop proper: one local step per batch until a limit is reached."""
        epoch_losses: List[float] = []
        epoch_start = time.perf_counter()
        batch_size = self.config.optimizer.batch_size_per_step
        self.model.train()
        for batch in stream:
            if self._stop_requested.is_set():
                raise KeyboardInterrupt
            if (max_epochs is not None and self.local_epoch >= max_epochs) or \
                    (max_steps is not None and history.local_steps >= max_steps):
                return
            epoch_before, rounds_before = self.local_epoch, self.optimizer.averaged_rounds
            loss = self.model(**batch).loss
            loss.backward()
            self.optimizer.step()  # accumulates; when the swarm has target_batch_size samples, a global step
            self.optimizer.zero_grad()
            history.local_steps += 1
            epoch_losses.append(loss.item())

            if self.local_epoch != epoch_before:
                record = EpochRecord(
                    epoch=epoch_before, loss=sum(epoch_losses) / len(epoch_losses), local_steps=len(epoch_losses),
                    samples=len(epoch_losses) * batch_size, averaged=self.optimizer.averaged_rounds > rounds_before,
                    group_size=self.optimizer.last_group_size, num_peers=self.global_progress.num_peers,
                    seconds=time.perf_counter() - epoch_start)
                history.epochs.append(record)
                epoch_losses, epoch_start = [], time.perf_counter()
                if on_epoch is not None:
                    on_epoch(record)
                if max_epochs is not None:
                    bar.update(self.local_epoch - epoch_before)
            if max_epochs is None:
                bar.update(1)
            swarm = self.global_progress
            bar.set_postfix(loss=f"{loss.item():.3f}", epoch=self.local_epoch,
                            samples=f"{swarm.samples_accumulated}/{swarm.target_batch_size}", peers=swarm.num_peers,
                            refresh=False)

    def _apply_pending_update(self) -> None:
        """Wait for an optimizer step running in the background (delayed updates) and apply it to the model."""
        self.optimizer.state_averager.step(wait_for_delayed_updates=True, apply_delayed_updates=True)

    def parameters_snapshot(self) -> Dict[str, torch.Tensor]:
        """The model's current parameters, after any optimizer step still running in the background."""
        self._apply_pending_update()
        return {name: param.detach().clone() for name, param in self.model.named_parameters()}

    def save_checkpoint(self, folder: str, metadata: Optional[dict] = None) -> str:
        """Write the model as it is now, with the run's configuration, as a checkpoint folder
        (collab_kit.checkpoint: what ``generate_images`` and ``load_checkpoint`` read)."""
        from collab_kit.checkpoint import save_checkpoint

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
            if self._binding_keeper is not None:
                self._binding_keeper.stop()
            self.optimizer.shutdown()
        finally:
            self.dht.shutdown()

    def __enter__(self) -> "Volunteer":
        return self

    def __exit__(self, *exc_info):
        self.close()
