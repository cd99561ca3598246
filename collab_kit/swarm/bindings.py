"""Which peers hold a run's token: bindings of peer ids to tokens in the DHT, and the gate the averagers ask.

The DHT's own messages carry tokens (collab_kit.auth.client.HubAuthorizer), but gradient and state averaging run
over their own libp2p streams. Each peer publishes a *binding* of its libp2p peer id to its token
(``publish_peer_binding``: the peer id signed with the token's key, kept fresh by ``BindingKeeper``); libp2p proves a
connection's peer id in its handshake, so an averager that looks up the caller's binding (``PeerGate``) knows whether
the caller holds a valid token. ``AuthorizedAveragerMixin`` puts that check in front of joining a group, sending parts
for averaging and downloading the state.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import typing
from typing import AsyncIterator  # noqa: UP035 (hivemind finds a stream rpc_ handler by typing's hint)

from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPublicKey
from hivemind.utils.timed_storage import get_dht_time

from collab_kit.auth.client import HubAuthorizer
from collab_kit.auth.tokens import MalformedToken, binding_problem, seconds_left, sign_peer_binding
from collab_kit.swarm.averagers import compose_averager
from collab_kit.swarm.keys import peer_tokens_key

logger = logging.getLogger(__name__)


def binding_record(authorizer: HubAuthorizer, peer_id: bytes) -> dict:
    """The DHT value that proves ``peer_id`` holds the authorizer's current token: plain bytes, no objects."""
    token = authorizer.access_token
    return dict(token=token.SerializeToString(), binding=sign_peer_binding(authorizer.private_key, token, peer_id))


def publish_peer_binding(dht, authorizer: HubAuthorizer, run_id: str) -> bool:
    """Store this peer's binding under the run's key (subkey: its peer id) until its token expires."""

    peer_id = dht.peer_id.to_bytes()
    expiration = get_dht_time() + max(1.0, seconds_left(authorizer.access_token))
    return bool(
        dht.store(
            peer_tokens_key(run_id),
            subkey=peer_id,
            value=binding_record(authorizer, peer_id),
            expiration_time=expiration,
        )
    )


def read_binding(value) -> tuple[AccessToken, bytes]:
    """A binding record from the DHT, schema-checked; :raises MalformedToken: if it is not one."""
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("token"), bytes)
        or not isinstance(value.get("binding"), bytes)
    ):
        raise MalformedToken("a peer binding must be {'token': bytes, 'binding': bytes}")
    token = AccessToken()
    try:
        token.ParseFromString(value["token"])
    except Exception:  # protobuf's DecodeError; parsing is schema-driven, nothing is executed
        raise MalformedToken("the binding's token is not an AccessToken") from None
    return token, value["binding"]


def authorized_averager_class(base: type, peer_gate: PeerGate | None = None) -> type:
    """``base`` (a hivemind averager class) with ``AuthorizedAveragerMixin`` in front, under ``base``'s name.

    :param peer_gate: set as a class attribute, so that averagers hivemind builds and starts at once
      (``start=True``: their process forks inside ``__init__``) carry it into their process
    """
    return compose_averager(
        base, AuthorizedAveragerMixin, qualname=f"Authorized{base.__qualname__}", peer_gate=peer_gate
    )


class PeerGate:
    """Answers "does this libp2p peer hold a valid token of the run?" from the bindings in the DHT.

    Answers are cached until the token expires (a yes) or for ``negative_ttl`` seconds (a no, so a
    peer that has just published its binding is let in soon after).

    :param dht: a DHT handle (in an averager's process, its ``self.dht``)
    :param run_id: the run whose bindings to read
    :param server_public_key: the authentication server's key (OpenSSH bytes: the gate travels to subprocesses)
    """

    def __init__(self, dht, run_id: str, server_public_key: bytes, negative_ttl: float = 2.0):
        self.dht, self.run_id, self.negative_ttl = dht, run_id, negative_ttl
        self.server_public_key_bytes = server_public_key
        self._cache: dict[bytes, tuple[bool, float]] = {}

    def check_record(self, peer_id: bytes, value) -> str | None:
        """Why ``value`` does not prove ``peer_id`` holds a valid token, or None when it does."""
        try:
            token, signature = read_binding(value)
        except MalformedToken as e:
            return str(e)
        return binding_problem(token, peer_id, signature, RSAPublicKey.from_bytes(self.server_public_key_bytes))

    async def allows(self, peer_id) -> bool:
        key = peer_id.to_bytes() if hasattr(peer_id, "to_bytes") else bytes(peer_id)
        cached = self._cache.get(key)
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]
        found = await self.dht.get(peer_tokens_key(self.run_id), latest=True, return_future=True)
        value = None
        if found is not None and isinstance(found.value, dict) and key in found.value:
            value = found.value[key].value
        problem = "no binding published" if value is None else self.check_record(key, value)
        if problem is None:
            token, _ = read_binding(value)
            self._cache[key] = (True, time.monotonic() + max(0.0, seconds_left(token)))
            return True
        logger.warning(f"refused peer {peer_id}: {problem}")
        self._cache[key] = (False, time.monotonic() + self.negative_ttl)
        return False


if typing.TYPE_CHECKING:
    from hivemind.averaging import DecentralizedAverager

    _AveragerBase: typing.TypeAlias = DecentralizedAverager  # the type checker's view: what the mixin is put before
else:
    _AveragerBase = object


class AuthorizedAveragerMixin(_AveragerBase):
    """Put before a hivemind averager class: only peers with a valid binding may join a group with this
    averager, send it parts to average, or download its state (whole or in parts). Set ``self.peer_gate`` (a
    PeerGate) before the averager's process starts (``start=False``, then ``run_in_background``).

    hivemind names a handler after the class (``prefix::GradientAverager.rpc_join_group``) and reads the
    message types from the annotations, so a combined class keeps the hivemind class's ``__name__`` (peers
    reach each other's handlers by that name) and these methods keep their annotations.
    """

    peer_gate: PeerGate | None = None

    async def _refuses(self, context: P2PContext) -> bool:
        """True when a gate is set and the caller's peer id is not bound to a valid token."""
        return self.peer_gate is not None and not await self.peer_gate.allows(context.remote_id)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if await self._refuses(context):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if await self._refuses(context):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if await self._refuses(context):
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    async def rpc_download_state_part(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        # a part of the state (collab_kit.swarm.direct_state), from averagers that share their state
        if await self._refuses(context) or not hasattr(super(), "rpc_download_state_part"):
            return
        async for message in super().rpc_download_state_part(request, context):
            yield message


class BindingKeeper:
    """Keeps this peer's binding in the DHT: publishes it now, and again with a fresh token before the old expires.

    The trainer's process holds its own copy of the authorizer (the DHT's process has another, which
    refreshes itself); a background thread refreshes this one and re-publishes.

    :param dht: this peer's DHT
    :param authorizer: a HubAuthorizer that has joined
    :param run_id: the run whose bindings the averagers read
    :param check_every: seconds between checks of the token's age
    """

    def __init__(self, dht, authorizer: HubAuthorizer, run_id: str, check_every: float = 10.0):

        self.dht, self.authorizer, self.run_id, self.check_every = dht, authorizer, run_id, check_every
        self.published_token: AccessToken | None = None
        self._stop = threading.Event()
        self.publish()
        self._thread = threading.Thread(target=self._run, daemon=True, name="collab_kit-binding-keeper")
        self._thread.start()

    def publish(self) -> None:
        if not publish_peer_binding(self.dht, self.authorizer, self.run_id):
            logger.warning("could not store this peer's token binding in the DHT; will retry")
            return
        self.published_token = self.authorizer.access_token

    def _run(self) -> None:
        while not self._stop.wait(self.check_every):
            try:
                token = self.authorizer.access_token
                if self.authorizer.does_token_need_refreshing(token):
                    asyncio.run(self.authorizer.refresh_token_if_needed())
                if self.published_token is None or self.published_token != self.authorizer.access_token:
                    self.publish()
            except Exception as e:  # the server may be briefly away: the current token is still good a while
                logger.warning(f"could not refresh this peer's access token: {e}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
