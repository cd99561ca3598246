"""A DHT peer for the network lab's link tests, run inside a namespace. Each mode runs until killed.

- ``serve``: starts a DHT that accepts connections, stores a small record under ``note`` and prints its addresses;
- ``watch ADDRESS...``: joins through them in client mode, with a SwarmWatchdog whose link events it prints, and
  reports every second how many neighbours its routing table holds;
- ``queue TIMEOUT SIZE ADDRESS...``: joins the same way with DHT requests that wait TIMEOUT seconds for an answer,
  then fills its link with DHT stores of SIZE bytes in all to its neighbour and, while they are queued on libp2p's
  one connection, reads ``note``: that request waits behind them. It reports its table every half second, how long
  the read took and what it found, and when it found ``note`` again, the link's queue through.
"""
import asyncio
import logging
import os
import sys
import threading
import time
from functools import partial

from hivemind.utils import get_dht_time

from collab_kit.config import SwarmConfig
from collab_kit.roles.processes import emit_event
from collab_kit.swarm.dht import join_addresses, start_dht
from collab_kit.swarm.watchdog import SwarmWatchdog

STORES = 4  # parallel stores, each on a stream of its own (as an averager's parts are): the link's queue fills faster


async def _table_size(_dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def routing_table_size(dht) -> int:
    return dht.run_coroutine(_table_size)


def report_table(dht, every: float) -> None:
    while not threading.Event().wait(every):
        emit_event("table", neighbours=routing_table_size(dht))


def join(addresses, **dht_kwargs):
    dht = start_dht(SwarmConfig(host="0.0.0.0", client_mode=True, initial_peers=list(addresses)), **dht_kwargs)
    SwarmWatchdog(dht, addresses, on_link_down=lambda: emit_event("link", state="down"),
                  on_link_back=lambda: emit_event("link", state="back"))
    emit_event("ready", neighbours=routing_table_size(dht))
    return dht


async def _read_behind_stores(size: int, _dht, node) -> dict:
    """In the DHT's process (a large value would not pass hivemind's pipe to it): start the stores, read ``note``
    while they are on the link, then read it again, every second, until it is found (the link's queue through)."""
    async def timed_read():
        started = time.monotonic()
        found = await node.get("note", latest=True)
        return found is not None and found.value == "hello", time.monotonic() - started

    stores = [asyncio.create_task(node.store(f"bulk{part}", os.urandom(size // STORES), get_dht_time() + 600))
              for part in range(STORES)]
    await asyncio.sleep(2.0)  # the stores are on the link
    read, read_seconds = await timed_read()
    read_at = time.time()
    await asyncio.gather(*stores)
    deadline = time.monotonic() + 120.0
    read_after, tries = False, 0
    while not read_after and time.monotonic() < deadline:  # hivemind skips a peer that failed for a while (5 s, 10 s..)
        read_after, _ = await timed_read()
        tries += 1
        if not read_after:
            await asyncio.sleep(1.0)
    return dict(read=dict(found=read, seconds=read_seconds, at=read_at),
                read_after=dict(found=read_after, tries=tries, seconds_after_read=time.time() - read_at))


def queue_behind_stores(dht, size: int) -> None:
    outcome = dht.run_coroutine(partial(_read_behind_stores, size))
    emit_event("read", **outcome["read"])
    emit_event("read_after", **outcome["read_after"])


def main(mode: str, arguments):
    # the watchdog's lines (and the neighbours it keeps) in the log, as a volunteer's --debug-logger shows them
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("collab_kit.swarm.watchdog").setLevel(logging.DEBUG)
    if mode == "serve":
        dht = start_dht(SwarmConfig(host="0.0.0.0", client_mode=False))
        dht.store("note", "hello", get_dht_time() + 3600)
        emit_event("ready", addresses=join_addresses(dht))
    elif mode == "watch":
        dht = join(arguments)
        report_table(dht, every=1.0)
    elif mode == "queue":
        timeout, size, addresses = float(arguments[0]), int(arguments[1]), arguments[2:]
        dht = join(addresses, wait_timeout=timeout)
        threading.Thread(target=report_table, args=(dht, 0.5), daemon=True).start()
        queue_behind_stores(dht, size)
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
