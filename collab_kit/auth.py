"""Who may join a run: a Hugging Face login, a signed access token, and peers that check each other.

    token = collab_kit.login()                      # notebook_login where a widget shows, else $HF_TOKEN
    authorizer = HubAuthorizer("https://auth.example.org", token)
    authorizer.join()                               # PUT /api/experiments/join -> a signed access token
    dht = start_dht(config.swarm, authorizer=authorizer)

The run's authentication server (``collab-kit auth-server``) checks the volunteer's Hugging Face
user token and membership and signs an access token for the peer's RSA key
(collab_kit.access_token). ``HubAuthorizer`` is a hivemind ``TokenAuthorizerBase``: every DHT request
and answer carries the token and is signed with the peer's key, and peers without a valid token
are ignored. The token is refreshed before it expires, without stopping training.

The DHT is not all: gradient and state averaging run over their own libp2p streams. Each peer
publishes a *binding* of its libp2p peer id to its token (``publish_peer_binding``: the peer id
signed with the token's key); libp2p proves a connection's peer id in its handshake, so an averager
that looks up the caller's binding (``PeerGate``) knows whether the caller holds a valid token.
``AuthorizedAveragerMixin`` puts that check in front of joining a group, sending parts for
averaging and downloading the state.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Dict, List, Optional, Tuple

from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from collab_kit.access_token import (MalformedToken, binding_problem, public_key_from_text, public_key_to_text,
                                     seconds_left, sign_peer_binding, token_from_json, token_problem)

logger = logging.getLogger(__name__)

JOIN_PATH = "/api/experiments/join"


class AuthorizationError(RuntimeError):
    """The authentication server refused this volunteer, or could not be reached; the message says what to do."""

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        self.status = status


@dataclass
class JoinAnswer:
    """What the authentication server answers to a volunteer it lets in."""

    username: str
    token: AccessToken
    server_public_key: RSAPublicKey
    coordinator_addresses: List[str] = field(default_factory=list)
    run_id: Optional[str] = None


def request_access(auth_server: str, hf_token: str, peer_public_key: RSAPublicKey, timeout: float = 30.0) -> JoinAnswer:
    """Ask the run's authentication server for an access token for this peer's key.

    :param auth_server: the server's base URL, e.g. ``https://auth.example.org``
    :param hf_token: the volunteer's Hugging Face user token
    :raises AuthorizationError: with the server's own message (401 log in, 403 join the organization, 429 wait)
    """
    import requests

    url = auth_server.rstrip("/") + JOIN_PATH
    try:
        response = requests.put(url, headers={"Authorization": f"Bearer {hf_token}"},
                                json={"peer_public_key": public_key_to_text(peer_public_key)}, timeout=timeout)
    except requests.RequestException as e:
        raise AuthorizationError(f"could not reach the run's authentication server at {url} ({type(e).__name__}): "
                                 f"check the address and your connection") from None
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code != 200:
        detail = body.get("detail") if isinstance(body, dict) else None
        message = detail if isinstance(detail, str) else (response.text[:300] or response.reason)
        raise AuthorizationError(f"the authentication server refused to let this peer in "
                                 f"({response.status_code}): {message}", status=response.status_code)
    try:
        return JoinAnswer(username=str(body["username"]), token=token_from_json(body["access_token"]),
                          server_public_key=public_key_from_text(body["auth_server_public_key"]),
                          coordinator_addresses=[str(a) for a in body.get("coordinator_addresses") or []],
                          run_id=body.get("run_id"))
    except (KeyError, TypeError, MalformedToken) as e:
        raise AuthorizationError(f"the authentication server at {url} answered something that is not an access "
                                 f"token ({e}): is this the right address?") from None


class HubAuthorizer(TokenAuthorizerBase):
    """hivemind's token authorization with tokens from the run's authentication server.

    :param auth_server: the server's base URL
    :param hf_token: the volunteer's Hugging Face user token (see ``login``)
    :param private_key: this peer's RSA key (default: hivemind's process-wide key, the one DHT requests are signed with)
    :param refresh_margin: seconds before expiry at which a new token is fetched
    """

    def __init__(self, auth_server: str, hf_token: str, private_key: Optional[RSAPrivateKey] = None,
                 refresh_margin: float = 300.0, request_timeout: float = 30.0):
        super().__init__(private_key)
        self.auth_server, self.refresh_margin, self.request_timeout = auth_server, refresh_margin, request_timeout
        self._hf_token = hf_token
        self.answer: Optional[JoinAnswer] = None

    @property
    def private_key(self) -> RSAPrivateKey:
        return self._local_private_key

    @property
    def username(self) -> Optional[str]:
        return self.answer.username if self.answer else None

    @property
    def server_public_key(self) -> RSAPublicKey:
        if self.answer is None:
            raise RuntimeError("call HubAuthorizer.join() first: the server's key comes with the first token")
        return self.answer.server_public_key

    @property
    def access_token(self) -> AccessToken:
        if self._local_access_token is None:
            raise RuntimeError("call HubAuthorizer.join() first")
        return self._local_access_token

    def join(self) -> JoinAnswer:
        """Get the first token now (blocking), so that a refusal is an error before anything starts."""
        answer = request_access(self.auth_server, self._hf_token, self.local_public_key, self.request_timeout)
        self._accept(answer)
        logger.info(f"authorized as {answer.username} until {answer.token.expiration_time}")
        return answer

    def _accept(self, answer: JoinAnswer) -> None:
        if self.answer is not None and answer.server_public_key.to_bytes() != self.answer.server_public_key.to_bytes():
            raise AuthorizationError("the authentication server's key changed: it is another run's server, or it "
                                     "lost its key; restart the peer to trust the new key")
        problem = token_problem(answer.token, answer.server_public_key)
        if problem is not None:
            raise AuthorizationError(f"the authentication server gave an unusable token: {problem}")
        if answer.token.public_key != self.local_public_key.to_bytes():
            raise AuthorizationError("the authentication server signed a token for another key")
        self.answer = answer
        self._local_access_token = answer.token
        self._lifetime = seconds_left(answer.token)

    async def get_token(self) -> AccessToken:
        """A fresh token (hivemind calls this when ``does_token_need_refreshing`` says so)."""
        answer = await asyncio.get_running_loop().run_in_executor(
            None, request_access, self.auth_server, self._hf_token, self.local_public_key, self.request_timeout)
        self._accept(answer)
        logger.info(f"access token refreshed, valid until {answer.token.expiration_time}")
        return answer.token

    def is_token_valid(self, access_token: AccessToken) -> bool:
        if self.answer is None:
            return False
        problem = token_problem(access_token, self.answer.server_public_key)
        if problem is not None:
            logger.debug(f"refused a token of {access_token.username!r}: {problem}")
        return problem is None

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        # a quarter of a short token's life is margin enough; long tokens are renewed refresh_margin early
        margin = min(self.refresh_margin, 0.25 * getattr(self, "_lifetime", self.refresh_margin))
        return seconds_left(access_token) < margin


# ---------------------------------------------------------------------------------------------
# peer id -> token bindings, published in the (authorized) DHT and checked by the averagers


def peer_tokens_key(run_id: str) -> str:
    return f"{run_id}_peer_tokens"


def binding_record(authorizer: HubAuthorizer, peer_id: bytes) -> dict:
    """The DHT value that proves ``peer_id`` holds the authorizer's current token: plain bytes, no objects."""
    token = authorizer.access_token
    return dict(token=token.SerializeToString(), binding=sign_peer_binding(authorizer.private_key, token, peer_id))


def publish_peer_binding(dht, authorizer: HubAuthorizer, run_id: str) -> bool:
    """Store this peer's binding under the run's key (subkey: its peer id) until its token expires."""
    from hivemind.utils.timed_storage import get_dht_time

    peer_id = dht.peer_id.to_bytes()
    expiration = get_dht_time() + max(1.0, seconds_left(authorizer.access_token))
    return bool(dht.store(peer_tokens_key(run_id), subkey=peer_id, value=binding_record(authorizer, peer_id),
                          expiration_time=expiration))


def read_binding(value) -> Tuple[AccessToken, bytes]:
    """A binding record from the DHT, schema-checked; :raises MalformedToken: if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("token"), bytes) or \
            not isinstance(value.get("binding"), bytes):
        raise MalformedToken("a peer binding must be {'token': bytes, 'binding': bytes}")
    token = AccessToken()
    try:
        token.ParseFromString(value["token"])
    except Exception:  # protobuf's DecodeError; parsing is schema-driven, nothing is executed
        raise MalformedToken("the binding's token is not an AccessToken") from None
    return token, value["binding"]


def authorized_averager_class(base: type, peer_gate: Optional["PeerGate"] = None) -> type:
    """``base`` (a hivemind averager class) with ``AuthorizedAveragerMixin`` in front, under ``base``'s name.

    :param peer_gate: set as a class attribute, so that averagers hivemind builds and starts at once
      (``start=True``: their process forks inside ``__init__``) carry it into their process
    """
    return type(base.__name__, (AuthorizedAveragerMixin, base),
                {"__module__": __name__, "__qualname__": f"Authorized{base.__name__}", "peer_gate": peer_gate})


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
        self._cache: Dict[bytes, Tuple[bool, float]] = {}

    def check_record(self, peer_id: bytes, value) -> Optional[str]:
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


class AuthorizedAveragerMixin:
    """Put before a hivemind averager class: only peers with a valid binding may join a group with this
    averager, send it parts to average, or download its state. Set ``self.peer_gate`` (a PeerGate) before
    the averager's process starts (``start=False``, then ``run_in_background``).

    hivemind names a handler after the class (``prefix::GradientAverager.rpc_join_group``) and reads the
    message types from the annotations, so a combined class keeps the hivemind class's ``__name__`` (peers
    reach each other's handlers by that name) and these methods keep their annotations.
    """

    peer_gate: Optional[PeerGate] = None

    async def _refuses(self, context: P2PContext) -> bool:
        """True when a gate is set and the caller's peer id is not bound to a valid token."""
        return self.peer_gate is not None and not await self.peer_gate.allows(context.remote_id)

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if await self._refuses(context):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if await self._refuses(context):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if await self._refuses(context):
            return
        async for message in super().rpc_download_state(request, context):
            yield message


# ---------------------------------------------------------------------------------------------
# the volunteer's Hugging Face login


def _in_notebook() -> bool:
    """True in Jupyter, Colab or Kaggle (a kernel that can show widgets), False in a terminal or a script."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ in ("ZMQInteractiveShell", "Shell")  # Shell: Colab's


def login(token: Optional[str] = None) -> Optional[str]:
    """The volunteer's Hugging Face user token: given, ``$HF_TOKEN``, or a saved login.

    In a notebook without any of these, shows ``notebook_login``'s form and returns None: the form is
    filled in after this cell ends, so run the next cell (which calls ``login()`` again) once logged in.

    :raises AuthorizationError: outside a notebook when no token can be found (says where to make one)
    """
    import huggingface_hub

    token = token or os.environ.get("HF_TOKEN") or huggingface_hub.get_token()
    if token:
        return token
    if _in_notebook():
        huggingface_hub.notebook_login()
        print("Log in with your Hugging Face user token in the form above, then run the next cell.")
        return None
    raise AuthorizationError("no Hugging Face token: create a user token at https://huggingface.co/settings/tokens "
                             "and set HF_TOKEN=hf_... (or run `hf auth login`)")


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
        import threading

        self.dht, self.authorizer, self.run_id, self.check_every = dht, authorizer, run_id, check_every
        self.published_token: Optional[AccessToken] = None
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
