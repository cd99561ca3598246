"""Who may join a run: a Hugging Face login, a signed access token, and peers that check each other.

    token = collab_kit.login()                      # notebook_login where a widget shows, else $HF_TOKEN
    authorizer = HubAuthorizer("https://auth.example.org", token)
    authorizer.join()                               # PUT /api/experiments/join -> a signed access token
    dht = start_dht(config.swarm, authorizer=authorizer)

The run's authentication server (``collab-kit auth-server``) checks the volunteer's Hugging Face
user token and membership and signs an access token for the peer's RSA key
(collab_kit.auth.tokens). ``HubAuthorizer`` is a hivemind ``TokenAuthorizerBase``: every DHT request
and answer carries the token and is signed with the peer's key, and peers without a valid token
are ignored. The token is refreshed before it expires, without stopping training.

What peers do with their tokens in the swarm (bindings of peer ids to tokens, the averagers' gate) is
collab_kit.swarm.bindings.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field

import huggingface_hub
import requests
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from collab_kit.auth.tokens import (
    MalformedToken,
    public_key_from_text,
    public_key_to_text,
    seconds_left,
    token_from_json,
    token_problem,
)
from collab_kit.errors import CollabKitError

logger = logging.getLogger(__name__)

JOIN_PATH = "/api/experiments/join"


class AuthorizationError(CollabKitError, RuntimeError):
    """The authentication server refused this volunteer, or could not be reached; the message says what to do."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class JoinAnswer:
    """What the authentication server answers to a volunteer it lets in."""

    username: str
    token: AccessToken
    server_public_key: RSAPublicKey
    coordinator_addresses: list[str] = field(default_factory=list)
    run_id: str | None = None


def request_access(auth_server: str, hf_token: str, peer_public_key: RSAPublicKey, timeout: float = 30.0) -> JoinAnswer:
    """Ask the run's authentication server for an access token for this peer's key.

    :param auth_server: the server's base URL, e.g. ``https://auth.example.org``
    :param hf_token: the volunteer's Hugging Face user token
    :raises AuthorizationError: with the server's own message (401 log in, 403 join the organization, 429 wait)
    """

    url = auth_server.rstrip("/") + JOIN_PATH
    try:
        response = requests.put(
            url,
            headers={"Authorization": f"Bearer {hf_token}"},
            json={"peer_public_key": public_key_to_text(peer_public_key)},
            timeout=timeout,
        )
    except requests.RequestException as e:
        raise AuthorizationError(
            f"could not reach the run's authentication server at {url} ({type(e).__name__}): "
            f"check the address and your connection"
        ) from None
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code != 200:
        detail = body.get("detail") if isinstance(body, dict) else None
        message = detail if isinstance(detail, str) else (response.text[:300] or response.reason)
        raise AuthorizationError(
            f"the authentication server refused to let this peer in ({response.status_code}): {message}",
            status=response.status_code,
        )
    try:
        return JoinAnswer(
            username=str(body["username"]),
            token=token_from_json(body["access_token"]),
            server_public_key=public_key_from_text(body["auth_server_public_key"]),
            coordinator_addresses=[str(a) for a in body.get("coordinator_addresses") or []],
            run_id=body.get("run_id"),
        )
    except (KeyError, TypeError, MalformedToken) as e:
        raise AuthorizationError(
            f"the authentication server at {url} answered something that is not an access "
            f"token ({e}): is this the right address?"
        ) from None


class HubAuthorizer(TokenAuthorizerBase):
    """hivemind's token authorization with tokens from the run's authentication server.

    :param auth_server: the server's base URL
    :param hf_token: the volunteer's Hugging Face user token (see ``login``)
    :param private_key: this peer's RSA key (default: hivemind's process-wide key, the one DHT requests are signed with)
    :param refresh_margin: seconds before expiry at which a new token is fetched
    """

    def __init__(
        self,
        auth_server: str,
        hf_token: str,
        private_key: RSAPrivateKey | None = None,
        refresh_margin: float = 300.0,
        request_timeout: float = 30.0,
    ):
        super().__init__(private_key)
        self.auth_server, self.refresh_margin, self.request_timeout = auth_server, refresh_margin, request_timeout
        self._hf_token = hf_token
        self.answer: JoinAnswer | None = None

    @property
    def private_key(self) -> RSAPrivateKey:
        return self._local_private_key

    @property
    def username(self) -> str | None:
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
            raise AuthorizationError(
                "the authentication server's key changed: it is another run's server, or it "
                "lost its key; restart the peer to trust the new key"
            )
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
            None, request_access, self.auth_server, self._hf_token, self.local_public_key, self.request_timeout
        )
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
# the volunteer's Hugging Face login


def in_notebook() -> bool:
    """True in Jupyter, Colab or Kaggle (a kernel that can show widgets), False in a terminal or a script."""
    try:
        # lazy: IPython is there only where a notebook runs
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ in ("ZMQInteractiveShell", "Shell")  # Shell: Colab's


def login(token: str | None = None) -> str | None:
    """The volunteer's Hugging Face user token: given, ``$HF_TOKEN``, or a saved login.

    In a notebook without any of these, shows ``notebook_login``'s form and returns None: the form is
    filled in after this cell ends, so run the next cell (which calls ``login()`` again) once logged in.

    :raises AuthorizationError: outside a notebook when no token can be found (says where to make one)
    """

    token = token or os.environ.get("HF_TOKEN") or huggingface_hub.get_token()
    if token:
        return token
    if in_notebook():
        huggingface_hub.notebook_login()
        print("Log in with your Hugging Face user token in the form above, then run the next cell.")
        return None
    raise AuthorizationError(
        "no Hugging Face token: create a user token at https://huggingface.co/settings/tokens "
        "and set HF_TOKEN=hf_... (or run `hf auth login`)"
    )
