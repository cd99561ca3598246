"""hivemind's averagers as the kit builds them: one way to compose them, and the mixins that go in front.

hivemind names an averager's RPCs after its class; ``compose_averager`` keeps the base's name, so peers with and
without local mixins still average together, unless a mixin changes what a round computes (``rpc_name_prefix``).

- ``KeptPipeCallsMixin`` (collab_kit.swarm.kept_tasks), in front of every composed class: each call sent down the
  averager's pipe is held until it ends, never destroyed half-way by a garbage collection.
- ``ForkedTorchThreadsMixin``: an averager's process rebuilds torch's thread pool before its threads race to.
- ``SentBytesMixin``: counts the bytes an averager's process sends to other peers.
- ``DownloadRecorderMixin``: remembers the epoch of the last state downloaded.
- ``DirectStateMixin`` (collab_kit.swarm.direct_state): a peer in client mode gives its state to the anchors it named;
  an anchor downloads first from the training peers it names.
- ``FinishServingMixin``: at shutdown, the averaged parts still owed to the last round's group go out first.
- ``CallerClosesStreamsMixin`` (collab_kit.swarm.streams): a round's streams are closed by their caller.
- ``ClientModeMatchmakingMixin``: leaves out hivemind's request-timeout advice that does not apply in client mode.
- ``RoundReportMixin``: each gradient round reports who was in it and what came back; an anchor holds groups open.
- ``RunnerChoiceMixin`` (collab_kit.swarm.runners): chooses a round's all-reduce runner and each member's mode.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import typing
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import AsyncIterator  # noqa: UP035 (hivemind finds a stream rpc_ handler by typing's hint)

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture

from collab_kit.swarm.direct_state import DirectStateMixin
from collab_kit.swarm.kept_tasks import KeptPipeCallsMixin, kept_until_done
from collab_kit.swarm.runners import RunnerChoiceMixin
from collab_kit.swarm.streams import CallerClosesStreamsMixin

if typing.TYPE_CHECKING:  # the type checker's view: what the mixins are put before
    _AveragerBase: typing.TypeAlias = DecentralizedAverager
else:
    _AveragerBase = object

logger = logging.getLogger(__name__)


def compose_averager(
    base: type, *mixins: type, behind: Sequence[type] = (), qualname: str | None = None, **attributes
) -> type:
    """``base`` (a hivemind averager class) with ``mixins`` in front of it and ``behind`` after it, as one class.

    Its ``__name__`` (the RPC name) is ``base``'s with each mixin's ``rpc_name_prefix`` in front; each composed class
    collects its own RPC handlers. Shown by tests/swarm/test_keys_and_averagers.py::
    test_composed_averagers_keep_hivemind_rpc_names_unless_the_round_computes_otherwise.

    KeptPipeCallsMixin goes in front of the first composition of a class (a class composed again has it already).

    :param behind: classes placed after ``base`` in the method resolution order (they are its ``super()``)
    :param qualname: the class's name in tracebacks and reprs (default: the mixins' names and ``base``'s)
    :param attributes: class attributes, set before hivemind forks the averager's process
    """
    rpc_name = "".join(getattr(mixin, "rpc_name_prefix", "") for mixin in mixins) + base.__name__
    name = qualname or "".join(mixin.__name__.removesuffix("Mixin") for mixin in mixins) + base.__name__
    namespace = {"__module__": __name__, "__qualname__": name, "_rpc_handlers": None, "_stub_type": None, **attributes}
    kept = () if issubclass(base, KeptPipeCallsMixin) else (KeptPipeCallsMixin,)
    return type(rpc_name, (*kept, *mixins, base, *behind), namespace)


class ForkedTorchThreadsMixin(_AveragerBase):
    """Put before a hivemind averager class: its process (a fork of the trainer's) rebuilds torch's thread pool once,
    before any of its threads runs a tensor operation.

    Otherwise the first operations of its threads race to rebuild the pool ("Invalid thread pool!"), and hivemind
    drops the part silently. Shown by tests/swarm/test_optim.py::
    test_averager_processes_rebuild_torch_threads_before_their_threads_race.
    """

    def run(self):
        # in the averager's own process, in one thread, before hivemind starts its event loop and executors
        torch.set_num_threads(torch.get_num_threads())
        # hivemind's 8-bit quantization calls a deprecated torch function: nothing a user can act on
        warnings.filterwarnings("ignore", message="torch.quantize_per_tensor", category=UserWarning)
        super().run()


class SentBytesMixin(_AveragerBase):
    """Put before a hivemind averager class: counts the bytes its process sends to other peers, and of those the
    states it served, for ``bytes_sent()`` to read. Counted in ``P2P.send_raw_data`` in the averager's own process;
    unary calls (no tensors) are not counted.
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

    @kept_until_done
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

    hivemind's TrainingStateAverager returns nothing; placed *after* it in the method resolution order, this class is
    its ``super()`` and sees the download on its way.
    """

    last_downloaded_epoch: int | None = None

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None):
        loaded = super().load_state_from_peers(wait=wait, timeout=timeout)
        if wait:
            metadata = loaded[0] if loaded is not None else None
            epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
            self.last_downloaded_epoch = epoch if isinstance(epoch, int) else None
        return loaded


# seconds a peer in client mode waits for a leader's answer to its join request: a home router's 64 KiB queue holds
# 2 s at 0.25 Mbit/s, and the answer crosses it twice (docs/known-hivemind-behaviours.md)
CLIENT_JOIN_ANSWER_TIMEOUT = 5.0


# seconds a state download waits for its next part (64 KiB): 5 s at 0.1 Mbit/s, more while TCP backs off, and a
# download given up starts again from its first part (tests/swarm/test_optim.py::
# test_a_peer_in_client_mode_waits_for_its_leader_and_for_state_parts_as_its_link_needs_and_prints_no_advice)
STATE_DOWNLOAD_PART_TIMEOUT = 30.0


class _LeaderlessRequestTimeoutFilter(logging.Filter):
    """Drops hivemind's advice to keep request_timeout below min_matchmaking_time (two leaders that request each
    other could wait on each other until it passes): a peer in client mode leads no group."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "request_timeout smaller than min_matchmaking_time" not in record.getMessage()


class FinishServingMixin(_AveragerBase):
    """Put before a hivemind averager class: told to shut down, its process first lets the averaged parts it is still
    sending back to its group go out (for up to ``serving_grace`` seconds), then shuts down as hivemind does.

    As a reducer it may still owe its group averaged parts after its own results are back. Shown by
    tests/swarm/test_keys_and_averagers.py::test_a_peer_that_stops_after_its_last_round_first_sends_the_parts_it_owes_its_group.
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


class ClientModeMatchmakingMixin(_AveragerBase):
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

    def roles(self) -> list[str | None]:
        """Each member's role (a member of a kit that sent its role alone counts too)."""
        return [entry.get("role") if isinstance(entry, dict) else entry for entry in self.values()]

    def epoch(self) -> int | None:
        """The round's epoch: an anchor's when the group holds one (the organizer's peer, whose epoch is the swarm's for
        peers in client mode), else the one more than half of the members were at; None if no such epoch.

        hivemind's groups are not keyed by epoch; a lone member's claim never decides. Shown by
        tests/swarm/test_optim.py::test_a_rounds_epoch_is_its_anchors_or_its_majoritys_and_never_one_members_claim."""
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

    hivemind reports a partial round only as a log line; both are read here, in the averager's process.

    An anchor keeps its group open until every expected training peer has joined (``expect_peers``), then starts
    ``join_grace`` seconds later; others are let in too, a peer whose time comes first sets the start, and the run's
    other anchors are waited for up to ``co_anchor_wait`` seconds. Shown by tests/swarm/test_optim.py::
    test_an_anchor_that_leads_waits_for_the_runs_other_anchor_before_it_starts_the_group.
    """

    round_role = TRAINER_ROLE

    @property  # read-only on purpose, over RunnerChoiceMixin's plain class attribute
    def sends_stand_ins(self) -> bool:  # type: ignore[override]
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
            # a leader turns away a peer that asks to start before its own time (BAD_EXPIRATION_TIME): ask for the
            # latest start the timeout allows; a round not scheduled ahead gets the optimizer's averaging timeout
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

    @kept_until_done
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
                # an anchor's time is no start time: let the earlier peer in and start by its time instead
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
            followers = self._follower_deadlines or {}
            deadlines = [followers[peer] for peer in matchmaking.current_followers if peer in followers]
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
