"""The paper's optimizer: hivemind.Optimizer around 8-bit LAMB, offloaded to CPU (section 3.3).

What each piece is for:
- ``hivemind.Optimizer`` accumulates gradients until the whole swarm has processed
  ``target_batch_size`` samples, averages them with the other peers, then steps. Peers of any speed
  contribute as many samples as they can, and the result is the same as one synchronous large batch.
- 8-bit LAMB (bitsandbytes) keeps its two statistics in 8 bits: about 4x less optimizer memory.
  LAMB's layer-wise trust ratio is what makes batches of thousands of samples trainable.
- ``offload_optimizer`` keeps the optimizer and its statistics on the CPU, leaving GPU memory to
  the model; ``delay_optimizer_step`` runs that CPU step in the background while the GPU goes on
  computing gradients for the next step.
- Size-adaptive compression: gradients of large tensors travel in 8 bits, small tensors (biases,
  norms) in fp16, where 8-bit quantization would cost more accuracy than it saves bytes.
"""
from __future__ import annotations

import logging
import warnings
from functools import partial
from typing import Callable, Iterable, List, Optional

import bitsandbytes as bnb
import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import Float16Compression, NoCompression, SizeAdaptiveCompression, Uniform8BitQuantization
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager

from collab_kit import robust
from collab_kit.config import OptimizerConfig

logger = logging.getLogger(__name__)
# hivemind's 8-bit quantization calls a torch function that torch 2.13 marks as deprecated; nothing to act on
warnings.filterwarnings("ignore", message="torch.quantize_per_tensor", category=UserWarning)


class LAMB8bit(bnb.optim.AdamW8bit):
    """8-bit LAMB: bitsandbytes' blockwise 8-bit Adam statistics, LAMB's layer-wise trust ratio, global clipping.

    LAMB takes the Adam(W) direction ``r`` of each weight matrix and rescales the step to
    ``lr * ||w|| / ||r||`` times ``r``: every layer moves by the same fraction of its norm, whatever
    its gradients' scale, which is what keeps batches of thousands of samples trainable.
    bitsandbytes' own ``LAMB8bit`` (0.50) does not apply that ratio in its 8-bit update, so it is
    applied here, parameter by parameter, after bitsandbytes' 8-bit AdamW update.

    Parameter groups with ``layer_adaptation=False`` (biases and norms, see ``parameter_groups``)
    get the plain AdamW step, as in the LAMB paper: a bias that starts at zero could never move.

    Clipping belongs here, not in the training loop: hivemind.Optimizer steps on gradients averaged
    over the whole swarm, which only exist inside its optimizer step.

    :param params: parameters or parameter groups
    :param max_grad_norm: clip the norm of all gradients together to this value; None disables clipping
    :param kwargs: passed to ``bitsandbytes.optim.AdamW8bit`` (lr, betas, eps, weight_decay, min_8bit_size)
    """

    def __init__(self, params, max_grad_norm: Optional[float] = None, **kwargs):
        super().__init__(params, **kwargs)
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: Optional[float] = None

    @torch.no_grad()
    def step(self, closure=None):
        if self.max_grad_norm is not None:
            grads = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm))
        return super().step(closure)

    @torch.no_grad()
    def update_step(self, group, p, gindex, pindex):
        if not group.get("layer_adaptation", True):
            return super().update_step(group, p, gindex, pindex)
        before = p.detach().clone()
        super().update_step(group, p, gindex, pindex)  # p <- p - lr * r, with r = adam direction + wd * p
        update = p.detach() - before
        weight_norm, update_norm = before.norm(), update.norm()
        if weight_norm > 0 and update_norm > 0:
            # the trust ratio: a step of length lr * ||w|| along r
            p.copy_(before.add_(update, alpha=float(group["lr"] * weight_norm / update_norm)))


def linear_warmup_then_decay(step: int, warmup_steps: int, total_steps: int) -> float:
    """Learning-rate multiplier: rises linearly over warm-up, then falls linearly to 0 at total_steps.

    Step 0 already gets a small non-zero rate, so that the first global step does something.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    """Two groups: matrices and embeddings decay and adapt their step to their norm (LAMB);
    biases and norm weights (1-d tensors) do neither."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 else decay).append(param)
    return [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0, layer_adaptation=False)]


def gradient_compression(threshold: int) -> SizeAdaptiveCompression:
    """8-bit uniform quantization for tensors of ``threshold`` elements or more, fp16 for smaller ones."""
    return SizeAdaptiveCompression(threshold=threshold, less=Float16Compression(),
                                   greater_equal=Uniform8BitQuantization())


def make_lamb8bit(params: Iterable, config: OptimizerConfig) -> LAMB8bit:
    """The bare 8-bit LAMB with the paper's hyperparameters (also the baseline of the benchmarks)."""
    return LAMB8bit(params, max_grad_norm=config.max_grad_norm, lr=config.learning_rate, betas=config.betas,
                           eps=config.eps, weight_decay=config.weight_decay, min_8bit_size=config.min_8bit_size)


def make_scheduler_factory(config: OptimizerConfig):
    """A factory hivemind calls with the (offloaded) optimizer to build the linear warm-up schedule."""
    schedule = partial(linear_warmup_then_decay, warmup_steps=config.warmup_steps, total_steps=config.total_steps)
    return partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=schedule)


class DownloadRecorderMixin(DecentralizedAverager):
    """Remembers the epoch of the last state ``load_state_from_peers`` downloaded (None: no peer gave one).

    hivemind's TrainingStateAverager.load_state_from_peers returns nothing, whether a peer gave its state
    or none could; it gets the download from ``super().load_state_from_peers``. Placed *after*
    TrainingStateAverager in the method resolution order (see ``recording_state_averager_class``), this
    class is that ``super()`` and sees the download on its way.
    """

    last_downloaded_epoch: Optional[int] = None

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None):
        loaded = super().load_state_from_peers(wait=wait, timeout=timeout)
        if wait:
            metadata = loaded[0] if loaded is not None else None
            epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
            self.last_downloaded_epoch = epoch if isinstance(epoch, int) else None
        return loaded


def recording_state_averager_class() -> type:
    """TrainingStateAverager with DownloadRecorderMixin behind it, under TrainingStateAverager's name (hivemind
    names its RPCs after the class: peers with and without the mixin still talk to each other)."""
    return type(TrainingStateAverager.__name__, (TrainingStateAverager, DownloadRecorderMixin),
                {"__module__": __name__, "__qualname__": "RecordingTrainingStateAverager"})


class CollaborativeOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer that counts the global steps averaged with peers, and idles when alone.

    The count is what the demo and the tests check to know that peers really trained together,
    rather than each on its own. A peer alone in the swarm does not look for an averaging group
    ahead of time: hivemind would otherwise run matchmaking (DHT traffic on every core) during the
    last ``matchmaking_time`` seconds of every global epoch, for nothing.

    :param peer_gate: in an authorized run, a collab_kit.auth.PeerGate for the averagers
    :param on_averaging_start: called with the global epoch and the round's stage each time this peer begins
      averaging its gradients with other peers, before the round is over: "looking_for_group" (matchmaking
      goes on), "awaiting_trigger" (the group is formed) or "running_allreduce"; also settable later as an
      attribute. ``collab-kit join --events`` reports it, so that tests can act in the middle of a round.
    """

    def __init__(self, peer_gate=None, on_averaging_start: Optional[Callable[[int, str], None]] = None, **kwargs):
        self.peer_gate = peer_gate  # read by _make_state_averager, which hivemind calls inside __init__
        self.on_averaging_start = on_averaging_start
        super().__init__(**kwargs)
        self.averaged_rounds = 0  # global steps whose gradients were averaged with at least one other peer
        self.last_group_size = 1

    def load_state_from_peers(self, **kwargs) -> bool:
        """Download the newest parameters and optimizer state from a peer of the run (hivemind's method).

        :returns: True if a peer gave a state at this peer's epoch or later, which replaced the local one;
          False if no peer could (alone in the swarm, or every download failed): the local state is unchanged
        """
        self.state_averager.last_downloaded_epoch = None
        epoch_before = self.local_epoch
        super().load_state_from_peers(**kwargs)
        downloaded = self.state_averager.last_downloaded_epoch
        # hivemind refuses a state from an epoch behind this peer's (and keeps its own)
        return downloaded is not None and downloaded >= epoch_before

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        """hivemind's state averager, which remembers what it downloads (DownloadRecorderMixin); in an authorized
        run, one that lets only bound peers download the state or average parameters with it
        (collab_kit.auth.AuthorizedAveragerMixin)."""
        averager_class = recording_state_averager_class()
        if self.peer_gate is not None:
            from collab_kit.auth import authorized_averager_class

            averager_class = authorized_averager_class(averager_class, self.peer_gate)
        # the arguments hivemind.Optimizer._make_state_averager (1.1.12) passes, with the class swapped
        return averager_class(
            dht=self.dht, prefix=f"{self.run_id}_state_averager", min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout, shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer, custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel, next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode, auxiliary=self.auxiliary, start=True, **kwargs)

    # hivemind 1.1.12 (pinned in pyproject): these hooks are methods of hivemind.Optimizer
    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        began = super()._begin_averaging_gradients(grad_scaler)
        if began and self.on_averaging_start is not None:
            control = self.scheduled_grads  # the round just triggered (hivemind's StepControl)
            self.on_averaging_start(self.local_epoch, control.stage.name.lower() if control is not None else "unknown")
        return began

    def _maybe_schedule_gradient_averaging(self) -> None:
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_gradient_averaging()

    def _maybe_schedule_state_averaging(self) -> None:
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_state_averaging()

    # the one place where the outcome of a gradient averaging round is known in the trainer's process
    # (the averagers themselves run as subprocesses)
    def _average_gradients_and_load_into_optimizer(self, maybe_step_control):
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        self.last_group_size = 1
        if maybe_step_control is not None and maybe_step_control.done() and not maybe_step_control.cancelled():
            if maybe_step_control.exception() is None:
                group = maybe_step_control.result()
                self.last_group_size = len(group) if group else 1
                if self.last_group_size > 1:
                    self.averaged_rounds += 1


def make_optimizer(model: torch.nn.Module, dht: hivemind.DHT, run_id: str, config: OptimizerConfig,
                   client_mode: bool = False, verbose: bool = False, peer_gate=None, **kwargs) -> CollaborativeOptimizer:
    """Build the collaborative optimizer for ``model``, connected to the swarm through ``dht``.

    :param model: the model whose parameters the swarm trains
    :param dht: this peer's DHT (see collab_kit.swarm.start_dht)
    :param run_id: peers with the same run_id train together; others ignore each other
    :param config: hyperparameters (collab_kit.config.OptimizerConfig)
    :param client_mode: True if this peer cannot accept incoming connections
    :param verbose: log each stage of every global step
    :param peer_gate: in an authorized run, a collab_kit.auth.PeerGate: the gradient and state averagers then
      serve only peers bound to a valid access token
    :param kwargs: passed to hivemind.Optimizer (for instance ``grad_averager_factory``, which then replaces the
        one ``config.aggregation`` chooses)
    """
    # hivemind warns (and can deadlock in rare cases) when a matchmaking request may outlast matchmaking itself
    request_timeout = min(3.0, config.matchmaking_time / 2)
    # "mean": hivemind's GradientAverager as it is; "centered_clip": the same averager reducing with CenteredClip
    averager_class = GradientAverager
    if peer_gate is not None:
        from collab_kit.auth import authorized_averager_class

        averager_class = authorized_averager_class(GradientAverager, peer_gate)
    kwargs.setdefault("grad_averager_factory", robust.grad_averager_factory(
        config.aggregation, config.clip_tau, config.clip_iterations, averager_class, request_timeout=request_timeout))
    return CollaborativeOptimizer(
        peer_gate=peer_gate,
        dht=dht,
        run_id=run_id,
        target_batch_size=config.target_batch_size,
        batch_size_per_step=config.batch_size_per_step,
        params=parameter_groups(model, config.weight_decay),
        optimizer=partial(make_lamb8bit, config=config),
        scheduler=make_scheduler_factory(config),
        offload_optimizer=config.offload_optimizer,
        delay_optimizer_step=config.delay_optimizer_step,
        delay_grad_averaging=False,
        average_state_every=config.average_state_every,
        grad_compression=gradient_compression(config.compression_threshold),
        state_averaging_compression=Float16Compression() if config.state_compression == "fp16" else NoCompression(),
        matchmaking_time=config.matchmaking_time,
        averaging_timeout=config.averaging_timeout,
        averager_opts=dict(request_timeout=request_timeout),
        tracker_opts=dict(default_refresh_period=config.progress_refresh_period,
                          min_refresh_period=config.progress_refresh_period / 6,
                          max_refresh_period=config.progress_refresh_period * 10 / 3),
        client_mode=client_mode,
        verbose=verbose,
        **kwargs,
    )
