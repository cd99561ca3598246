"""A DHT peer for the network lab's link tests, run inside a namespace: ``serve`` starts a DHT that accepts
connections and prints its addresses; ``watch ADDRESS...`` joins through them in client mode, with a SwarmWatchdog
whose link events it prints, and reports every second how many neighbours its routing table holds. Both run until
killed."""

import logging
import sys
import threading

from collab_kit.config import SwarmConfig
from collab_kit.roles.processes import emit_event
from collab_kit.swarm.dht import join_addresses, start_dht
from collab_kit.swarm.watchdog import SwarmWatchdog


async def _table_size(_dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def routing_table_size(dht) -> int:
    return dht.run_coroutine(_table_size)


def main(mode: str, addresses):
    if mode == "serve":
        dht = start_dht(SwarmConfig(host="0.0.0.0", client_mode=False))
        emit_event("ready", addresses=join_addresses(dht))
    else:
        dht = start_dht(SwarmConfig(host="0.0.0.0", client_mode=True, initial_peers=list(addresses)))
        # its thread keeps it alive as long as the process runs
        SwarmWatchdog(
            dht,
            addresses,
            on_link_down=lambda: emit_event("link", state="down"),
            on_link_back=lambda: emit_event("link", state="back"),
        )
        emit_event("ready", neighbours=routing_table_size(dht))
        while not threading.Event().wait(1.0):
            emit_event("table", neighbours=routing_table_size(dht))
    threading.Event().wait()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("collab_kit.swarm.watchdog").setLevel(logging.DEBUG)  # each dial, for a failure to be read
    main(sys.argv[1], sys.argv[2:])
