"""Calls that hivemind runs as tasks nobody holds, kept until they are done.

hivemind's averager and DHT processes run each call sent down their pipe as ``asyncio.create_task(...)`` and keep
no reference to the task. asyncio itself holds tasks only weakly, and a stream to the p2p daemon holds its reader
only weakly too: a call waiting for the daemon's answer (a stream opened to a peer, an MPFuture) is then an island
of garbage, and the next collection destroys it half-way ("Task was destroyed but it is pending!"). Its future is
never set, and the trainer that waits on it waits for its whole timeout (a state download: load_state_timeout, 30
minutes). ``kept_until_done`` holds such a call's task until it ends; ``KeptPipeCallsMixin`` does it for every call
hivemind's averager sends down its pipe. Shown by tests/swarm/test_kept_tasks.py.
"""

from __future__ import annotations

import asyncio
import functools
import typing
from collections.abc import Awaitable, Callable

if typing.TYPE_CHECKING:
    from hivemind.averaging import DecentralizedAverager

    _AveragerBase: typing.TypeAlias = DecentralizedAverager  # the type checker's view: what the mixin is put before
else:
    _AveragerBase = object

_KEPT: set[asyncio.Task] = set()  # in each process: the tasks of kept calls that have not ended

# the calls hivemind 1.1.12's DecentralizedAverager sends down its pipe (besides _shutdown, which it awaits itself)
HIVEMIND_AVERAGER_PIPE_CALLS = (
    "_step",
    "_load_state_from_peers",
    "_get_group_bits",
    "_set_group_bits",
    "_trigger_declare_load_state",
)

_Call = typing.TypeVar("_Call", bound=Callable[..., Awaitable])


def kept_until_done(call: _Call) -> _Call:
    """Decorate a coroutine function (a method or a module-level function that hivemind runs as a task of its own):
    the task that runs it is held until the call ends, so that no garbage collection destroys it while it waits."""

    @functools.wraps(call)
    async def kept(*args, **kwargs):
        task = asyncio.current_task()
        if task is not None:
            _KEPT.add(task)
        try:
            return await call(*args, **kwargs)
        finally:
            _KEPT.discard(task)

    kept.kept_until_done = True  # type: ignore[attr-defined]  # what tests/swarm/test_kept_tasks.py looks for
    return typing.cast(_Call, kept)


def is_kept(call: object) -> bool:
    """Whether ``call`` is decorated with ``kept_until_done``."""
    return getattr(call, "kept_until_done", False) is True


class KeptPipeCallsMixin(_AveragerBase):
    """Put in front of a hivemind averager class (``compose_averager`` does): each call hivemind sends down the
    averager's pipe runs as a kept task, whatever mixin behind it overrides the call."""

    @kept_until_done
    async def _step(self, **kwargs):
        return await super()._step(**kwargs)

    @kept_until_done
    async def _load_state_from_peers(self, future, timeout=None):
        return await super()._load_state_from_peers(future, timeout=timeout)

    @kept_until_done
    async def _get_group_bits(self, future):
        return await super()._get_group_bits(future)

    @kept_until_done
    async def _set_group_bits(self, group_bits, future):
        return await super()._set_group_bits(group_bits, future)

    @kept_until_done
    async def _trigger_declare_load_state(self):
        return await super()._trigger_declare_load_state()
