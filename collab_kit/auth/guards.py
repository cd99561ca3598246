"""What uvicorn lacks against slow and idle clients: a deadline for each whole request, and a cap on the
connections one client address holds open (see ``AuthServerSettings``).
"""

from __future__ import annotations

import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


def _request_timeout_answer(deadline: float) -> bytes:
    body = json.dumps(
        {"detail": f"the request did not arrive whole within {deadline:g} s; send it again, at once"}
    ).encode()
    return (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def guarded_protocol_class(request_deadline: float, connections_per_client: int) -> type:
    """uvicorn's h11 protocol with what it lacks against slow and idle clients, for one server: a deadline for each
    whole request, and a cap on connections per client address (see ``AuthServerSettings``).

    uvicorn waits forever for a request that stops halfway, and its ``limit_concurrency`` counts such connections:
    one client holding a few hundred half-sent requests would have every other join answered 503.
    """
    open_connections: dict[str, int] = {}  # client address -> connections open now
    refused: dict[str, int] = {}  # client address -> connections closed for the cap (for the log)

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._deadline_timer = None
            self._address = self.client[0] if self.client else None
            if self._address is not None:
                open_connections[self._address] = open_connections.get(self._address, 0) + 1
                if connections_per_client and open_connections[self._address] > connections_per_client:
                    refused[self._address] = refused.get(self._address, 0) + 1
                    if refused[self._address] % 100 == 1:  # one line per hundred, not one per connection
                        logger.warning(
                            f"{self._address} holds {connections_per_client} connections already: "
                            f"closing its new ones ({refused[self._address]} so far)"
                        )
                    transport.close()
                    return
            self._arm_deadline()  # a connection that never sends a byte is closed at the deadline too

        def data_received(self, data: bytes) -> None:
            if self._deadline_timer is None and self.conn.their_state is h11.IDLE:
                self._arm_deadline()  # the first bytes of a new request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
                self._disarm_deadline()  # the whole request is in

        def connection_lost(self, exc) -> None:
            self._disarm_deadline()
            if self._address is not None:
                left = open_connections.get(self._address, 1) - 1
                if left > 0:
                    open_connections[self._address] = left
                else:
                    open_connections.pop(self._address, None)
                    refused.pop(self._address, None)
            super().connection_lost(exc)

        def _arm_deadline(self) -> None:
            self._deadline_timer = self.loop.call_later(request_deadline, self._deadline_passed)

        def _disarm_deadline(self) -> None:
            if getattr(self, "_deadline_timer", None) is not None:
                self._deadline_timer.cancel()
                self._deadline_timer = None

        def _deadline_passed(self) -> None:
            self._deadline_timer = None
            if self.transport.is_closing() or self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
                return
            logger.info(
                f"closed a connection from {self._address}: its request did not arrive whole within "
                f"{request_deadline:g} s"
            )
            answering = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
            if not answering:  # (the cycle of a kept-alive connection's last request is over)
                self.transport.write(_request_timeout_answer(request_deadline))
            self.transport.close()

    return GuardedH11Protocol
