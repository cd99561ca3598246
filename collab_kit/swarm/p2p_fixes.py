"""Two fixes for hivemind's processes, installed before the kit starts any daemon or DHT.

**Answers to calls already given up on.** hivemind (1.1.12) sends every unary call of a process (each DHT request, each ping) over one connection to its p2p
daemon, and one task reads all the answers, handing each to the future its call waits on. When a call is cancelled
(its deadline passed, or a sibling request already found what was asked) in the same turn of the event loop in which
its answer was read off the socket, the future is already cancelled while the call is still listed, and the reading
task's ``set_result`` raises ``InvalidStateError``. That ends the reading task, silently: from then on no call of that
process is ever answered. A volunteer's DHT then drops its neighbours one by one, the watchdog finds the initial peers'
TCP ports open but every ping unanswered, and the peer trains alone for the rest of the run.

``install_p2p_fixes`` makes an answer to a call that was already given up on go to a throwaway future instead: the
answer is dropped (nobody waits for it) and the reading task goes on.

**A request whose sender is gone.** Every process of a peer (the trainer, each averager) sends its DHT requests
through one pipe to the DHT's process, each with a future that carries a pipe end of the sender's: the DHT's process
fetches that end from the sender while it reads the request. When the sender ends first (an averager shut down right
after a request), the fetch fails. hivemind's DHT process survives the usual failures of that fetch (logged, the
request dropped), but not an ``EOFError`` from a sender that died during the fetch's handshake: the DHT's process ended,
and the peer's next use of its DHT waited for ever. Seen once in about 800 averager shutdowns beside running DHTs (a
test averages twice on the same four DHTs, shutting the first averagers down in between).

``install_p2p_fixes`` makes the DHT's process read each request in two steps: the bytes (the end of the pipe itself,
when the peer's own process is gone, still ends the DHT's process as before), then the request, where that failure is
one more dropped request.
"""
from __future__ import annotations

import asyncio
import logging
from functools import wraps

from multiprocessing.reduction import ForkingPickler

from hivemind.dht import DHT
from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

logger = logging.getLogger(__name__)


class PendingCalls(dict):
    """The calls a ``ControlClient`` waits on, by call id, where a call already cancelled yields a throwaway future.

    The reading task looks a call up (``call_id in calls``, then ``calls[call_id].set_result(...)``); the caller takes
    its call out of the map only when it runs again after its cancellation, which may be after the answer was read.
    """

    def __getitem__(self, call_id):
        future = super().__getitem__(call_id)
        if future.done():  # cancelled while its answer was on its way: the answer has nobody to go to
            logger.debug(f"dropped the p2p daemon's answer to call {call_id}: its caller gave up on it")
            return asyncio.get_running_loop().create_future()
        return future


class DHTRequestPipe:
    """The DHT's process's end of its request pipe, where a request that cannot be read because its sender is gone is
    a ``ConnectionError``, which hivemind's DHT process logs and survives, not an ``EOFError``, which ends it."""

    def __init__(self, connection):
        self._connection = connection

    def recv(self):
        message = self._connection.recv_bytes()  # EOFError here: the pipe itself is closed, the peer's process gone
        try:
            return ForkingPickler.loads(message)
        except EOFError as error:
            raise ConnectionError("a request to the DHT was dropped: the process that sent it ended while the DHT "
                                  "fetched the pipe end for its answer") from error

    def __getattr__(self, name):  # poll, fileno, close: the connection's own
        return getattr(self._connection, name)


def install_p2p_fixes() -> None:
    """Install both fixes, once: in hivemind's ``ControlClient`` (clients made afterwards, in this process and in the
    processes it forks, such as the DHT's and the averagers', get it) and in ``DHT`` (DHTs started afterwards)."""
    if getattr(ControlClient.__init__, "_collab_kit_fixed", False):
        return
    shipped_client_init, shipped_dht_run = ControlClient.__init__, DHT.run

    @wraps(shipped_client_init)
    def client_init(self, *args, **kwargs):
        shipped_client_init(self, *args, **kwargs)
        self._pending_calls = PendingCalls(self._pending_calls)

    @wraps(shipped_dht_run)
    def dht_run(self):  # in the DHT's own process, before it reads any request
        if not isinstance(self._inner_pipe, DHTRequestPipe):
            self._inner_pipe = DHTRequestPipe(self._inner_pipe)
        shipped_dht_run(self)

    client_init._collab_kit_fixed = True
    ControlClient.__init__, DHT.run = client_init, dht_run
