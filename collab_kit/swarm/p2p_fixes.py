"""A fix for hivemind's client of the p2p daemon, installed before the kit starts any daemon.

hivemind (1.1.12) sends every unary call of a process (each DHT request, each ping) over one connection to its p2p
daemon, and one task reads all the answers, handing each to the future its call waits on. When a call is cancelled
(its deadline passed, or a sibling request already found what was asked) in the same turn of the event loop in which
its answer was read off the socket, the future is already cancelled while the call is still listed, and the reading
task's ``set_result`` raises ``InvalidStateError``. That ends the reading task, silently: from then on no call of that
process is ever answered. A volunteer's DHT then drops its neighbours one by one, the watchdog finds the initial peers'
TCP ports open but every ping unanswered, and the peer trains alone for the rest of the run.

``install_p2p_fixes`` makes an answer to a call that was already given up on go to a throwaway future instead: the
answer is dropped (nobody waits for it) and the reading task goes on.
"""
from __future__ import annotations

import asyncio
import logging
from functools import wraps

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


def install_p2p_fixes() -> None:
    """Install the fix in hivemind's ``ControlClient`` (once; clients made afterwards, in this process and in the
    processes it forks, such as the DHT's and the averagers', get it)."""
    if getattr(ControlClient.__init__, "_collab_kit_fixed", False):
        return
    shipped_init = ControlClient.__init__

    @wraps(shipped_init)
    def __init__(self, *args, **kwargs):
        shipped_init(self, *args, **kwargs)
        self._pending_calls = PendingCalls(self._pending_calls)

    __init__._collab_kit_fixed = True
    ControlClient.__init__ = __init__
