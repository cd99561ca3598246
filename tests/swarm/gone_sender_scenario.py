"""A DHT request that cannot be read because its sender is gone, then one more request: run as
``python gone_sender_scenario.py shipped|fixed``, prints one JSON line.

A request carries a future whose pipe end the DHT's process fetches from the sender while reading the request
(multiprocessing's resource sharer); a sender that dies during that fetch's handshake makes the read raise ``EOFError``.
That timing cannot be forced from outside, so the request here is one whose reading raises the same ``EOFError``.
"""

import json
import sys
import time

import hivemind
from hivemind.utils import get_dht_time

from collab_kit.swarm.p2p_fixes import install_p2p_fixes


def _fetch_from_a_gone_sender():
    raise EOFError  # what multiprocessing.connection.answer_challenge raises when the sender's end closes mid-handshake


class RequestFromAGoneSender:
    def __reduce__(self):
        return _fetch_from_a_gone_sender, ()


def main(variant: str) -> dict:
    if variant == "fixed":
        install_p2p_fixes()
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        dht._outer_pipe.send(("_get", [], dict(key=RequestFromAGoneSender())))
        deadline = time.monotonic() + 5
        while dht.is_alive() and time.monotonic() < deadline:  # the DHT's process, once it has read the request
            time.sleep(0.1)
        alive = dht.is_alive()
        answered = False
        if alive:
            stored = dht.store("key", "value", get_dht_time() + 60, return_future=True).result(timeout=30)
            found = dht.get("key", return_future=True).result(timeout=30)
            answered = bool(stored) and found is not None and found.value == "value"
        return dict(dht_alive=alive, next_requests_answered=answered)
    finally:
        if dht.is_alive():
            dht.shutdown()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
