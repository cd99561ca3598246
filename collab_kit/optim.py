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

import asyncio
import logging
import math
import time
import warnings
from collections import Counter
from functools import partial
from typing import AsyncIterator, Callable, Iterable, List, Optional

import bitsandbytes as bnb
import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from hivemind.compression import Float16Compression, NoCompression, SizeAdaptiveCompression, Uniform8BitQuantization
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

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
        self._hold_next_step = False

    def hold_next_step(self) -> None:
        """Make the next ``step()`` leave the parameters and statistics as they are (the gradients it would apply are
        not the swarm's: collab_kit.anchor's round that no training peer reached)."""
        self._hold_next_step = True

    @torch.no_grad()
    def step(self, closure=None):
        if self._hold_next_step:
            self._hold_next_step = False
            return None
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


class ForkedTorchThreadsMixin:
    """Put before a hivemind averager class: its process (a fork of the trainer's) rebuilds torch's thread pool once,
    before any of its threads runs a tensor operation.

    A forked process inherits a torch whose thread pool belongs to the parent, and the first operation of each thread
    rebuilds it. hivemind's averagers compress and decompress the parts of a round in several threads at once, and in
    the first round of a process those first operations race: with more than one torch thread, one of them can fail
    with "pool INTERNAL ASSERT FAILED ... Invalid thread pool!" (measured here: 91 of 100 forked processes whose 4
    threads began together). hivemind drops that exception silently: the part is never sent, the reducer drops this
    peer after next_chunk_timeout, and the round is lost (what a peer behind a 5 Mbit/s link met in one run of two).
    """

    def run(self):
        # in the averager's own process, in one thread, before hivemind starts its event loop and executors
        torch.set_num_threads(torch.get_num_threads())
        super().run()


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


# seconds a peer in client mode waits for a leader's answer to its join request. The answer crosses the peer's home
# link twice, and a thin link is often full (the state download, a round's parts, the DHT): a home router's queue of
# 64 KiB holds 2 s at 0.25 Mbit/s. With the tiny preset's 0.9 x matchmaking_time (1.8 s), a late joiner on such a
# link asked the anchor in every round and was never answered in time; a busy anchor, or a volunteer's process
# waiting for a core on a machine shared with five others, cost a round now and then too
CLIENT_JOIN_ANSWER_TIMEOUT = 5.0


# seconds a download of the swarm's state waits for its next part (64 KiB) before giving up on the peer that serves it.
# hivemind waits next_chunk_timeout, which is set for averaging rounds (6 s for the CPU presets): a part takes 2 s at
# 0.25 Mbit/s on an idle link and 5 s at 0.1 Mbit/s, and a thin link that drops packets stalls for seconds more while
# TCP backs off (a late joiner of the NAT lab, at 0.25 Mbit/s, gave up five downloads in a row after 6-8 s each and
# never trained). A download given up starts again from its first part, so waiting costs less than giving up
STATE_DOWNLOAD_PART_TIMEOUT = 30.0


class _LeaderlessRequestTimeoutFilter(logging.Filter):
    """Drops hivemind's advice to keep request_timeout below min_matchmaking_time (two leaders that request each
    other could wait on each other until it passes): a peer in client mode leads no group."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "request_timeout smaller than min_matchmaking_time" not in record.getMessage()


class ClientModeMatchmakingMixin:
    """Put before a hivemind averager class: in client mode, its process (where hivemind builds its matchmaking)
    leaves out the request_timeout advice that does not apply to it (see CLIENT_JOIN_ANSWER_TIMEOUT). The filter is
    installed in the averager's own process only, never in the user's."""

    def run(self):
        if self.client_mode:
            logging.getLogger("hivemind.averaging.matchmaking").addFilter(_LeaderlessRequestTimeoutFilter())
        super().run()


def recording_state_averager_class() -> type:
    """TrainingStateAverager with DownloadRecorderMixin behind it (and ForkedTorchThreadsMixin and
    ClientModeMatchmakingMixin in front), under TrainingStateAverager's name (hivemind names its RPCs after the class:
    peers with and without the mixins still talk to each other)."""
    return type(TrainingStateAverager.__name__,
                (ForkedTorchThreadsMixin, ClientModeMatchmakingMixin, TrainingStateAverager, DownloadRecorderMixin),
                {"__module__": __name__, "__qualname__": "RecordingTrainingStateAverager"})


# what a peer tells its group about itself in each gradient round (hivemind's all-gather): an anchor contributes no
# samples (collab_kit.anchor), so a round with only anchors beside this peer is not training together
TRAINER_ROLE, ANCHOR_ROLE = "trainer", "anchor"
NO_STATE_AVERAGING = 2 ** 62  # an average_state_every no epoch reaches


def is_anchor_record(record: LocalTrainingProgress) -> bool:
    """Whether a hivemind progress record is an anchor's: it reports a throughput of exactly 0, which a peer that
    trains never does (hivemind publishes a trainer's record only after its first samples)."""
    return record.samples_per_second == 0.0


def round_member(role: str, epoch: Optional[int]) -> dict:
    """What a peer tells its group about itself in a gradient round (hivemind's all-gather): its role, and the local
    epoch whose gradients it brings."""
    return dict(role=role, epoch=epoch)


class RoundResult(dict):
    """What a gradient round gives back to a peer: what each member told the group (peer id -> ``round_member``, from
    the round's all-gather), and how much of the average came back.

    :ivar received: the share of the averaged vector this peer got back; the rest stayed its own (a reducer failed,
      or banned this peer for being late): below 1, this peer's step was not the swarm's
    :ivar failed_senders: senders whose parts this peer, as a reducer, went on without
    """

    received: float = 1.0
    failed_senders: int = 0

    def roles(self) -> List[str]:
        """Each member's role (a member of a kit that sent its role alone counts too)."""
        return [entry.get("role") if isinstance(entry, dict) else entry for entry in self.values()]

    def epoch(self) -> Optional[int]:
        """The round's epoch: an anchor's when the group holds one (the organizer's peer, whose epoch is the swarm's for
        peers in client mode), else the one more than half of the members were at; None if no such epoch.

        hivemind's groups are not keyed by epoch: a peer whose reading of the swarm lagged (it adopted the swarm's
        epoch a moment before the others ended it) joins the round of the next epoch, and its gradients are averaged
        into that epoch's update. A lone member's claim never decides (a hostile peer could name any epoch)."""
        members = [entry for entry in self.values() if isinstance(entry, dict) and isinstance(entry.get("epoch"), int)]
        anchors = [member["epoch"] for member in members if member.get("role") == ANCHOR_ROLE]
        if anchors:
            return max(anchors)
        counts = Counter(member["epoch"] for member in members)
        epoch, count = max(counts.items(), key=lambda item: item[1], default=(None, 0))
        return epoch if 2 * count > len(self) else None


class RoundReportMixin:
    """Put before a hivemind gradient averager: each round carries this peer's ``round_role`` to its group, and its
    result is a RoundResult.

    hivemind.Optimizer offers no way to add data to a round's all-gather, and says nothing about a round that
    returned only part of the average ("Averaging: received 0.0% results" is a log line, and the round counts as
    done); both are read here, in the averager's process, where the round runs.

    An anchor leads the groups of peers in client mode, which can lead none: it keeps its group open until every
    training peer it expects has joined (``expect_peers``, kept up to date while the round is pending), then starts
    ``join_grace`` seconds later, instead of closing at a fixed time and leaving out a peer whose estimate of the
    epoch's end came later. The expected peers are no cap: a peer it did not expect (one that joined the swarm or
    loaded its state a moment ago) is let in too, while the group is open, and so is a peer whose own time comes before
    the anchor's: the group then starts by that peer's time.
    """

    round_role = TRAINER_ROLE
    round_epoch: Callable[[], Optional[int]] = staticmethod(lambda: None)  # the epoch a round scheduled now is for
    join_grace = 0.5  # seconds a leader with its expected group waits for peers it did not count before it starts
    client_join_timeout: Optional[float] = None  # in client mode, a round's timeout when its caller gave none
    _group_starter: Optional[asyncio.Task] = None  # in the averager's process: starts the group once all are in
    _expected_peers: frozenset = frozenset()  # in the averager's process: the peers to wait for (PeerIDs)
    _follower_deadlines: Optional[dict] = None  # in the averager's process: followers let in before their time
    _expected_sent: Optional[tuple] = None  # in this process: the last set sent to the averager's process

    def schedule_step(self, scheduled_time=None, **kwargs):
        kwargs.setdefault("gather", round_member(self.round_role, self.round_epoch()))
        if self.client_mode:
            # A peer in client mode never leads: its schedule only says until when it may join a group, and a leader
            # turns away a peer that asks to start before the leader's own time (hivemind's BAD_EXPIRATION_TIME): a
            # peer whose estimate of the epoch's end is a few seconds early (it just loaded the state, its link is
            # slow) would find no group. So it asks for the latest start its timeout allows; the anchor starts the
            # group as soon as its expected peers are in, so nobody waits longer for it. A round that was not
            # scheduled ahead (hivemind's step at the epoch's end, after a download say) comes with no timeout and
            # would ask to start within min_matchmaking_time, before the anchor's time (its time holds a chunk's
            # timeout for late peers): it gets the optimizer's averaging timeout
            if kwargs.get("timeout") is None:
                kwargs["timeout"] = self.client_join_timeout
            if kwargs["timeout"] is not None:
                scheduled_time = get_dht_time() + 0.9 * kwargs["timeout"]
        return super().schedule_step(scheduled_time, **kwargs)

    def expect_peers(self, peer_ids: Iterable[bytes]) -> None:
        """The peers to wait for in the rounds this peer leads (their ids as bytes; none: hivemind's own rule, which
        starts the group at the leader's deadline). Sent to the averager's process when it changes."""
        expected = tuple(sorted(set(peer_ids)))
        if expected != self._expected_sent:
            self._expected_sent = expected
            self._outer_pipe.send(("_set_expected_peers", [], dict(peer_ids=expected)))

    async def _set_expected_peers(self, peer_ids: tuple) -> None:
        self._expected_peers = frozenset(PeerID(peer_id) for peer_id in peer_ids)

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if self._expected_peers:
            if self._follower_deadlines is None:
                self._follower_deadlines = {}
            self._follower_deadlines.pop(context.remote_id, None)
            declared = self._matchmaking.potential_leaders.declared_expiration_time
            if math.isfinite(declared) and math.isfinite(request.expiration) and request.expiration < declared:
                # hivemind turns away a peer whose time is earlier than its leader's (BAD_EXPIRATION_TIME): it would
                # give up before the leader's time. An anchor's time is no start time (it starts once its expected
                # peers are in, and holds its group open for late ones, which pushes its time on), so it lets the
                # peer in and starts the group by the peer's time instead (_start_group_when_expected_joined)
                self._follower_deadlines[context.remote_id] = request.expiration
                request.expiration = declared
            if self._group_starter is None or self._group_starter.done():
                self._group_starter = asyncio.create_task(self._start_group_when_expected_joined())
        async for message in super().rpc_join_group(request, context):
            yield message

    async def _start_group_when_expected_joined(self) -> None:
        """While this peer leads a group that is being formed: start it once every expected peer is in (and
        ``join_grace`` has passed for any it did not expect). Runs in the averager's process."""
        matchmaking = self._matchmaking

        def ready() -> bool:
            expected = self._expected_peers - {matchmaking.peer_id}
            return (matchmaking.is_looking_for_group and not matchmaking.assembled_group.done()
                    and matchmaking.current_leader is None and bool(expected)
                    and expected.issubset(matchmaking.current_followers))

        def due() -> bool:  # a follower let in before its time (rpc_join_group) gives up at its own time
            deadlines = [self._follower_deadlines[peer] for peer in matchmaking.current_followers
                         if peer in (self._follower_deadlines or {})]
            return (matchmaking.is_looking_for_group and not matchmaking.assembled_group.done()
                    and matchmaking.current_leader is None and bool(deadlines)
                    and get_dht_time() >= min(deadlines) - self.join_grace)

        while matchmaking.is_looking_for_group and not matchmaking.assembled_group.done():
            if ready():
                await asyncio.sleep(self.join_grace)
                async with matchmaking.lock_request_join_group:
                    if ready():
                        await matchmaking.leader_assemble_group()
                        return
            if due():
                async with matchmaking.lock_request_join_group:
                    if due():
                        await matchmaking.leader_assemble_group()
                        return
            await asyncio.sleep(0.05)

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        result = RoundResult(gathered)
        running = self._running_groups.get(group_info.group_id)  # registered until this round's step is set
        if running is not None and running.done() and not running.cancelled() and running.exception() is None:
            runner = running.result()
            container = runner.tensor_part_container
            result.received = 1.0 - container.failed_size / max(1, container.total_size)
            result.failed_senders = sum(index != float("inf")
                                        for index in runner.tensor_part_reducer.sender_failed_after)
        return result


def round_report_averager_class(base: type, role: str) -> type:
    """``base`` (a hivemind gradient averager class) with RoundReportMixin (and ForkedTorchThreadsMixin and
    ClientModeMatchmakingMixin) in front, sending ``role``, under ``base``'s name (hivemind names the RPCs after the
    class: every peer's averager must keep the same name)."""
    return type(base.__name__, (ForkedTorchThreadsMixin, ClientModeMatchmakingMixin, RoundReportMixin, base),
                {"__module__": __name__, "__qualname__": f"RoundReport{base.__name__}", "round_role": role})


class SwarmProgressTracker(ProgressTracker):
    """hivemind's ProgressTracker that also counts, at each reading, the peers that train and the anchors.

    hivemind's ``global_progress.num_peers`` counts both: an anchor publishes a record so that its epoch is
    the swarm's (peers behind NAT, in client mode, do not set the global epoch), with no throughput.
    """

    training_peers: int = 0  # peers with a progress record that contribute samples (this one included)
    anchor_peers: int = 0  # peers with a progress record and no throughput (collab_kit.anchor)
    trainer_records: tuple = ()  # (peer id as bytes, local epoch) of each training peer's record
    client_mode_trainers: int = 0  # training peers in client mode (they average only through a peer that leads)

    def _parse_swarm_progress_data(self, metadata):
        progress = super()._parse_swarm_progress_data(metadata)
        trainers, anchors, clients = [], 0, 0
        if isinstance(metadata, dict):
            for entry in metadata.values():
                if entry.value is None:
                    continue
                record = LocalTrainingProgress.parse_obj(entry.value)  # valid: super() parsed it already
                if is_anchor_record(record):
                    anchors += 1
                else:
                    trainers.append((record.peer_id, record.epoch))
                    clients += record.client_mode
        self.trainer_records, self.training_peers, self.anchor_peers = tuple(trainers), len(trainers), anchors
        self.client_mode_trainers = clients
        return progress

    def run(self):
        # hivemind's ProgressTracker.run (1.1.12), ended the way asyncio.run ends a loop. hivemind's fetcher leaves tasks
        # behind when it stops: its shutdown checker (a wait on an executor thread) and, when the shutdown came first,
        # its last DHT read. Left pending in a loop nobody runs again, they were destroyed at garbage collection with
        # asyncio's "Task was destroyed but it is pending!" logged as an ERROR: on every peer's exit, and in a notebook
        # (the user's own process) as a red box after a run where nothing was wrong
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(asyncio.gather(self._progress_reporter(), self._progress_fetcher()))
        finally:
            leftovers = asyncio.all_tasks(loop)
            for task in leftovers:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
            asyncio.set_event_loop(None)
            loop.close()
            self.shutdown_complete.set()


class CollaborativeOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer that counts the global steps averaged with other training peers, and idles when alone.

    The count is what the demo and the tests check to know that peers really trained together,
    rather than each on its own. A peer alone in the swarm does not look for an averaging group
    ahead of time: hivemind would otherwise run matchmaking (DHT traffic on every core) during the
    last ``matchmaking_time`` seconds of every global epoch, for nothing.

    Each gradient round carries the peer's role to its group (``round_role``): a group of this peer and
    anchors only (collab_kit.anchor: public peers that reduce for volunteers behind NAT and contribute no
    samples) has averaged nothing, and counts as a lone step.

    :param peer_gate: in an authorized run, a collab_kit.auth.PeerGate for the averagers
    :param on_averaging_start: called with the global epoch and the round's stage each time this peer begins
      averaging its gradients with other peers, before the round is over: "looking_for_group" (matchmaking
      goes on), "awaiting_trigger" (the group is formed) or "running_allreduce"; also settable later as an
      attribute. ``collab-kit join --events`` reports it, so that tests can act in the middle of a round.
    """

    round_role = TRAINER_ROLE

    def __init__(self, peer_gate=None, on_averaging_start: Optional[Callable[[int, str], None]] = None, **kwargs):
        self.peer_gate = peer_gate  # read by _make_state_averager, which hivemind calls inside __init__
        self.on_averaging_start = on_averaging_start
        super().__init__(**kwargs)
        if self.client_mode or self.round_role == ANCHOR_ROLE:
            # Averaging parameters needs a peer that accepts connections to lead each round: for a peer in client mode,
            # only an anchor; and a round it misses holds up its next gradient round (hivemind waits for the previous
            # background round first), which then misses the group too. Such peers stay equal to the swarm by applying
            # the same averaged gradients, and load the swarm's state after a gradient round of theirs failed.
            self.average_state_every = NO_STATE_AVERAGING
        # each gradient round tells its group which epoch this peer is at (RoundResult.epoch). Read from the state
        # averager, which holds the epoch: a function of the optimizer would tie it and its averager in a reference
        # cycle, freed only at some later garbage collection (in a notebook, in the middle of another cell)
        state_averager = self.state_averager
        self.grad_averager.round_epoch = lambda: state_averager.local_epoch
        self.grad_averager.client_join_timeout = self.averaging_timeout
        self.averaged_rounds = 0  # global steps whose gradients were averaged with at least one other training peer
        # training peers in the last gradient round, this one included when it trains (anchors are not counted)
        self.last_group_size = int(self.round_role != ANCHOR_ROLE)
        self.last_anchors_in_group = 0  # anchors in the last gradient round
        self.last_round_problem: Optional[str] = None  # why the last gradient round failed (None: it did not)
        self.last_received = 1.0  # the share of the last round's average that came back to this peer
        # the epoch the last global step ended: this peer's own, or the next one when its round was the next one's
        self.last_round_epoch: Optional[int] = None
        self._resync_requested = False
        self._resync_reason: Optional[str] = None
        self._loaded: Optional[tuple] = None  # (epoch, seconds) of a state just loaded, until the next step's check
        self._parameters_from_swarm = False  # a state loaded (or an epoch adopted with it) since the last global step
        self._load_reason: Optional[str] = None  # why a step decided to load the swarm's state, until it did
        # the loads that steps decided on (this peer behind or apart from the swarm), each a dict with the reason
        # ("problem"), whether a peer gave its state ("loaded"), and the epochs before and after; for the caller to
        # take (a volunteer reports each one as it reports the state it loads at its start)
        self.step_loads: List[dict] = []

    # hivemind reads average_state_every at each global step, after the gradient round is known: a step whose round
    # failed or came back in part (or whose peer was asked to resync) takes no state averaging round. The peer loads the
    # swarm's state at its next step anyway; a round would hand its diverged parameters to the others, and the download
    # waits for it (up to averaging_timeout, the round running in the background). Two peers left after a third was
    # killed mid-round fell out of step that way for good: each one's download waited 20 s for its failed state round
    # while the other looked for a group at the next epoch, in every epoch after the kill
    @property
    def average_state_every(self) -> int:
        if getattr(self, "_resync_requested", False):
            return NO_STATE_AVERAGING
        return self._average_state_every

    @average_state_every.setter
    def average_state_every(self, every: int) -> None:
        self._average_state_every = every

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        # hivemind.Optimizer._make_progress_tracker (1.1.12), with the counting tracker
        return SwarmProgressTracker(dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size,
                                    client_mode=self.client_mode, status_loglevel=self.status_loglevel, start=True,
                                    **kwargs)

    def load_state_from_peers(self, **kwargs) -> bool:
        """Download the newest parameters and optimizer state from a peer of the run (hivemind's method).

        :returns: True if a peer gave a state at this peer's epoch or later, which replaced the local one;
          False if no peer could (alone in the swarm, or every download failed): the local state is unchanged
        """
        self.state_averager.last_downloaded_epoch = None
        epoch_before = self.local_epoch
        control = self.scheduled_grads
        if control is not None and not control.done() and control.stage == AveragingStage.LOOKING_FOR_GROUP:
            # hivemind would tag along with zero weight, which spares a formed group from waiting for this peer's part;
            # a round still looking for its group loses nothing by a cancel, and tagging along would keep this peer's
            # averager busy with a stale round when the swarm's next one, which it must join, starts
            control.cancel()
            self.scheduled_grads = None
        started = time.monotonic()
        reason, self._load_reason = self._load_reason, None
        super().load_state_from_peers(**kwargs)
        downloaded = self.state_averager.last_downloaded_epoch
        # hivemind refuses a state from an epoch behind this peer's (and keeps its own)
        loaded = downloaded is not None and downloaded >= epoch_before
        if loaded:
            self._loaded = (self.local_epoch, time.monotonic() - started)
            self._parameters_from_swarm = True
        if reason is not None:
            self.step_loads.append(dict(problem=reason, loaded=loaded, epoch_before=epoch_before,
                                        epoch_after=self.local_epoch))
        return loaded

    def adopt_epoch(self, epoch: int, parameters_from_swarm: bool = False) -> None:
        """Go on at ``epoch`` with the parameters held now (hivemind's catching up, for any distance).

        :param parameters_from_swarm: whether those parameters are a state this peer just loaded from the swarm (they
          then count as the swarm's until its next global step, see _follow_round_epoch); False for parameters of
          its own (an anchor resuming from a checkpoint, or going on without a download)
        """
        self._parameters_from_swarm = parameters_from_swarm
        with self.tracker.pause_updates():
            self.state_averager.local_epoch = epoch
            self.tracker.report_local_progress(epoch, samples_accumulated=0)
            if not self.client_mode:
                self.state_averager.state_sharing_priority = epoch

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        """hivemind's state averager, which remembers what it downloads (DownloadRecorderMixin); in an authorized
        run, one that lets only bound peers download the state or average parameters with it
        (collab_kit.auth.AuthorizedAveragerMixin)."""
        averager_class = recording_state_averager_class()
        if self.peer_gate is not None:
            from collab_kit.auth import authorized_averager_class

            averager_class = authorized_averager_class(averager_class, self.peer_gate)
        # hivemind's averager reads next_chunk_timeout only when it downloads a state; its own averaging rounds take
        # sender_timeout and reducer_timeout, given here as hivemind derives them from next_chunk_timeout
        round_timeouts = dict(sender_timeout=self.next_chunk_timeout, reducer_timeout=2 * self.next_chunk_timeout)
        round_timeouts.update(kwargs)
        # the arguments hivemind.Optimizer._make_state_averager (1.1.12) passes, with the class swapped and the wait for
        # a download's next part set for thin links (STATE_DOWNLOAD_PART_TIMEOUT)
        return averager_class(
            dht=self.dht, prefix=f"{self.run_id}_state_averager", min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout, shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer, custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=max(self.next_chunk_timeout, STATE_DOWNLOAD_PART_TIMEOUT),
            client_mode=self.client_mode, auxiliary=self.auxiliary, start=True, **round_timeouts)

    # hivemind 1.1.12 (pinned in pyproject): these hooks are methods of hivemind.Optimizer
    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        # every global step passes here (alone too): what the last round did is reset to "local gradients only"
        self.last_group_size = int(self.round_role != ANCHOR_ROLE)
        self.last_anchors_in_group, self.last_round_problem, self.last_received = 0, None, 1.0
        self.last_round_epoch = self.local_epoch
        began = self._trigger_gradient_round(grad_scaler)
        if began and self.on_averaging_start is not None:
            control = self.scheduled_grads  # the round just triggered (hivemind's StepControl)
            self.on_averaging_start(self.local_epoch, control.stage.name.lower() if control is not None else "unknown")
        return began

    def _trigger_gradient_round(self, grad_scaler) -> bool:
        """Start this epoch's gradient round (hivemind's way: the pre-scheduled group, or a new search)."""
        return super()._begin_averaging_gradients(grad_scaler)

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
        parameters_from_swarm, self._parameters_from_swarm = self._parameters_from_swarm, False
        if maybe_step_control is None:
            return  # alone in the swarm: nothing to average
        result = RoundResult()  # what the round's members said, when it finished
        if not maybe_step_control.done() or maybe_step_control.cancelled():
            self.last_round_problem = "the averaging round did not finish"
        elif maybe_step_control.exception() is not None:
            error = maybe_step_control.exception()
            self.last_round_problem = str(error) or type(error).__name__
        else:
            gathered = maybe_step_control.result() or {}
            result = gathered if isinstance(gathered, RoundResult) else RoundResult(gathered)
            roles = result.roles()  # this peer's own role is among them
            self.last_anchors_in_group = sum(role == ANCHOR_ROLE for role in roles) - (self.round_role == ANCHOR_ROLE)
            self.last_group_size = sum(role != ANCHOR_ROLE for role in roles)  # a peer of another kit counts as one
            self.last_received = float(getattr(result, "received", 1.0))
            if self.last_received < 1.0:
                share = f"{self.last_received:.1%}" if self.last_received < 0.9995 else "not all"
                self.last_round_problem = (f"only {share} of the average came back (a peer that reduces part of it "
                                           f"failed, or gave up waiting for this one)")
        others = self.last_group_size - (self.round_role != ANCHOR_ROLE)
        if others >= 1 and self.last_received >= 0.5:
            self.averaged_rounds += 1
        # this peer's step differs from the swarm's when its round failed or came back in part, or when it stepped on
        # its own gradients while others trained (and no anchor took its step too): it loads the swarm's state next
        diverged = self.last_round_problem is not None or (
            others == 0 and self.last_anchors_in_group == 0 and self.tracker.training_peers > 1)
        if diverged and self.round_role != ANCHOR_ROLE:
            self._resync_requested = True
        elif self.round_role != ANCHOR_ROLE and self.last_round_problem is None:
            self._follow_round_epoch(result, parameters_from_swarm)

    def _follow_round_epoch(self, result: RoundResult, parameters_from_swarm: bool) -> None:
        """After a round that averaged: a peer whose group was at a later epoch took part in that epoch's round, and
        ends that epoch with the others (hivemind's step adds one to the epoch set here).

        Without this, it stayed an epoch behind with the swarm's parameters: in the NAT lab, a late joiner adopted
        the anchor's epoch 10 after its download, 0.7 s before the anchor ended it; it joined the anchor's round of
        epoch 11, moved to 11 while the others moved to 12, and was taken for a peer that missed a round: an 11 s
        download on its 0.25 Mbit/s link, in which it missed the next rounds.

        Only a peer whose parameters are the swarm's, loaded since its last global step, follows: its epoch lagged by
        the time its download took. A peer one epoch behind with parameters of its own missed a global step; were it to
        follow, hivemind's once-an-epoch check (this peer's epoch equal to the swarm's) would pass, and it would never
        load the swarm's state. With no state averaging to bring it back, such a peer drifted away for good: in the
        CenteredClip test (average_state_every 1000) one honest peer, one epoch behind after another had trained an
        epoch alone, never loaded the swarm's state in 10 epochs, and its loss rose from 3.98 to 4.11 while the others'
        fell to 3.96."""
        if result.epoch() != self.local_epoch + 1:  # one epoch ahead only: the reading lags by a moment, no more
            return
        if not parameters_from_swarm:
            logger.info(f"this peer's round was the swarm's round of epoch {self.local_epoch + 1} (this peer was at "
                        f"{self.local_epoch}, with parameters of its own): it stays a round behind and loads the "
                        f"swarm's state")
            return
        logger.info(f"this peer's round was the swarm's round of epoch {self.local_epoch + 1} (this peer was at "
                    f"{self.local_epoch}): it ends that epoch with the others")
        # not adopt_epoch: hivemind's step, under way, reports the epoch it ends at (this one plus one)
        self.state_averager.local_epoch += 1
        self.last_round_epoch = self.local_epoch  # the epoch this step ends: what its losses are reported under

    def request_resync(self, reason: str) -> None:
        """Load the swarm's state at the next step (safe to call from another thread): this peer's parameters may no
        longer be the swarm's."""
        self._resync_reason = reason
        self._resync_requested = True

    def cancel_pending_round(self) -> bool:
        """Give up the gradient round under way or scheduled, if any (safe to call from another thread): the step that
        waits for it goes on with this peer's own gradients at once, instead of at the round's timeout. Returns whether
        a round was cancelled."""
        control = self.scheduled_grads
        if control is None or control.done():
            return False
        return bool(control.cancel())

    def _should_load_state_from_peers(self) -> bool:
        self._load_reason = None  # set by _wants_swarm_state for the load that hivemind's step makes when this is True
        if (self._loaded is not None and self._loaded[0] == self.local_epoch > self.tracker.global_epoch
                and not self._resync_requested):
            # The state just downloaded is newer than the swarm's progress this peer last read: hivemind's tracker reads
            # nothing during a download, which on a slow link lasts epochs. hivemind's rule (this peer's epoch equal to
            # the swarm's, checked once an epoch) would download again at once, for nothing newer: in the network lab
            # the late joiner on a 0.25 Mbit/s link spent 11 s that way right after an 11 s download. Whether the swarm
            # moved on meanwhile is decided at the first step after the tracker has read the swarm again (below).
            return False
        wanted = self._wants_swarm_state()
        loaded, self._loaded = self._loaded, None
        if wanted and loaded is not None and loaded[0] == self.local_epoch < self.tracker.global_epoch:
            # The swarm moved on while this peer downloaded its state: on a slow link the download (parameters and
            # optimizer state, about 6 bytes a parameter) can take longer than an epoch, and a peer that downloaded
            # again would spend every epoch downloading, never training. hivemind goes on at the swarm's epoch when one
            # behind; this peer does so further behind too: its parameters miss the few updates made during the
            # download (as a delayed update does), and from now on it applies the same averaged steps as everyone.
            epoch, seconds = loaded
            logger.warning(f"the swarm moved from epoch {epoch} to {self.tracker.global_epoch} while this peer "
                           f"downloaded its state ({seconds:.0f} s): it goes on at epoch {self.tracker.global_epoch} "
                           f"without downloading again (its parameters miss {self.tracker.global_epoch - epoch} "
                           f"update(s))")
            self.adopt_epoch(self.tracker.global_epoch, parameters_from_swarm=True)  # the download's, a few behind
            self._load_reason = None  # no load follows
            return False
        if wanted and self._load_reason is None:
            self._load_reason = (f"the swarm was at epoch {self.tracker.global_epoch}, this peer at "
                                 f"{self.local_epoch}")
        return wanted

    def _wants_swarm_state(self) -> bool:
        """Whether this peer's parameters are behind or apart from the swarm's (hivemind's rule and the kit's)."""
        if self._resync_requested:
            self._resync_requested = False
            reason = self._resync_reason or (f"its last global step was not the swarm's "
                                             f"({self.last_round_problem or 'no group'})")
            self._resync_reason = None
            logger.info(f"this peer loads the swarm's state: {reason}")
            self._load_reason = reason
            return True
        if self.client_mode and self.tracker.anchor_peers > 0 and self.local_epoch < self.tracker.global_epoch:
            # For a peer in client mode, the swarm's epoch is the anchor's, and the anchor moves on only when its round
            # is over: a peer behind it missed that round (it loaded the state while the round ran, or was left out of
            # the group). hivemind lets a peer one epoch behind go on, for peers that end an epoch a moment apart;
            # here that would keep this peer one epoch (and one update) behind the others for good.
            self._load_reason = (f"the anchor was at epoch {self.tracker.global_epoch}, this peer at "
                                 f"{self.local_epoch} (it missed a round)")
            logger.info(f"this peer loads the swarm's state: {self._load_reason}")
            return True
        return super()._should_load_state_from_peers()


def make_optimizer(model: torch.nn.Module, dht: hivemind.DHT, run_id: str, config: OptimizerConfig,
                   client_mode: bool = False, verbose: bool = False, peer_gate=None,
                   optimizer_class: type = CollaborativeOptimizer, **kwargs) -> CollaborativeOptimizer:
    """Build the collaborative optimizer for ``model``, connected to the swarm through ``dht``.

    :param model: the model whose parameters the swarm trains
    :param dht: this peer's DHT (see collab_kit.swarm.start_dht)
    :param run_id: peers with the same run_id train together; others ignore each other
    :param config: hyperparameters (collab_kit.config.OptimizerConfig)
    :param client_mode: True if this peer cannot accept incoming connections
    :param verbose: log each stage of every global step
    :param peer_gate: in an authorized run, a collab_kit.auth.PeerGate: the gradient and state averagers then
      serve only peers bound to a valid access token
    :param optimizer_class: CollaborativeOptimizer or a subclass (collab_kit.anchor.AnchorOptimizer)
    :param kwargs: passed to hivemind.Optimizer (for instance ``grad_averager_factory``, which then replaces the
        one ``config.aggregation`` chooses)
    """
    # hivemind warns (and can deadlock in rare cases) when a matchmaking request may outlast matchmaking itself. A peer
    # in client mode leads no group, so no two of its requests can wait on each other (ClientModeMatchmakingMixin), and
    # its only leaders are the few peers that accept connections (an anchor): a leader that answers late over a slow or
    # busy link is better than none, and a request given up waits for the leader's next declaration (seconds), which
    # costs the round. So its wait is set by the link, not by the preset's matchmaking time
    request_timeout = CLIENT_JOIN_ANSWER_TIMEOUT if client_mode else min(3.0, config.matchmaking_time / 2)
    # "mean": hivemind's GradientAverager as it is; "centered_clip": the same averager reducing with CenteredClip
    averager_class = round_report_averager_class(GradientAverager, optimizer_class.round_role)
    if peer_gate is not None:
        from collab_kit.auth import authorized_averager_class

        averager_class = authorized_averager_class(averager_class, peer_gate)
    averager_kwargs = dict(request_timeout=request_timeout,
                           # hivemind would have a peer that loads the swarm's state download the last averaged
                           # gradients too (as many bytes again as the parameters, in fp32), which nothing uses after
                           # a download: on a slow link that made catching up take 1.7x as long
                           allow_state_sharing=False)
    if client_mode:
        # hivemind sends a peer in client mode its averaged parts only once it has sent all of its own, and gives up on
        # its reducer when no part comes back within reducer_timeout of that (by default 2 x next_chunk_timeout). Its
        # only reducers are peers that accept connections (the anchor), which can return the first part only when every
        # member's first part is in: one member that starts sending late on a slow link holds every other member's
        # first part back. The round's own deadline (averaging_timeout) is the one that must hold here.
        averager_kwargs["reducer_timeout"] = max(config.averaging_timeout, 2 * config.chunk_timeout)
    if optimizer_class.round_role == ANCHOR_ROLE:
        # the anchor reduces the whole vector of every volunteer behind NAT, each sending over its own slow link; a
        # sender that stalls for next_chunk_timeout is dropped from the round, and it loses the round
        averager_kwargs["sender_timeout"] = max(config.chunk_timeout, config.averaging_timeout / 2)
    kwargs.setdefault("grad_averager_factory", robust.grad_averager_factory(
        config.aggregation, config.clip_tau, config.clip_iterations, averager_class, **averager_kwargs))
    return optimizer_class(
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
        next_chunk_timeout=config.chunk_timeout,
        load_state_timeout=config.load_state_timeout,
        averager_opts=dict(request_timeout=request_timeout),
        tracker_opts=dict(default_refresh_period=config.progress_refresh_period,
                          min_refresh_period=config.progress_refresh_period / 6,
                          max_refresh_period=config.progress_refresh_period * 10 / 3),
        client_mode=client_mode,
        verbose=verbose,
        **kwargs,
    )
