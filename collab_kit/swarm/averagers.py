"""hivemind's averagers as the kit builds them: one way to compose them, and the mixins that go in front.

hivemind names an averager's RPCs after its class (``GradientAverager.rpc_join_group``), and peers reach each
other's handlers by those names. ``compose_averager`` is the one place that rule is applied: a composed class keeps
its base's name, so peers with and without local mixins (thread pool, round reports, the authorization gate) still
average together, unless a mixin changes what a round computes and says so (``rpc_name_prefix``: CenteredClip, which
peers averaging by the plain mean must not join).

- ``ForkedTorchThreadsMixin``: an averager's process rebuilds torch's thread pool before its threads race to.
- ``SentBytesMixin``: counts the bytes an averager's process sends to other peers.
- ``DownloadRecorderMixin``: remembers the epoch of the last state downloaded.
- ``DirectStateMixin`` (collab_kit.swarm.direct_state): a peer in client mode gives its state to the anchors it named;
  an anchor downloads first from the training peers it names.
- ``FinishServingMixin``: at shutdown, the averaged parts still owed to the last round's group go out first.
- ``CallerClosesStreamsMixin`` (collab_kit.swarm.streams): a round's streams and join requests are closed by their
  caller once it has every message, not by the server right after writing the last one (which now and then lost it).
- ``ClientModeMatchmakingMixin``: leaves out hivemind's request-timeout advice that does not apply in client mode.
- ``RoundReportMixin``: each gradient round reports who was in it (trainers, anchors) and what it received, and
  lets the anchor hold a group open for the peers it expects.
- ``RunnerChoiceMixin`` (collab_kit.swarm.runners): chooses the class of a round's all-reduce runner and gives it
  each member's mode (an auxiliary peer only reduces); an anchor's sends its reducers one value per part.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import warnings
from collections import Counter
from typing import AsyncIterator, Callable, Iterable, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture

from collab_kit.swarm.direct_state import DirectStateMixin
from collab_kit.swarm.runners import RunnerChoiceMixin
from collab_kit.swarm.streams import CallerClosesStreamsMixin

logger = logging.getLogger(__name__)


def compose_averager(
    base: type, *mixins: type, behind: Sequence[type] = (), qualname: str | None = None, **attributes
) -> type:
    """``base`` (a hivemind averager class) with ``mixins`` in front of it and ``behind`` after it, as one class.

    Its ``__name__``, which hivemind names the RPCs after, is ``base``'s RPC name with the ``rpc_name_prefix`` of each
    mixin that sets one in front (a mixin that changes what a round computes); a mixin that only watches or guards
    keeps the name, so its peers still average with peers without it. Each composed class collects its own RPC
    handlers: hivemind caches them in class attributes, and a class that inherited its base's cache would miss an RPC
    a mixin adds.

    :param behind: classes placed after ``base`` in the method resolution order (they are its ``super()``)
    :param qualname: the class's name in tracebacks and reprs (default: the mixins' names and ``base``'s)
    :param attributes: class attributes, set before hivemind starts the averager's process (``start=True`` forks it
      inside ``__init__``, so they travel into it)
    """
    rpc_name = "".join(getattr(mixin, "rpc_name_prefix", "") for mixin in mixins) + base.__name__
    name = qualname or "".join(mixin.__name__.removesuffix("Mixin") for mixin in mixins) + base.__name__
    namespace = {"__module__": __name__, "__qualname__": name, "_rpc_handlers": None, "_stub_type": None, **attributes}
    return type(rpc_name, (*mixins, base, *behind), namespace)


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
        # hivemind's 8-bit quantization, which runs here, calls a torch function that torch 2.13 marks as deprecated:
        # nothing a user can act on, and this process alone meets it
        warnings.filterwarnings("ignore", message="torch.quantize_per_tensor", category=UserWarning)
        super().run()


class SentBytesMixin:
    """Put before a hivemind averager class: counts the bytes its process sends to other peers (the parts of its
    rounds, the states it serves, its join requests and answers), and of those the states it served to peers that
    downloaded them (a late joiner, the monitor's checkpoints), for ``bytes_sent()`` to read.

    Every message of an averager's streams goes out through ``P2P.send_raw_data`` in the averager's own process (a
    fork of the trainer's, with one averager in it): counting there counts this averager's traffic alone. Unary calls
    (none carries tensors) go through the daemon's control connection and are not counted.
    """

    _last_bytes_sent = (0, 0)  # in the trainer's process: the last count read (sent, of which served)

    def run(self):
        # in the averager's own process, before hivemind starts its event loop
        self._bytes_sent_here = self._bytes_served_here = 0
        send_raw_data = P2P.send_raw_data
        averager = self

        async def counting_send_raw_data(data: bytes, writer, *, chunk_size: int = 2**16) -> None:
            averager._bytes_sent_here += len(data)
            await send_raw_data(data, writer, chunk_size=chunk_size)

        P2P.send_raw_data = staticmethod(counting_send_raw_data)
        super().run()

    def bytes_sent(self, timeout: float = 5.0) -> tuple[int, int]:
        """Bytes this averager has sent so far, and of those the bytes of the states it served; once its process has
        ended (or does not answer within ``timeout`` seconds), the last counts read."""
        if self.is_alive():
            future = MPFuture()
            try:
                self._outer_pipe.send(("_report_bytes_sent", [], dict(future=future)))
                sent, served = future.result(timeout)
                self._last_bytes_sent = (int(sent), int(served))
            except (OSError, EOFError, TimeoutError, BrokenPipeError) as e:
                logger.debug(f"the averager's sent bytes could not be read ({type(e).__name__}): the last count stands")
        return self._last_bytes_sent

    async def _report_bytes_sent(self, future: MPFuture) -> None:
        future.set_result((getattr(self, "_bytes_sent_here", 0), getattr(self, "_bytes_served_here", 0)))

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for message in super().rpc_download_state(request, context):
            self._bytes_served_here = getattr(self, "_bytes_served_here", 0) + message.ByteSize()
            yield message

    async def rpc_download_state_part(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not hasattr(super(), "rpc_download_state_part"):  # a gradient averager shares no state
            return
        async for message in super().rpc_download_state_part(request, context):
            self._bytes_served_here = getattr(self, "_bytes_served_here", 0) + message.ByteSize()
            yield message


class DownloadRecorderMixin(DecentralizedAverager):
    """Remembers the epoch of the last state ``load_state_from_peers`` downloaded (None: no peer gave one).

    hivemind's TrainingStateAverager.load_state_from_peers returns nothing, whether a peer gave its state
    or none could; it gets the download from ``super().load_state_from_peers``. Placed *after*
    TrainingStateAverager in the method resolution order (see ``recording_state_averager_class``), this
    class is that ``super()`` and sees the download on its way.
    """

    last_downloaded_epoch: int | None = None

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None):
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


class FinishServingMixin:
    """Put before a hivemind averager class: told to shut down, its process first lets the averaged parts it is still
    sending back to its group go out (for up to ``serving_grace`` seconds), then shuts down as hivemind does.

    hivemind's all-reduce is over for a peer once its own results are back, while as a reducer it may still be
    streaming the averaged parts of the others. A peer stopping right after its last round (the end of --max-epochs)
    cut those streams, and a groupmate missed part of the last average (made certain in
    tests/swarm/test_keys_and_averagers.py by a reducer that answers slowly).
    """

    serving_grace: float = 4.0  # under hivemind's shutdown_timeout (5 s by default), after which it terminates

    def _serving_state(self):
        # created in the averager's own process and loop, at first use
        if getattr(self, "_serving_idle", None) is None:
            self._serving_streams, self._serving_idle = 0, asyncio.Event()
            self._serving_idle.set()
        return self._serving_idle

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        idle = self._serving_state()
        self._serving_streams += 1
        idle.clear()
        try:
            async for message in super().rpc_aggregate_part(stream, context):
                yield message
        finally:
            self._serving_streams -= 1
            if self._serving_streams == 0:
                idle.set()

    async def _shutdown(self, timeout: float | None) -> None:
        grace = min(self.serving_grace, 0.8 * timeout) if timeout is not None else self.serving_grace
        try:
            await asyncio.wait_for(self._serving_state().wait(), grace)
        except asyncio.TimeoutError:
            logger.debug(f"shutting down with {self._serving_streams} averaged part(s) still being sent")
        await super()._shutdown(timeout)


class ClientModeMatchmakingMixin:
    """Put before a hivemind averager class: in client mode, its process (where hivemind builds its matchmaking)
    leaves out the request_timeout advice that does not apply to it (see CLIENT_JOIN_ANSWER_TIMEOUT). The filter is
    installed in the averager's own process only, never in the user's."""

    def run(self):
        if self.client_mode:
            logging.getLogger("hivemind.averaging.matchmaking").addFilter(_LeaderlessRequestTimeoutFilter())
        super().run()


def recording_state_averager_class() -> type:
    """TrainingStateAverager with DownloadRecorderMixin behind it (and ForkedTorchThreadsMixin, SentBytesMixin,
    DirectStateMixin, FinishServingMixin, CallerClosesStreamsMixin and ClientModeMatchmakingMixin in front), under
    TrainingStateAverager's RPC name."""
    return compose_averager(
        TrainingStateAverager,
        ForkedTorchThreadsMixin,
        SentBytesMixin,
        DirectStateMixin,
        FinishServingMixin,
        CallerClosesStreamsMixin,
        ClientModeMatchmakingMixin,
        behind=(DownloadRecorderMixin,),
        qualname="RecordingTrainingStateAverager",
    )


# what a peer tells its group about itself in each gradient round (hivemind's all-gather): an anchor contributes no
# samples (collab_kit.swarm.anchor), so a round with only anchors beside this peer is not training together
TRAINER_ROLE, ANCHOR_ROLE = "trainer", "anchor"


def round_member(role: str, epoch: int | None) -> dict:
    """What a peer tells its group about itself in a gradient round (hivemind's all-gather): its role, and the local
    epoch whose gradients it brings."""
    return dict(role=role, epoch=epoch)


def senders_left_out(reducer) -> int:
    """How many senders a hivemind TensorPartReducer went on without: those it dropped before their last part. A
    sender dropped after it (its stream ended in an error as it closed) left nothing out.
    Shown by tests/swarm/test_optim.py::test_a_sender_dropped_after_its_last_part_left_nothing_out."""
    return sum(failed_after < reducer.num_parts for failed_after in reducer.sender_failed_after)


class RoundResult(dict):
    """What a gradient round gives back to a peer: what each member told the group (peer id -> ``round_member``, from
    the round's all-gather), and how much of the average came back.

    :ivar received: the share of the averaged vector this peer got back; the rest stayed its own (a reducer failed,
      or banned this peer for being late): below 1, this peer's step was not the swarm's
    :ivar failed_senders: senders whose parts this peer, as a reducer, went on without (a sender whose stream ended
      in an error after its last part, as a closing stream may, is not one: nothing of it was left out)
    """

    received: float = 1.0
    failed_senders: int = 0

    def roles(self) -> list[str]:
        """Each member's role (a member of a kit that sent its role alone counts too)."""
        return [entry.get("role") if isinstance(entry, dict) else entry for entry in self.values()]

    def epoch(self) -> int | None:
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


class RoundReportMixin(RunnerChoiceMixin):
    """Put before a hivemind gradient averager: each round carries this peer's ``round_role`` to its group, and its
    result is a RoundResult; an anchor's parts, of weight 0, go out as stand-ins (StandInRunnerMixin).

    hivemind.Optimizer offers no way to add data to a round's all-gather, and says nothing about a round that
    returned only part of the average ("Averaging: received 0.0% results" is a log line, and the round counts as
    done); both are read here, in the averager's process, where the round runs.

    An anchor leads the groups of peers in client mode, which can lead none: it keeps its group open until every
    training peer it expects has joined (``expect_peers``, kept up to date while the round is pending), then starts
    ``join_grace`` seconds later, instead of closing at a fixed time and leaving out a peer whose estimate of the
    epoch's end came later. The expected peers are no cap: a peer it did not expect (one that joined the swarm or
    loaded its state a moment ago) is let in too, while the group is open, and so is a peer whose own time comes before
    the anchor's: the group then starts by that peer's time. The run's other live anchors are waited for too, up to
    ``co_anchor_wait`` seconds once the training peers are in: an anchor whose reading of the epoch's end came a moment
    later would otherwise miss the round and leave the leader to reduce the whole vector (test_network_lab.py::
    test_two_anchors_share_each_round_and_the_run_goes_on_through_one_when_the_other_dies).
    """

    round_role = TRAINER_ROLE

    @property
    def sends_stand_ins(self) -> bool:
        return self.round_role == ANCHOR_ROLE

    round_epoch: Callable[[], int | None] = staticmethod(lambda: None)  # the epoch a round scheduled now is for
    join_grace = 0.5  # seconds a leader with its expected group waits for peers it did not count before it starts
    client_join_timeout: float | None = None  # in client mode, a round's timeout when its caller gave none
    # in client mode, the seconds kept between the latest start a peer asks for and the end of its timeout (10% of
    # the timeout, at least this): the leader's message that starts the group must reach it within them
    client_start_margin = 2.0
    _group_starter: asyncio.Task | None = None  # in the averager's process: starts the group once all are in
    _expected_peers: frozenset = frozenset()  # in the averager's process: the peers to wait for (PeerIDs)
    _expected_anchors: frozenset = frozenset()  # in the averager's process: the other anchors to wait for a while
    _co_anchor_wait = 0.0  # in the averager's process: the seconds to wait for them once the training peers are in
    _follower_deadlines: dict | None = None  # in the averager's process: followers let in before their time
    _expected_sent: tuple | None = None  # in this process: the last set sent to the averager's process

    def schedule_step(self, scheduled_time=None, **kwargs):
        kwargs.setdefault("gather", round_member(self.round_role, self.round_epoch()))
        if self.client_mode:
            # A peer in client mode never leads: its schedule only says until when it may join a group, and a leader
            # turns away a peer that asks to start before the leader's own time (hivemind's BAD_EXPIRATION_TIME): a
            # peer whose estimate of the epoch's end is a few seconds early (it just loaded the state, its link is
            # slow) would find no group. So it asks for the latest start its timeout allows, less client_start_margin;
            # the anchor starts the group as soon as its expected peers are in, so nobody waits longer for it. A round
            # that was not scheduled ahead (hivemind's step at the epoch's end, after a download say) comes with no
            # timeout and would ask to start within min_matchmaking_time, before the anchor's time (its time holds a
            # chunk's timeout for late peers): it gets the optimizer's averaging timeout
            if kwargs.get("timeout") is None:
                kwargs["timeout"] = self.client_join_timeout
            if kwargs["timeout"] is not None:
                margin = max(0.1 * kwargs["timeout"], self.client_start_margin)
                scheduled_time = get_dht_time() + max(0.0, kwargs["timeout"] - margin)
        return super().schedule_step(scheduled_time, **kwargs)

    def expect_peers(
        self, peer_ids: Iterable[bytes], co_anchors: Iterable[bytes] = (), co_anchor_wait: float = 0.0
    ) -> None:
        """The peers to wait for in the rounds this peer leads (their ids as bytes; none: hivemind's own rule, which
        starts the group at the leader's deadline), and the other anchors to wait for up to ``co_anchor_wait`` seconds
        once those are in. Sent to the averager's process when they change."""
        expected = (tuple(sorted(set(peer_ids))), tuple(sorted(set(co_anchors))), co_anchor_wait)
        if expected != self._expected_sent:
            self._expected_sent = expected
            self._outer_pipe.send(("_set_expected_peers", expected, {}))

    async def _set_expected_peers(self, peer_ids: tuple, co_anchors: tuple, co_anchor_wait: float) -> None:
        self._expected_peers = frozenset(PeerID(peer_id) for peer_id in peer_ids)
        self._expected_anchors = frozenset(PeerID(peer_id) for peer_id in co_anchors)
        self._co_anchor_wait = co_anchor_wait

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
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

        trainers_in_since: float | None = None

        def ready() -> bool:
            nonlocal trainers_in_since
            expected = self._expected_peers - {matchmaking.peer_id}
            if not (
                matchmaking.is_looking_for_group
                and not matchmaking.assembled_group.done()
                and matchmaking.current_leader is None
                and bool(expected)
                and expected.issubset(matchmaking.current_followers)
            ):
                trainers_in_since = None
                return False
            trainers_in_since = trainers_in_since or time.monotonic()
            return (self._expected_anchors - {matchmaking.peer_id}).issubset(
                matchmaking.current_followers
            ) or time.monotonic() - trainers_in_since >= self._co_anchor_wait

        def due() -> bool:  # a follower let in before its time (rpc_join_group) gives up at its own time
            deadlines = [
                self._follower_deadlines[peer]
                for peer in matchmaking.current_followers
                if peer in (self._follower_deadlines or {})
            ]
            return (
                matchmaking.is_looking_for_group
                and not matchmaking.assembled_group.done()
                and matchmaking.current_leader is None
                and bool(deadlines)
                and get_dht_time() >= min(deadlines) - self.join_grace
            )

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
            result.failed_senders = senders_left_out(runner.tensor_part_reducer)
        return result


def round_report_averager_class(base: type, role: str) -> type:
    """``base`` (a hivemind gradient averager class) with RoundReportMixin (and ForkedTorchThreadsMixin, SentBytesMixin,
    FinishServingMixin, CallerClosesStreamsMixin and ClientModeMatchmakingMixin) in front, sending ``role``, under
    ``base``'s name (hivemind names the RPCs after the class: every peer's averager must keep the same name)."""
    return compose_averager(
        base,
        ForkedTorchThreadsMixin,
        SentBytesMixin,
        FinishServingMixin,
        CallerClosesStreamsMixin,
        ClientModeMatchmakingMixin,
        RoundReportMixin,
        qualname=f"RoundReport{base.__name__}",
        round_role=role,
    )
