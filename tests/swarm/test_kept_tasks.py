"""A call hivemind runs as a task nobody holds survives a garbage collection while it waits on the p2p daemon, and
every such call of the kit's averagers and DHT coroutines is kept (collab_kit.swarm.kept_tasks)."""

import asyncio
import gc
import inspect
import re
from pathlib import Path

import hivemind.averaging.averager
import pytest
import uvloop
from hivemind.averaging import DecentralizedAverager
from hivemind.optim.grad_averager import GradientAverager

import collab_kit.swarm
from collab_kit.config import OptimizerConfig
from collab_kit.swarm import liveness, reachability, watchdog
from collab_kit.swarm.averagers import (
    ANCHOR_ROLE,
    TRAINER_ROLE,
    compose_averager,
    recording_state_averager_class,
    round_report_averager_class,
)
from collab_kit.swarm.bindings import authorized_averager_class
from collab_kit.swarm.kept_tasks import HIVEMIND_AVERAGER_PIPE_CALLS, KeptPipeCallsMixin, is_kept, kept_until_done
from collab_kit.swarm.local_updates import mode_averager_class
from collab_kit.swarm.robust import CenteredClipAverager, with_centered_clip

PIPE_CALL = re.compile(r"_outer_pipe\.send\(\s*\(\s*\"(\w+)\"")
DHT_COROUTINE = re.compile(r"run_coroutine\(\s*(?:partial\(\s*)?(\w+)")


async def _ask_daemon(path: str, answers: list) -> None:
    """What hivemind's daemon client does for each stream it opens: a unix connection, a request, and a wait for the
    daemon's answer (a stream open waits as long as the daemon dials the peer)."""
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(b"open")
    await writer.drain()
    answers.append(await reader.readexactly(2))
    writer.close()


@kept_until_done
async def _ask_daemon_kept(path: str, answers: list) -> None:
    await _ask_daemon(path, answers)


def test_a_call_nobody_holds_outlives_a_garbage_collection_while_the_daemon_has_not_answered(tmp_path):
    loop = uvloop.new_event_loop()  # the averager's loop (hivemind switches to uvloop)
    destroyed: list[str] = []
    loop.set_exception_handler(lambda _, context: destroyed.append(context["message"]))
    path, asked, answer = str(tmp_path / "daemon.sock"), asyncio.Queue(), None
    plain_answers: list[bytes] = []
    kept_answers: list[bytes] = []

    async def daemon(reader, writer):
        await reader.readexactly(4)
        await asked.put(writer)

    async def start():
        nonlocal answer
        server = await asyncio.start_unix_server(daemon, path)
        # as hivemind's averager loop does: create_task, and no reference kept
        loop.create_task(_ask_daemon(path, plain_answers))
        loop.create_task(_ask_daemon_kept(path, kept_answers))
        writers = [await asyncio.wait_for(asked.get(), 10) for _ in range(2)]
        return server, writers

    try:
        server, writers = loop.run_until_complete(start())
        gc.collect()  # what any allocation in the averager's process may set off while the daemon dials a peer

        async def answer_and_wait():
            for writer in writers:
                try:
                    writer.write(b"ok")
                    await writer.drain()
                except ConnectionError:  # the call that was destroyed took its connection with it
                    pass
            for _ in range(200):  # 2 s at most
                if kept_answers:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # and a moment for a call that is still there to take its answer
            server.close()

        loop.run_until_complete(answer_and_wait())
    finally:
        loop.close()
    assert kept_answers == [b"ok"], "the kept call did not get the daemon's answer"
    # the same call, not kept, is destroyed half-way: its answer never arrives (the reason for kept_until_done)
    assert plain_answers == []
    assert "Task was destroyed but it is pending!" in destroyed


def _kit_averager_classes() -> list[type]:
    local = OptimizerConfig(local_steps=10, fragments=2)
    state = recording_state_averager_class()
    trainer = round_report_averager_class(GradientAverager, TRAINER_ROLE)
    return [
        state,
        authorized_averager_class(state),
        mode_averager_class(state, local, gradients=False),
        trainer,
        round_report_averager_class(GradientAverager, ANCHOR_ROLE),
        mode_averager_class(authorized_averager_class(with_centered_clip(trainer)), local),
        CenteredClipAverager,
        compose_averager(DecentralizedAverager),
    ]


def _kit_sources() -> dict[str, str]:
    folder = Path(collab_kit.swarm.__file__).parent
    return {path.name: path.read_text() for path in sorted(folder.glob("*.py"))}


def test_every_call_sent_down_an_averagers_pipe_is_kept_in_every_averager_the_kit_composes():
    hivemind_calls = set(PIPE_CALL.findall(inspect.getsource(hivemind.averaging.averager))) - {"_shutdown"}
    assert hivemind_calls == set(HIVEMIND_AVERAGER_PIPE_CALLS)  # hivemind's loop awaits _shutdown itself
    kit_calls = {name for source in _kit_sources().values() for name in PIPE_CALL.findall(source)}
    assert {"_set_state_readers", "_report_served_state", "_set_expected_peers"} <= kit_calls
    for averager_class in _kit_averager_classes():
        assert issubclass(averager_class, KeptPipeCallsMixin)
        for name in sorted(hivemind_calls | kit_calls):
            call = getattr(averager_class, name, None)
            if call is not None:
                assert is_kept(call), f"{averager_class.__qualname__}.{name} runs as a task nobody holds"


def test_every_coroutine_the_kit_runs_in_the_dhts_process_is_kept():
    modules = {"liveness.py": liveness, "watchdog.py": watchdog, "reachability.py": reachability}
    found = {
        (name, coroutine) for name, source in _kit_sources().items() for coroutine in DHT_COROUTINE.findall(source)
    }
    assert {name for name, _ in found} == set(modules)  # a new module that runs one is added here
    for name, coroutine in sorted(found):
        assert is_kept(getattr(modules[name], coroutine)), f"{name}: {coroutine} runs as a task nobody holds"


@pytest.mark.parametrize("failure", [None, ValueError("no answer")])
def test_a_kept_call_lets_go_of_its_task_when_it_ends(failure):
    @kept_until_done
    async def call():
        if failure is not None:
            raise failure
        return 7

    async def run():
        task = asyncio.ensure_future(call())
        try:
            return await task
        finally:
            assert task.done()
            assert task not in collab_kit.swarm.kept_tasks._KEPT

    if failure is None:
        assert asyncio.run(run()) == 7
    else:
        with pytest.raises(ValueError, match="no answer"):
            asyncio.run(run())
