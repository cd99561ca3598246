"""A unary call whose deadline passes in the same turn of the event loop in which its answer arrives, then one more
call: run as ``python late_answer_scenario.py shipped|fixed``, prints one JSON line.

The server's p2p client runs in a thread of its own (so it answers while this loop is busy); this loop is held busy
(``time.sleep``) while the answer arrives and the deadline passes, so that both fall in its next turn.
"""

import asyncio
import json
import sys
import threading
import time

from hivemind.p2p import P2P

from collab_kit.swarm.p2p_fixes import install_p2p_fixes

ANSWER_AFTER, DEADLINE, BUSY_FOR = 0.2, 0.3, 0.6


def main(variant: str) -> dict:
    if variant == "fixed":
        install_p2p_fixes()
    server_loop = asyncio.new_event_loop()
    threading.Thread(target=server_loop.run_forever, daemon=True).start()

    def on_server(coroutine):
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, server_loop))

    async def scenario() -> dict:
        server = await on_server(P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        addresses = [str(address) for address in await on_server(server.get_visible_maddrs())]
        client = await P2P.create(initial_peers=addresses, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:

            async def slow(data, _peer):
                await asyncio.sleep(ANSWER_AFTER)
                return data

            async def echo(data, _peer):
                return data

            for name, handler in (("slow", slow), ("echo", echo)):
                await on_server(server._client.add_unary_handler(name, handler))
            control = client._client.control
            assert await control.call_unary_handler(server.peer_id, "echo", b"warm") == b"warm"

            async def call_with_deadline():
                async with asyncio.timeout(DEADLINE):
                    return await control.call_unary_handler(server.peer_id, "slow", b"late")

            late = asyncio.create_task(call_with_deadline())
            await asyncio.sleep(0.1)  # the request is out, the server's handler sleeps
            time.sleep(BUSY_FOR)  # this loop is busy: the answer arrives and the deadline passes meanwhile
            try:
                outcome = f"answered {await late!r}"
            except TimeoutError:
                outcome = "timed out"
            try:
                later = await asyncio.wait_for(control.call_unary_handler(server.peer_id, "echo", b"next"), 5)
            except asyncio.TimeoutError:
                later = None
            reader = control._read_task
            return {
                "late_call": outcome,
                "next_call_answered": later == b"next",
                "reader_error": repr(reader.exception()) if reader.done() and not reader.cancelled() else None,
            }
        finally:
            await client.shutdown()
            await on_server(server.shutdown())

    try:
        return asyncio.run(scenario())
    finally:
        server_loop.call_soon_threadsafe(server_loop.stop)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
