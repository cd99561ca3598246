"""Two fixes for hivemind 1.1.12's processes, installed before the kit starts any daemon or DHT.

- **An answer to a call already given up on** goes to a throwaway future. As shipped, setting the cancelled call's
  future raises in the task that reads every answer of the process, and no later call is answered.
- **A DHT request whose sender is gone** is one dropped request. As shipped, the ``EOFError`` of reading it ends the
  DHT's process, and every later request of the peer waits for ever.

docs/hivemind.md has both as reports for hivemind's tracker (what happens, a reproduction with hivemind alone, the
fix); tests/swarm/test_p2p_fixes.py runs the reproductions and shows the fixes hold.
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
            raise ConnectionError(
                "a request to the DHT was dropped: the process that sent it ended while the DHT "
                "fetched the pipe end for its answer"
            ) from error

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

    vars(client_init)["_collab_kit_fixed"] = True  # the mark getattr reads above
    ControlClient.__init__, DHT.run = client_init, dht_run
