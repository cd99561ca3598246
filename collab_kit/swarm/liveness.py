"""Which peers answer now: what the monitor's live page shows as a peer's presence, within one poll.

    answering = peers_answering(dht, ["12D3KooW...", ...], timeout=3.0)   # {peer id: True / False}

A peer answers when this peer's libp2p daemon holds a connection to it, or dials it within ``timeout``. A training
peer keeps a connection to the run's first peer (its DHT and its anchor's rounds), and the kernel closes it the moment
the peer's process dies, however it died: so a peer killed with SIGKILL stops answering at the next call, where its
metrics record (five minutes) and hivemind's progress record (a minute) still say it lives.
``tests/roles/test_live_page.py`` shows it with a volunteer killed mid-run.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from functools import partial

import hivemind
from hivemind.p2p import PeerID

from collab_kit.swarm.kept_tasks import kept_until_done

logger = logging.getLogger(__name__)


def peers_answering(dht: hivemind.DHT, peer_ids: Sequence[str], timeout: float) -> dict[str, bool]:
    """Whether each peer (a base58 peer id) is connected to ``dht``'s daemon, or could be dialled within ``timeout``.

    The dials go at the same time, from the daemon's own address book (the addresses the peer announced): nobody's
    address is asked for or handed out. A peer id that is not one counts as not answering.
    """
    if not peer_ids:
        return {}
    # a module-level coroutine: run_coroutine pickles it over to the DHT's process
    return dht.run_coroutine(partial(_answering, list(peer_ids), timeout))


@kept_until_done
async def _answering(peer_ids: list[str], timeout: float, _dht, node) -> dict[str, bool]:
    connected = {info.peer_id.to_base58() for info in await node.p2p.list_peers()}

    async def answers(peer_id: str) -> bool:
        if peer_id in connected:
            return True
        try:
            await asyncio.wait_for(node.p2p._client.connect(PeerID.from_base58(peer_id), []), timeout)
            return True
        except Exception as e:  # refused, unreachable, timed out, or not a peer id
            logger.debug(f"peer {peer_id[-8:]} did not answer: {type(e).__name__}: {e}")
            return False

    answered = await asyncio.gather(*(answers(peer_id) for peer_id in peer_ids))
    return dict(zip(peer_ids, answered))
