"""Where a run's anchors can be dialled: each anchor's join addresses, signed, in the DHT.

The monitor that runs an anchor publishes its addresses at every poll (``publish_anchor``); the monitor reads every
anchor's for the join line and the dashboard, and volunteers behind NAT read them to serve their state to each anchor.
"""

from __future__ import annotations

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.utils import get_dht_time
from pydantic.v1 import BaseModel, conlist, constr

from collab_kit.swarm.keys import anchors_key


class AnchorsSchema(BaseModel):
    """The DHT key ``<run_id>_anchors``: each anchor's join addresses, under its public key (signed)."""

    # mypy reads pydantic's conlist/constr as calls, not the types they build
    anchors: dict[BytesWithPublicKey, conlist(constr(max_length=512), max_items=16) | None]  # type: ignore[valid-type]


def anchor_validators(run_id: str) -> list:
    """The validators a DHT needs to write or read ``run_id``'s anchor addresses (with an RSASignatureValidator)."""
    return [SchemaValidator(AnchorsSchema, prefix=run_id)]


def publish_anchor(dht: hivemind.DHT, run_id: str, addresses: list[str], ttl: float = 60.0) -> None:
    """Tell the run where this anchor can be dialled, for ``ttl`` seconds (the monitor that runs it, at every poll)."""
    subkey = RSASignatureValidator().local_public_key  # the process's key, which the DHT signs records with
    dht.store(anchors_key(run_id), subkey=subkey, value=list(addresses), expiration_time=get_dht_time() + ttl)


def read_anchor_addresses(dht: hivemind.DHT, run_id: str) -> list[list[str]]:
    """The join addresses of each live anchor of ``run_id``, this peer's own included."""
    found = dht.get(anchors_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    return [list(entry.value) for entry in found.value.values() if entry.value]
