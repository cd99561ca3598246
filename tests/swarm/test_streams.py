"""Streams between averagers end with the caller's close, once the caller has every message (collab_kit.swarm.streams).

Real hivemind averagers on 127.0.0.1, each in its own process as hivemind runs them; a recorder in front of the
kit's mixin tells, in the serving process, whether each stream it served was closed by its caller or by itself.
"""

import asyncio
import multiprocessing as mp
from typing import AsyncIterator  # noqa: UP035 (hivemind finds a stream rpc_ handler by typing's hint)

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from waiting import wait_until

from collab_kit.config import SwarmConfig
from collab_kit.swarm.averagers import compose_averager
from collab_kit.swarm.dht import start_dht
from collab_kit.swarm.streams import CallerClosesStreamsMixin

pytestmark = pytest.mark.slow


class StreamEndRecorderMixin:
    """Counts, in the serving process, how each served stream ended: closed by its caller, or by this server."""

    ends = None  # {("aggregate" | "join", "caller" | "server"): mp.Value}, set by the test before the averager starts

    def _record(self, stream: str, closed_by: str) -> None:
        with self.ends[stream, closed_by].get_lock():
            self.ends[stream, closed_by].value += 1

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        try:
            async for message in super().rpc_aggregate_part(stream, context):
                yield message
        except asyncio.CancelledError:  # hivemind cancels a handler whose caller closed the stream
            self._record("aggregate", "caller")
            raise
        self._record("aggregate", "server")

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        try:
            async for message in super().rpc_join_group(request, context):
                yield message
        except asyncio.CancelledError:
            self._record("join", "caller")
            raise
        self._record("join", "server")


def recorded_class(*mixins, linger: float):
    ends = {(stream, by): mp.Value("i", 0) for stream in ("aggregate", "join") for by in ("caller", "server")}
    averager_class = compose_averager(
        DecentralizedAverager, StreamEndRecorderMixin, *mixins, ends=ends, answered_stream_linger=linger
    )
    return averager_class, ends


def averaging_rounds(first_class, second_class, rounds: int, served: list):
    """``rounds`` rounds of two averagers (1s and 0s, many parts each); how many values missed each average.

    The averagers stop once ``served`` (each serving class's counters) holds an end for each all-reduce stream.
    """
    first_dht = start_dht(SwarmConfig(host="127.0.0.1"))
    second_dht = start_dht(
        SwarmConfig(host="127.0.0.1", initial_peers=[str(a) for a in first_dht.get_visible_maddrs()])
    )
    size = 2**16
    common = dict(
        prefix="streams",
        target_group_size=2,
        min_matchmaking_time=2.0,
        request_timeout=2.0,
        part_size_bytes=2**14,
        start=True,
    )  # 8 parts of 16 KiB for each peer to reduce
    first = first_class([torch.zeros(size)], dht=first_dht, **common)
    second = second_class([torch.zeros(size)], dht=second_dht, **common)
    missed = []
    try:
        for _ in range(rounds):
            for averager, value in ((first, 1.0), (second, 0.0)):
                with averager.get_tensors() as (tensor,):
                    tensor.fill_(value)
            first_round, second_round = first.step(wait=False), second.step(wait=False)
            assert first_round.result(timeout=90) is not None and second_round.result(timeout=90) is not None
            for averager in (first, second):
                with averager.get_tensors() as (tensor,):
                    missed.append((tensor != 0.5).sum().item())
        # a round is over for a peer once its own results are in; the streams it served end in the background
        wait_until(
            lambda: sum(ends["aggregate", by].value for ends in served for by in ("caller", "server")) == 2 * rounds,
            timeout=30,
            what="an end of every all-reduce stream served",
        )
    finally:
        for process in (first, second, second_dht, first_dht):
            process.shutdown()
    return missed


def counts(ends):
    return {key: value.value for key, value in ends.items()}


def test_kit_averagers_close_each_stream_as_its_caller_once_every_part_and_the_group_are_in():
    averager_class, ends = recorded_class(CallerClosesStreamsMixin, linger=60.0)
    missed = averaging_rounds(averager_class, averager_class, rounds=3, served=[ends])
    assert missed == [0] * 6, missed
    seen = counts(ends)
    # each round: each peer served the other's all-reduce stream, and the leader served the follower's join request.
    # Every one of them was closed by the caller once it had all its messages (a server that closes first may lose
    # its last message on the way), none by its server (nor after the 60 s a caller that never closes is given)
    assert seen[("aggregate", "caller")] == 6 and seen[("aggregate", "server")] == 0, seen
    assert seen[("join", "caller")] >= 3 and seen[("join", "server")] == 0, seen


@pytest.mark.parametrize("kit_side", ["first", "second"])
def test_a_kit_averager_and_one_as_hivemind_ships_it_still_average_in_full(kit_side):
    # hivemind's caller reads to the stream's end: the kit's server closes it after answered_stream_linger (2 s here)
    # if that caller has not given it up first; hivemind's server closes right after its last answer, which the kit's
    # caller reads as the end too. averaging_rounds waits until every stream served has ended either way
    kit_class, kit_ends = recorded_class(CallerClosesStreamsMixin, linger=2.0)
    shipped_class, shipped_ends = recorded_class(linger=2.0)
    classes = (kit_class, shipped_class) if kit_side == "first" else (shipped_class, kit_class)
    missed = averaging_rounds(*classes, rounds=2, served=[kit_ends, shipped_ends])
    assert missed == [0] * 4, missed
