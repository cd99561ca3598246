"""Streams between averagers that end only once their last message is through: the caller closes them, not the server.

hivemind's server closes a stream (``rpc_aggregate_part``, ``rpc_join_group``) right after writing its last
message, which may then never reach the caller (docs/known-hivemind-behaviours.md). Here the side that knows the
stream is done closes it:

- as a caller of ``rpc_aggregate_part``, once every part sent has its averaged part back
  (``stub_closing_answered_streams``);
- as a server, a stream answered in full stays open until the caller closes it, for at most
  ``answered_stream_linger`` seconds; a stream the server gives up on ends at once.

State downloads are left as hivemind has them (a download cut short fails its size check and is tried again).
Shown by tests/swarm/test_streams.py::test_a_kit_averager_and_one_as_hivemind_ships_it_still_average_in_full.
"""

from __future__ import annotations

import asyncio
import logging
import typing
from collections.abc import AsyncGenerator
from contextlib import suppress
from typing import AsyncIterator  # noqa: UP035 (hivemind finds a stream rpc_ handler by typing's hint)

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

logger = logging.getLogger(__name__)


class _CountedRequests:
    """An async iterator over a stream's requests that counts them and notes that the caller finished sending."""

    def __init__(self, requests: AsyncIterator):
        self._requests, self.count, self.ended = requests, 0, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            request = await self._requests.__anext__()
        except StopAsyncIteration:
            self.ended = True
            raise
        self.count += 1
        return request


async def _answers_until_complete(
    answers: AsyncGenerator[averaging_pb2.AveragingData, None], sent: _CountedRequests, all_sent: asyncio.Event
) -> AsyncIterator[averaging_pb2.AveragingData]:
    """Yield the server's answers until every part sent is answered (then close the stream), or until its end."""
    received, next_answer, sending_done = 0, None, None
    try:
        while not (all_sent.is_set() and received >= sent.count):
            if next_answer is None and received < sent.count:
                answer = await anext(answers)
            else:
                if next_answer is None:
                    next_answer = asyncio.ensure_future(anext(answers))
                if received >= sent.count:
                    # every part sent is answered: wait for the next part or the end of sending, whichever comes first
                    sending_done = asyncio.ensure_future(all_sent.wait())
                    await asyncio.wait({next_answer, sending_done}, return_when=asyncio.FIRST_COMPLETED)
                    sending_done.cancel()
                    if not next_answer.done():
                        continue  # sending is over: the loop ends if every part is answered, else waits on
                answer, next_answer = await next_answer, None
            if answer.code == averaging_pb2.AVERAGED_PART:
                received += 1
            yield answer
    except StopAsyncIteration:
        return  # the server ended the stream first (as hivemind's server does, or after an error it sent)
    finally:
        if sending_done is not None:
            sending_done.cancel()
        if next_answer is not None and not next_answer.done():
            next_answer.cancel()
            with suppress(asyncio.CancelledError, StopAsyncIteration):
                await next_answer
        await answers.aclose()


class _StubClosingAnsweredStreams:
    """A hivemind averager stub whose ``rpc_aggregate_part`` stream is closed by the caller once it is answered in
    full; every other call goes to the stub as it is."""

    def __init__(self, stub):
        self._stub = stub

    def __getattr__(self, name: str):
        return getattr(self._stub, name)

    async def rpc_aggregate_part(
        self, requests: AsyncIterator[averaging_pb2.AveragingData], timeout: float | None = None
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        all_sent = asyncio.Event()

        async def requests_then_done():
            async for request in requests:
                yield request
            all_sent.set()

        sent = _CountedRequests(requests_then_done())
        answers = await self._stub.rpc_aggregate_part(sent, timeout)
        return _answers_until_complete(answers, sent, all_sent)


def stub_closing_answered_streams(stub):
    """``stub`` (a hivemind averager's stub) with its all-reduce streams closed by this caller once answered."""
    return _StubClosingAnsweredStreams(stub)


if typing.TYPE_CHECKING:
    from hivemind.averaging import DecentralizedAverager

    _AveragerBase: typing.TypeAlias = DecentralizedAverager  # the type checker's view: what the mixin is put before
else:
    _AveragerBase = object


class CallerClosesStreamsMixin(_AveragerBase):
    """Put before a hivemind averager class: the streams it calls and serves in rounds and matchmaking end with the
    caller's close once the caller has every message (see the module's docstring)."""

    answered_stream_linger: float = 60.0  # seconds an answered stream waits for its caller to close it

    @classmethod
    def get_stub(cls, p2p, peer: PeerID, *, namespace: str | None = None):
        return stub_closing_answered_streams(super().get_stub(p2p, peer, namespace=namespace))

    async def _wait_for_caller_to_close(self, what: str, context: P2PContext) -> None:
        # the caller's close ends the stream: hivemind then cancels this handler, here
        await asyncio.sleep(self.answered_stream_linger)
        logger.debug(
            f"{what} answered in full but not closed by {context.remote_id} in {self.answered_stream_linger}"
            f" s: closing it"
        )

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        requests, answered = _CountedRequests(stream), 0
        async for message in super().rpc_aggregate_part(requests, context):
            answered += message.code == averaging_pb2.AVERAGED_PART
            yield message
        if requests.ended and requests.count == answered > 0:
            await self._wait_for_caller_to_close("all-reduce stream", context)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        last_code = None
        async for message in super().rpc_join_group(request, context):
            last_code = message.code
            yield message
        # after ACCEPTED a follower waits for more: a leader that stops there (cancelled) ends the stream at once
        if last_code is not None and last_code != averaging_pb2.ACCEPTED:
            await self._wait_for_caller_to_close("join request", context)


__all__ = ["CallerClosesStreamsMixin", "stub_closing_answered_streams"]
