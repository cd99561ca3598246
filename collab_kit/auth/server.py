"""The authentication server of a run (``collab-kit auth-server``): a Hugging Face user token in, an access token out.

The paper's run let only the members of one Hugging Face organization join. A volunteer's peer proves who it is
with the volunteer's Hugging Face *user* access token, once, to this server; the server asks the Hub whose token it
is, checks that this user may take part, and signs an access token (``collab_kit.auth.tokens``) that binds the
user to the peer's RSA key for a while. Peers then check each other's access tokens with the server's public key
alone: the Hugging Face token never leaves the volunteer's machine for anything but this server.

The protocol, one endpoint::

    PUT /api/experiments/join
    Authorization: Bearer hf_...        the volunteer's Hugging Face user access token
    Content-Type: application/json      (or none)
    {"peer_public_key": "<base64 of the peer's RSA public key in OpenSSH bytes: RSAPublicKey.to_bytes()>"}

    200 {"username": "alice",
         "access_token": {...},                       collab_kit.auth.tokens.token_to_json(token)
         "auth_server_public_key": "<base64>",        public_key_to_text(the server's key): what peers verify with
         "coordinator_addresses": ["/ip4/..."],       where to join the swarm
         "run_id": "my_run"}

The server calls the Hub's ``GET /api/whoami-v2`` through ``huggingface_hub.HfApi(endpoint=hub_endpoint).whoami``.
A token is accepted when whoami says ``type == "user"`` (an organization's token says ``"org"``, an OAuth app's
own token ``"app"``) and ``auth.type`` is one of ``accepted_auth_types`` (by default ``"access_token"`` only: the
tokens made at huggingface.co/settings/tokens; an OAuth app acting for a user says ``"app_token_as_user"``), and
when the user is a member of ``organization`` (whoami's ``orgs[].name``) or on the ``allowlist``. Names are
compared exactly, and only names the Hub allows count (ASCII letters, digits, '-', '_' and '.'): compared without
case, look-alikes such as ``kiß-lab`` and ``kiss-lab`` would pass for each other.

Every answer but 200 is ``{"detail": "<what is wrong and what to do>"}``:

    400  the body is not a JSON object with a base64 RSA public key in "peer_public_key" (the message names the
         field and says what is expected)
    401  no Authorization header, not "Bearer <token>", or a token the Hub does not know (log in again)
    403  an organization or app token (use a personal user token), a user who is not a member (join the org), or
         a name from the Hub that is not a Hugging Face name
    405  another method on the endpoint; 404 another path
    408  the request did not arrive whole within ``request_deadline`` seconds of its first byte (the connection
         is closed)
    413  a body over ``max_body_bytes``, refused from its Content-Length (or while it streams) before any parsing
    415  a Content-Type other than JSON
    429  more than ``joins_per_minute`` joins of one user in the last minute (with ``Retry-After``)
    503  the Hub could not be reached or answered with an error of its own (including its own 429), too many
         Hub checks are under way at once, or (from uvicorn, with ``serve``) 256 connections are open: not the
         client's fault, and retrying later helps

With ``serve``, slow and idle clients cannot take the server down: a connection must deliver each whole request
within ``request_deadline`` seconds (408 and closed otherwise), an idle one is closed 5 s after its last answer
(or ``request_deadline`` after it opened, if it never sends anything), and one client address holds at most
``connections_per_client`` connections (more are closed as they open), so that one client cannot use up the 256.

Nothing a client sends makes a 5xx other than these 503s: malformed HTTP is answered by uvicorn (400), anything
that reaches the endpoint is checked before it is used, and the body is checked before the Hub is asked.

State lives in SQLite (``database_path``): every join (username, the peer's public key, issued at, expires at)
and per-user stats (first seen, last seen, joins); the rate limit counts the joins there, so it holds across
restarts. The server's RSA key (``key_path``, by default beside the database) is made once and kept: tokens
issued before a restart still verify after it.

Tokens travel in plain text over HTTP: expose the server through an HTTPS reverse proxy, not directly.

Its settings are collab_kit.auth.server_settings, its ledger collab_kit.auth.ledger, and its guards against
slow clients collab_kit.auth.guards.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import datetime
import json
import logging
import threading
import time
from collections.abc import Callable

import uvicorn
from cryptography.hazmat.primitives import serialization
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from starlette.requests import ClientDisconnect

from collab_kit.auth.guards import guarded_protocol_class
from collab_kit.auth.ledger import JoinLedger
from collab_kit.auth.server_settings import (
    _JSON_TYPES,
    _TOKEN,
    DEFAULT_PORT,
    JOIN_PATH,
    MAX_PEER_KEY_BITS,
    MIN_PEER_KEY_BITS,
    RATE_WINDOW_SECONDS,
    AuthServerSettings,
    is_hub_name,
)
from collab_kit.auth.tokens import (
    MalformedToken,
    issue_token,
    load_or_create_private_key,
    public_key_to_text,
    read_public_key,
    token_to_json,
)

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# the join: checks in the order that costs the least first


class Refusal(Exception):
    """A join refused: the HTTP status and the one-line reason sent to the client."""

    def __init__(self, status: int, detail: str, headers: dict | None = None):
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers or {}


class AuthServer:
    """The run's signing key, its ledger and the checks of a join; ``create_app`` serves it over HTTP.

    :param settings: what the server accepts and where it keeps its state
    """

    def __init__(self, settings: AuthServerSettings):

        self.settings = settings
        try:
            self.private_key = load_or_create_private_key(settings.key_path)
        except OSError as e:
            raise ValueError(
                f"cannot read or write the server's key {settings.key_path} ({e.strerror or e}): give "
                f"--key a path this user can write"
            ) from None
        self.public_key_text = public_key_to_text(self.private_key.get_public_key())
        self.ledger = JoinLedger(settings.database_path)
        self.hub = HfApi(endpoint=settings.hub_endpoint)
        # whoami blocks (huggingface_hub's HTTP client has no timeout): it runs in these threads, and a join waits
        # for it at most hub_timeout; a Hub that hangs keeps at most max_workers threads busy
        self._hub_threads = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="auth-whoami")
        self._pending_hub_checks = 0  # touched only on the event loop's thread
        self._admit_lock = threading.Lock()  # the rate check and the record of a join happen as one
        self._allowlist = set(settings.allowlist)
        self._tokens_url = f"{settings.hub_endpoint}/settings/tokens"
        logger.info(
            f"auth server key {settings.key_path}, database {settings.database_path}, Hub {settings.hub_endpoint}"
        )

    def close(self):
        self._hub_threads.shutdown(wait=False, cancel_futures=True)
        self.ledger.close()

    # the steps of a join, each raising Refusal

    def read_token(self, authorization: str | None) -> str:
        login = (
            f"create a user access token at {self._tokens_url} (a 'read' token is enough) and log in with it "
            f"(huggingface_hub.notebook_login() or `hf auth login`)"
        )
        if authorization is None:
            raise Refusal(
                401,
                f"no Authorization header: send your Hugging Face token as 'Authorization: Bearer hf_...'; {login}",
                {"WWW-Authenticate": "Bearer"},
            )
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Refusal(
                401,
                f"the Authorization header must be 'Bearer <your Hugging Face token>'; {login}",
                {"WWW-Authenticate": "Bearer"},
            )
        if not _TOKEN.match(token):
            raise Refusal(
                401,
                f"the bearer token is not a Hugging Face token (printable ASCII without spaces); {login}",
                {"WWW-Authenticate": "Bearer"},
            )
        return token

    def read_body(self, content_type: str | None, body: bytes) -> bytes:
        """The peer's public key (OpenSSH bytes) from the request's body."""
        media_type = (content_type or "").split(";")[0].strip().lower()
        if media_type not in _JSON_TYPES and not media_type.endswith("+json"):
            raise Refusal(415, f"the body must be JSON (Content-Type: application/json), not {media_type[:100]!r}")
        expected = (
            'expected a JSON object {"peer_public_key": "<base64 of your peer\'s RSA public key in '
            'OpenSSH format: RSAPublicKey.to_bytes()>"}'
        )
        if not body.strip():
            raise Refusal(400, f"the body is empty: {expected}")
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise Refusal(400, f"the body is not valid JSON: {expected}") from None
        if not isinstance(data, dict):
            raise Refusal(400, f"the body is a JSON {_json_type(data)}: {expected}")
        if "peer_public_key" not in data:
            raise Refusal(400, f"the body has no 'peer_public_key' field: {expected}")
        text = data["peer_public_key"]
        if not isinstance(text, str):
            raise Refusal(
                400,
                f"'peer_public_key' is a JSON {_json_type(text)}, expected a base64 string of your "
                f"peer's RSA public key in OpenSSH format",
            )
        try:
            key_bytes = base64.b64decode(text.encode("ascii"), validate=True)
        except (UnicodeEncodeError, binascii.Error, ValueError):
            raise Refusal(
                400,
                "'peer_public_key' is not valid base64: expected the base64 of your peer's RSA "
                "public key in OpenSSH format (RSAPublicKey.to_bytes())",
            ) from None
        try:
            read_public_key(key_bytes)
            bits = _rsa_key_bits(key_bytes)
        except MalformedToken as e:
            raise Refusal(400, f"'peer_public_key' is {e}: expected the base64 of RSAPublicKey.to_bytes()") from None
        if not MIN_PEER_KEY_BITS <= bits <= MAX_PEER_KEY_BITS:
            raise Refusal(
                400,
                f"'peer_public_key' is an RSA key of {bits} bits: expected {MIN_PEER_KEY_BITS} to "
                f"{MAX_PEER_KEY_BITS} bits (hivemind's RSAPrivateKey() makes 2048)",
            )
        return key_bytes

    def whoami(self, token: str) -> dict:
        """The Hub's whoami-v2 of ``token``; blocking. :raises Refusal: 401 for an unknown token, 503 for a Hub that
        cannot answer."""

        try:
            answer = self.hub.whoami(token=token)
        except HfHubHTTPError as e:
            status = e.response.status_code if e.response is not None else None
            if status in (401, 403):
                raise Refusal(
                    401,
                    f"the Hub does not accept this Hugging Face token (invalid, expired or revoked): "
                    f"create a user access token at {self._tokens_url} and log in with it",
                    {"WWW-Authenticate": "Bearer"},
                ) from None
            logger.warning(f"the Hub answered whoami with {status}: {e}")
            raise Refusal(
                503,
                f"the Hugging Face Hub answered {status} when asked whose token this is; try again in a minute",
                {"Retry-After": "60"},
            ) from None
        except OfflineModeIsEnabled:
            logger.error("HF_HUB_OFFLINE is set: the auth server cannot ask the Hub; unset it and restart")
            raise Refusal(
                503,
                "the authentication server cannot reach the Hugging Face Hub (it runs offline); "
                "tell the run's organisers",
            ) from None
        except Exception as e:  # connection refused, DNS, TLS, a reset, an answer that is not JSON: the Hub's side
            logger.warning(
                f"could not ask the Hub at {self.settings.hub_endpoint} whose token this is: {type(e).__name__}: {e}"
            )
            raise Refusal(
                503,
                "the authentication server could not reach the Hugging Face Hub; try again in a minute",
                {"Retry-After": "60"},
            ) from None
        if not isinstance(answer, dict) or not isinstance(answer.get("name"), str) or not answer["name"]:
            logger.warning(f"the Hub's whoami answer has no name: {ascii(answer)[:200]}")
            raise Refusal(503, "the Hugging Face Hub gave an unexpected answer about this token; try again later")
        if not is_hub_name(answer["name"]):
            # not a name the Hub gives: a stand-in or a tampered answer; nothing of it is recorded or signed
            logger.warning(
                f"the Hub's whoami answer names the user {ascii(answer['name'])[:120]}, which is not a "
                f"Hugging Face name: refused"
            )
            raise Refusal(
                403,
                f"the Hub names this token's user {ascii(answer['name'])[:120]}, which is not a "
                f"Hugging Face user name (letters, digits, '-', '_' and '.'): this server does not "
                f"admit it; tell the run's organisers",
            )
        return answer

    def check_member(self, whoami: dict) -> str:
        """The username of a user token whose owner may join; :raises Refusal: 403 otherwise."""
        name, kind = whoami["name"], whoami.get("type")
        auth = whoami.get("auth") if isinstance(whoami.get("auth"), dict) else {}
        auth_type = auth.get("type")
        personal = (
            f"use your personal user access token: create one at {self._tokens_url} (a 'read' token is "
            f"enough) and log in with it"
        )
        if kind == "org":
            raise Refusal(403, f"this is a token of the organization {name!r}, not of a user: {personal}")
        if kind != "user":
            raise Refusal(403, f"this is a token of the {kind or 'unknown'} {name!r}, not of a user: {personal}")
        if auth_type not in self.settings.accepted_auth_types:
            # an app's token acting for the user, which is also what a browser login (OAuth) gives
            raise Refusal(
                403,
                f"this token ({auth_type or 'of an unknown kind'}) was given to an app or by a "
                f"browser login; {personal} (`hf auth login --token hf_...`, or paste it into "
                f"notebook_login())",
            )
        if name in self._allowlist:
            return name
        organization = self.settings.organization
        orgs = whoami.get("orgs") if isinstance(whoami.get("orgs"), list) else []
        # exactly, and only names the Hub allows: compared without case (casefold), look-alikes such as 'kiß' and
        # 'kiss', or a Kelvin sign and 'K', would pass for each other
        org_names = {
            org.get("name")
            for org in orgs
            if isinstance(org, dict) and isinstance(org.get("name"), str) and is_hub_name(org.get("name"))
        }
        if organization is not None and organization in org_names:
            return name
        if organization is not None and organization.lower() in {org.lower() for org in org_names}:
            logger.warning(
                f"{name} is a member of an organization whose name differs from --organization "
                f"{organization} in case only: names are compared exactly; give the name as the Hub "
                f"writes it"
            )
        if organization is None:
            raise Refusal(403, f"{name} is not on this run's list of participants: ask the run's organisers to add you")
        raise Refusal(
            403,
            f"{name} is not a member of the Hugging Face organization {organization}, whose members "
            f"train this run: join {self.settings.hub_endpoint}/{organization} (ask its admins "
            f"for an invite) and try again",
        )

    def admit(self, username: str, peer_public_key: bytes, now: float | None = None) -> dict:
        """Check the rate, sign and record the join; the 200 answer. :raises Refusal: 429 past the rate."""
        with self._admit_lock:
            now = time.time() if now is None else now
            recent = self.ledger.joins_since(username, now - RATE_WINDOW_SECONDS)
            limit = self.settings.joins_per_minute
            if len(recent) >= limit:
                wait = max(1, int(recent[len(recent) - limit] + RATE_WINDOW_SECONDS - now) + 1)
                raise Refusal(
                    429,
                    f"{username} joined {len(recent)} times in the last minute, the most this run "
                    f"allows is {limit}: try again in {wait} s (a token lasts "
                    f"{_minutes(self.settings.token_lifetime)}; keep it rather than join again)",
                    {"Retry-After": str(wait)},
                )
            moment = datetime.datetime.fromtimestamp(now, datetime.timezone.utc)
            token = issue_token(self.private_key, username, peer_public_key, self.settings.token_lifetime, now=moment)
            self.ledger.record_join(username, peer_public_key, now, token.expiration_time)
        logger.info(f"{username} joined run {self.settings.run_id} (token until {token.expiration_time})")
        return {
            "username": username,
            "access_token": token_to_json(token),
            "auth_server_public_key": self.public_key_text,
            "coordinator_addresses": list(self.settings.coordinator_addresses),
            "run_id": self.settings.run_id,
        }

    async def join(self, authorization: str | None, content_type: str | None, body: bytes) -> dict:
        """All the checks of one join, in order; the 200 answer. :raises Refusal: for any other answer."""
        token = self.read_token(authorization)
        peer_public_key = self.read_body(content_type, body)  # a malformed body never costs a Hub call
        if self._pending_hub_checks >= self.settings.max_pending_hub_checks:
            raise Refusal(
                503, "too many joins are being checked right now: try again in a few seconds", {"Retry-After": "5"}
            )
        self._pending_hub_checks += 1
        try:
            future = asyncio.wrap_future(self._hub_threads.submit(self.whoami, token))
            try:
                whoami = await asyncio.wait_for(future, self.settings.hub_timeout)
            except asyncio.TimeoutError:
                logger.warning(
                    f"the Hub at {self.settings.hub_endpoint} did not answer whoami within "
                    f"{self.settings.hub_timeout} s"
                )
                raise Refusal(
                    503, "the Hugging Face Hub did not answer in time; try again in a minute", {"Retry-After": "60"}
                ) from None
        finally:
            self._pending_hub_checks -= 1
        username = self.check_member(whoami)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.admit, username, peer_public_key)


def _json_type(value) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _rsa_key_bits(key_bytes: bytes) -> int:

    return serialization.load_ssh_public_key(key_bytes).key_size  # read_public_key has checked it is RSA


def _minutes(delta: datetime.timedelta) -> str:
    minutes = delta.total_seconds() / 60
    return f"{minutes:g} minutes" if minutes != 1 else "1 minute"


# ---------------------------------------------------------------------------------------------
# HTTP


async def _read_limited(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) past ``limit`` bytes: from its Content-Length before reading, else as it
    streams in. uvicorn drains what is left of a refused body, so the client reads the 413."""
    too_large = Refusal(
        413,
        f'the request body is over {limit} bytes; a join\'s body is about 500 bytes: {{"peer_public_key": "<base64>"}}',
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:  # nobody is left to answer, but say so rather than log a traceback
        raise Refusal(400, "the client went away before sending its whole body") from None
    return bytes(body)


def create_app(settings: AuthServerSettings) -> FastAPI:
    """The FastAPI application of the run's authentication server (see the module's docstring for the protocol).

    :param settings: what the server accepts and where it keeps its state; the key and the database are opened
      here, so a bad path fails now, not at the first join. ``app.state.auth_server`` is the :class:`AuthServer`
      (its ``ledger``, its ``private_key``)
    """
    auth = AuthServer(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        auth.close()

    # no /docs or /openapi.json: the one endpoint is described in this module, and less to serve is less to attack
    app = FastAPI(title="collab_kit auth server", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.auth_server = auth

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        # FastAPI would answer 422 with pydantic's report; a client's mistake here is a 400 with one sentence
        problems = "; ".join(
            f"{'.'.join(str(part) for part in e.get('loc', ()))}: {e.get('msg')}" for e in error.errors()[:3]
        )
        return JSONResponse({"detail": f"malformed request ({problems})"}, status_code=400)

    @app.put(JOIN_PATH)
    async def join(request: Request):
        try:
            body = await _read_limited(request, settings.max_body_bytes)
            answer = await auth.join(request.headers.get("authorization"), request.headers.get("content-type"), body)
        except Refusal as refusal:
            if refusal.status >= 500:
                logger.warning(f"join answered {refusal.status}: {refusal.detail}")
            else:
                logger.debug(f"join refused ({refusal.status}): {refusal.detail}")
            return JSONResponse({"detail": refusal.detail}, status_code=refusal.status, headers=refusal.headers)
        return JSONResponse(answer)

    return app


def listening_line(settings: AuthServerSettings, host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"auth server for run {settings.run_id} ({settings.who_may_join}) listening on http://{shown}:{port}"


def serve(
    settings: AuthServerSettings,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    on_listening: Callable[[str], None] | None = None,
) -> None:
    """Run the authentication server until interrupted (Ctrl-C, SIGTERM); blocks.

    :param settings: what the server accepts and where it keeps its state
    :param host: the address to listen on; 127.0.0.1 (the default) for a server behind an HTTPS reverse proxy on
      this machine, 0.0.0.0 to be reached directly (tokens then travel unencrypted)
    :param port: the port to listen on; 0 for any free one (the listening line says which)
    :param on_listening: called with the listening line once the socket is bound (by default it is printed)
    """
    app = create_app(settings)
    if on_listening is None:

        def on_listening(line: str):
            print(line, flush=True)

    # a short keep-alive: volunteers join once an hour, idle connections only hold a slot
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_keep_alive=5,
        limit_concurrency=256,
        server_header=False,
        http=guarded_protocol_class(settings.request_deadline, settings.connections_per_client),
    )

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:  # the port bound, which port 0 leaves to the system
                on_listening(listening_line(settings, host, self.servers[0].sockets[0].getsockname()[1]))

    server = Server(config)
    server.run()
    if not server.started:  # uvicorn logs why (the port is taken, ...) and returns
        raise ValueError(
            f"the auth server could not listen on {host}:{port} (see the error above): pick another --port or --host"
        )
