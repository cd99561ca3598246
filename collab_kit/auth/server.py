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
import os
import re
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from collab_kit.auth.tokens import (DEFAULT_TOKEN_LIFETIME, MalformedToken, issue_token, load_or_create_private_key,
                                    public_key_to_text, read_public_key, token_to_json)
from collab_kit.addresses import parse_initial_peers

logger = logging.getLogger(__name__)

JOIN_PATH = "/api/experiments/join"
DEFAULT_PORT = 8555
DEFAULT_DATABASE = "auth_server.sqlite3"
RATE_WINDOW_SECONDS = 60.0
# a peer key is hivemind's RSAPrivateKey (2048 bits); far smaller keys are forgeable, far larger ones only slow
# every peer that verifies them
MIN_PEER_KEY_BITS, MAX_PEER_KEY_BITS = 2048, 8192
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*", re.ASCII)  # a Hugging Face user or organization name
_TOKEN = re.compile(r"^[\x21-\x7e]{1,1024}$")  # printable ASCII without spaces: what can travel in a header
_JSON_TYPES = ("", "application/json")


def _default_hub_endpoint() -> str:
    # read when the settings are made, not when this module is imported: huggingface_hub reads HF_ENDPOINT once, at
    # its own import, and the endpoint must also be settable without it
    from huggingface_hub import constants

    return constants.ENDPOINT


@dataclass
class AuthServerSettings:
    """What one run's authentication server accepts and where it keeps its state.

    :param organization: the Hugging Face organization whose members may join (its name, e.g. ``my-org``)
    :param allowlist: usernames that may join without being members
    :param run_id: the run's id, sent to peers (``SwarmConfig.run_id``)
    :param database_path: the SQLite file of joins and per-user stats (created if missing)
    :param key_path: the server's RSA private key (DER), made the first time; by default beside the database
    :param token_lifetime: how long an access token is valid; peers come back for a new one before it expires
    :param joins_per_minute: joins one user may make in any minute; more are answered 429
    :param coordinator_addresses: multiaddrs of the run's first peers, sent to peers to join through
    :param hub_endpoint: the Hub that says whose a token is; by default huggingface_hub's (``HF_ENDPOINT``)
    :param hub_timeout: seconds to wait for the Hub's whoami before answering 503
    :param max_body_bytes: a larger request body is refused (413) before it is parsed
    :param accepted_auth_types: whoami's ``auth.type`` values accepted (``access_token``: the tokens made at
      huggingface.co/settings/tokens). A token from an OAuth app acting for a user (``app_token_as_user``;
      huggingface_hub's browser login is such an app) is refused unless added here
    :param max_pending_hub_checks: Hub checks under way at once; past it a join is answered 503 at once
    :param request_deadline: seconds a connection has to deliver a whole request (headers and body) from its first
      byte; a client that sends part of a request and stalls is answered 408 and closed then, so that slow or
      stalled clients cannot hold every connection
    :param connections_per_client: connections one client address may hold open at once; more are closed as they
      open (0: no cap). Behind a reverse proxy every connection comes from the proxy's address: there the proxy caps
      per client, and this cap bounds what the proxy may hold
    """

    organization: Optional[str] = None
    allowlist: Sequence[str] = ()
    run_id: str = "collab_kit"
    database_path: str = DEFAULT_DATABASE
    key_path: Optional[str] = None
    token_lifetime: datetime.timedelta = DEFAULT_TOKEN_LIFETIME
    joins_per_minute: int = 10
    coordinator_addresses: Sequence[str] = ()
    hub_endpoint: str = field(default_factory=_default_hub_endpoint)
    hub_timeout: float = 10.0
    max_body_bytes: int = 64 * 1024
    accepted_auth_types: Sequence[str] = ("access_token",)
    max_pending_hub_checks: int = 32
    request_deadline: float = 10.0
    connections_per_client: int = 32

    def __post_init__(self):
        if isinstance(self.allowlist, str):  # one name, not its letters
            self.allowlist = (self.allowlist,)
        self.allowlist = tuple(self.allowlist)
        if self.organization is not None:
            _check_name("organization", self.organization)
        for name in self.allowlist:
            _check_name("allowlist", name)
        if self.organization is None and not self.allowlist:
            raise ValueError("nobody could join this run: give the organization whose members may join "
                             "(--organization ORG) and/or the users who may (--allow USER)")
        if not (isinstance(self.run_id, str) and self.run_id.replace("_", "").replace("-", "").isalnum()):
            raise ValueError(f"run_id={self.run_id!r} is not allowed: use letters, digits, '_' and '-' only "
                             f"(the run id the peers use)")
        if not isinstance(self.database_path, str) or not self.database_path.strip():
            raise ValueError(f"database_path={self.database_path!r} is not allowed: expected a file path")
        if self.key_path is None:
            stem = os.path.splitext(os.path.abspath(self.database_path))[0]
            self.key_path = f"{stem}_key.der"
        if not isinstance(self.token_lifetime, datetime.timedelta) or self.token_lifetime.total_seconds() <= 0:
            raise ValueError(f"token_lifetime={self.token_lifetime!r} is not allowed: expected a positive "
                             f"datetime.timedelta (e.g. one hour)")
        if not _positive_int(self.joins_per_minute):
            raise ValueError(f"joins_per_minute={self.joins_per_minute!r} is not allowed: expected a positive "
                             f"integer (a peer joins once per token lifetime; allow a few restarts)")
        if isinstance(self.coordinator_addresses, str):
            self.coordinator_addresses = (self.coordinator_addresses,)

        try:
            self.coordinator_addresses = tuple(parse_initial_peers(list(self.coordinator_addresses)))
        except ValueError as e:
            raise ValueError(f"coordinator_addresses: {e}") from None
        if not (isinstance(self.hub_endpoint, str) and re.match(r"^https?://[^/\s]+", self.hub_endpoint)):
            raise ValueError(f"hub_endpoint={self.hub_endpoint!r} is not allowed: expected the Hub's URL, "
                             f"e.g. https://huggingface.co")
        self.hub_endpoint = self.hub_endpoint.rstrip("/")
        if not (isinstance(self.hub_timeout, (int, float)) and not isinstance(self.hub_timeout, bool)
                and self.hub_timeout > 0):
            raise ValueError(f"hub_timeout={self.hub_timeout!r} is not allowed: expected positive seconds")
        if not (isinstance(self.request_deadline, (int, float)) and not isinstance(self.request_deadline, bool)
                and 0 < self.request_deadline < float("inf")):
            raise ValueError(f"request_deadline={self.request_deadline!r} is not allowed: expected positive seconds "
                             f"(a join's request is under a kilobyte: a few seconds are plenty)")
        if not (isinstance(self.connections_per_client, int) and not isinstance(self.connections_per_client, bool)
                and self.connections_per_client >= 0):
            raise ValueError(f"connections_per_client={self.connections_per_client!r} is not allowed: expected a "
                             f"count (0: no cap)")
        if not _positive_int(self.max_body_bytes) or self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes={self.max_body_bytes!r} is not allowed: expected at least 1024 "
                             f"(a join's body is about 500 bytes)")
        self.accepted_auth_types = tuple(self.accepted_auth_types)
        if not self.accepted_auth_types:
            raise ValueError("accepted_auth_types is empty: no token could join; the Hub's user access tokens "
                             "are 'access_token'")
        if not _positive_int(self.max_pending_hub_checks):
            raise ValueError(f"max_pending_hub_checks={self.max_pending_hub_checks!r} is not allowed: expected a "
                             f"positive integer")

    @property
    def who_may_join(self) -> str:
        """In words, for the listening line: ``organization ORG``, ``organization ORG + 2 allowed``, ..."""
        parts = [f"organization {self.organization}"] if self.organization else []
        if self.allowlist:
            parts.append(f"{len(self.allowlist)} allowed user{'s' if len(self.allowlist) > 1 else ''}")
        return " + ".join(parts)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def is_hub_name(name) -> bool:
    """Whether ``name`` is what the Hub allows for a user or an organization: ASCII letters, digits, '-', '_' and
    '.', starting with a letter or digit, at most 96 characters."""
    return isinstance(name, str) and len(name) <= 96 and _NAME.fullmatch(name) is not None


def _check_name(what: str, name) -> None:
    if not is_hub_name(name):
        hint = ""
        if isinstance(name, str) and "/" in name:
            hint = f" (give the name alone: {name.rstrip('/').rsplit('/', 1)[-1]!r}, not a URL)"
        raise ValueError(f"{what}: {name!r} is not a Hugging Face user or organization name{hint}; names are "
                         f"letters, digits, '-', '_' and '.'")


# ---------------------------------------------------------------------------------------------
# the ledger: joins and per-user stats in SQLite


@dataclass
class UserStats:
    """One user's record: when first and last seen (Unix seconds, UTC) and how many joins."""

    username: str
    first_seen: float
    last_seen: float
    joins: int


class JoinLedger:
    """Every join and per-user stats in a SQLite file; safe to use from several threads.

    :param path: the database file, created (with its folder) if missing
    """

    SCHEMA_VERSION = 1

    def __init__(self, path: str):
        self.path = path
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
            # one connection shared under a lock: the server's threads take turns, each write is one transaction
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA busy_timeout = 5000")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > self.SCHEMA_VERSION:
                raise ValueError(f"{path} was written by a newer collab_kit (schema {version}): upgrade collab_kit "
                                 f"or give another --db")
            self._db.executescript("""
                CREATE TABLE IF NOT EXISTS joins (
                    id INTEGER PRIMARY KEY,
                    username TEXT NOT NULL,
                    peer_public_key TEXT NOT NULL,  -- base64 of the OpenSSH bytes, as the peer sent it
                    issued_at REAL NOT NULL,        -- Unix seconds
                    expires_at TEXT NOT NULL        -- the token's expiration_time (ISO 8601, UTC)
                );
                CREATE INDEX IF NOT EXISTS joins_by_user ON joins (username, issued_at);
                CREATE TABLE IF NOT EXISTS users (
                    username TEXT PRIMARY KEY,
                    first_seen REAL NOT NULL,
                    last_seen REAL NOT NULL,
                    joins INTEGER NOT NULL
                );
            """)
            self._db.execute(f"PRAGMA user_version = {self.SCHEMA_VERSION}")
        except sqlite3.Error as e:
            raise ValueError(f"cannot use {path} as the auth server's database ({e}): give --db a writable "
                             f"file path") from None
        self._lock = threading.Lock()

    def joins_since(self, username: str, since: float) -> List[float]:
        """When ``username`` joined at or after ``since`` (Unix seconds), oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT issued_at FROM joins WHERE username = ? AND issued_at >= ? "
                                    "ORDER BY issued_at", (username, since)).fetchall()
        return [row[0] for row in rows]

    def record_join(self, username: str, peer_public_key: bytes, issued_at: float, expires_at: str) -> None:
        with self._lock:
            with self._transaction():
                self._db.execute("INSERT INTO joins (username, peer_public_key, issued_at, expires_at) "
                                 "VALUES (?, ?, ?, ?)",
                                 (username, base64.b64encode(peer_public_key).decode(), issued_at, expires_at))
                self._db.execute("INSERT INTO users (username, first_seen, last_seen, joins) VALUES (?, ?, ?, 1) "
                                 "ON CONFLICT (username) DO UPDATE SET last_seen = excluded.last_seen, "
                                 "joins = joins + 1", (username, issued_at, issued_at))

    def user_stats(self, username: str) -> Optional[UserStats]:
        with self._lock:
            row = self._db.execute("SELECT username, first_seen, last_seen, joins FROM users WHERE username = ?",
                                   (username,)).fetchone()
        return UserStats(*row) if row else None

    def all_users(self) -> List[UserStats]:
        """Every user who joined, the most joins first."""
        with self._lock:
            rows = self._db.execute("SELECT username, first_seen, last_seen, joins FROM users "
                                    "ORDER BY joins DESC, username").fetchall()
        return [UserStats(*row) for row in rows]

    def count_joins(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM joins").fetchone()[0]

    @contextlib.contextmanager
    def _transaction(self):
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def close(self):
        with self._lock:
            self._db.close()


# ---------------------------------------------------------------------------------------------
# the join: checks in the order that costs the least first


class Refusal(Exception):
    """A join refused: the HTTP status and the one-line reason sent to the client."""

    def __init__(self, status: int, detail: str, headers: Optional[dict] = None):
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers or {}


class AuthServer:
    """The run's signing key, its ledger and the checks of a join; ``create_app`` serves it over HTTP.

    :param settings: what the server accepts and where it keeps its state
    """

    def __init__(self, settings: AuthServerSettings):
        from huggingface_hub import HfApi

        self.settings = settings
        try:
            self.private_key = load_or_create_private_key(settings.key_path)
        except OSError as e:
            raise ValueError(f"cannot read or write the server's key {settings.key_path} ({e.strerror or e}): give "
                             f"--key a path this user can write") from None
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
        logger.info(f"auth server key {settings.key_path}, database {settings.database_path}, "
                    f"Hub {settings.hub_endpoint}")

    def close(self):
        self._hub_threads.shutdown(wait=False, cancel_futures=True)
        self.ledger.close()

    # the steps of a join, each raising Refusal

    def read_token(self, authorization: Optional[str]) -> str:
        login = (f"create a user access token at {self._tokens_url} (a 'read' token is enough) and log in with it "
                 f"(huggingface_hub.notebook_login() or `hf auth login`)")
        if authorization is None:
            raise Refusal(401, f"no Authorization header: send your Hugging Face token as "
                               f"'Authorization: Bearer hf_...'; {login}", {"WWW-Authenticate": "Bearer"})
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Refusal(401, f"the Authorization header must be 'Bearer <your Hugging Face token>'; {login}",
                          {"WWW-Authenticate": "Bearer"})
        if not _TOKEN.match(token):
            raise Refusal(401, f"the bearer token is not a Hugging Face token (printable ASCII without spaces); "
                               f"{login}", {"WWW-Authenticate": "Bearer"})
        return token

    def read_body(self, content_type: Optional[str], body: bytes) -> bytes:
        """The peer's public key (OpenSSH bytes) from the request's body."""
        media_type = (content_type or "").split(";")[0].strip().lower()
        if media_type not in _JSON_TYPES and not media_type.endswith("+json"):
            raise Refusal(415, f"the body must be JSON (Content-Type: application/json), not {media_type[:100]!r}")
        expected = ('expected a JSON object {"peer_public_key": "<base64 of your peer\'s RSA public key in '
                    'OpenSSH format: RSAPublicKey.to_bytes()>"}')
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
            raise Refusal(400, f"'peer_public_key' is a JSON {_json_type(text)}, expected a base64 string of your "
                               f"peer's RSA public key in OpenSSH format")
        try:
            key_bytes = base64.b64decode(text.encode("ascii"), validate=True)
        except (UnicodeEncodeError, binascii.Error, ValueError):
            raise Refusal(400, "'peer_public_key' is not valid base64: expected the base64 of your peer's RSA "
                               "public key in OpenSSH format (RSAPublicKey.to_bytes())") from None
        try:
            read_public_key(key_bytes)
            bits = _rsa_key_bits(key_bytes)
        except MalformedToken as e:
            raise Refusal(400, f"'peer_public_key' is {e}: expected the base64 of RSAPublicKey.to_bytes()") from None
        if not MIN_PEER_KEY_BITS <= bits <= MAX_PEER_KEY_BITS:
            raise Refusal(400, f"'peer_public_key' is an RSA key of {bits} bits: expected {MIN_PEER_KEY_BITS} to "
                               f"{MAX_PEER_KEY_BITS} bits (hivemind's RSAPrivateKey() makes 2048)")
        return key_bytes

    def whoami(self, token: str) -> dict:
        """The Hub's whoami-v2 of ``token``; blocking. :raises Refusal: 401 for an unknown token, 503 for a Hub that
        cannot answer."""
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

        try:
            answer = self.hub.whoami(token=token)
        except HfHubHTTPError as e:
            status = e.response.status_code if e.response is not None else None
            if status in (401, 403):
                raise Refusal(401, f"the Hub does not accept this Hugging Face token (invalid, expired or revoked): "
                                   f"create a user access token at {self._tokens_url} and log in with it",
                              {"WWW-Authenticate": "Bearer"}) from None
            logger.warning(f"the Hub answered whoami with {status}: {e}")
            raise Refusal(503, f"the Hugging Face Hub answered {status} when asked whose token this is; try again "
                               f"in a minute", {"Retry-After": "60"}) from None
        except OfflineModeIsEnabled:
            logger.error("HF_HUB_OFFLINE is set: the auth server cannot ask the Hub; unset it and restart")
            raise Refusal(503, "the authentication server cannot reach the Hugging Face Hub (it runs offline); "
                               "tell the run's organisers") from None
        except Exception as e:  # connection refused, DNS, TLS, a reset, an answer that is not JSON: the Hub's side
            logger.warning(f"could not ask the Hub at {self.settings.hub_endpoint} whose token this is: "
                           f"{type(e).__name__}: {e}")
            raise Refusal(503, "the authentication server could not reach the Hugging Face Hub; try again in a "
                               "minute", {"Retry-After": "60"}) from None
        if not isinstance(answer, dict) or not isinstance(answer.get("name"), str) or not answer["name"]:
            logger.warning(f"the Hub's whoami answer has no name: {ascii(answer)[:200]}")
            raise Refusal(503, "the Hugging Face Hub gave an unexpected answer about this token; try again later")
        if not is_hub_name(answer["name"]):
            # not a name the Hub gives: a stand-in or a tampered answer; nothing of it is recorded or signed
            logger.warning(f"the Hub's whoami answer names the user {ascii(answer['name'])[:120]}, which is not a "
                           f"Hugging Face name: refused")
            raise Refusal(403, f"the Hub names this token's user {ascii(answer['name'])[:120]}, which is not a "
                               f"Hugging Face user name (letters, digits, '-', '_' and '.'): this server does not "
                               f"admit it; tell the run's organisers")
        return answer

    def check_member(self, whoami: dict) -> str:
        """The username of a user token whose owner may join; :raises Refusal: 403 otherwise."""
        name, kind = whoami["name"], whoami.get("type")
        auth = whoami.get("auth") if isinstance(whoami.get("auth"), dict) else {}
        auth_type = auth.get("type")
        personal = (f"use your personal user access token: create one at {self._tokens_url} (a 'read' token is "
                    f"enough) and log in with it")
        if kind == "org":
            raise Refusal(403, f"this is a token of the organization {name!r}, not of a user: {personal}")
        if kind != "user":
            raise Refusal(403, f"this is a token of the {kind or 'unknown'} {name!r}, not of a user: {personal}")
        if auth_type not in self.settings.accepted_auth_types:
            # an app's token acting for the user, which is also what a browser login (OAuth) gives
            raise Refusal(403, f"this token ({auth_type or 'of an unknown kind'}) was given to an app or by a "
                               f"browser login; {personal} (`hf auth login --token hf_...`, or paste it into "
                               f"notebook_login())")
        if name in self._allowlist:
            return name
        organization = self.settings.organization
        orgs = whoami.get("orgs") if isinstance(whoami.get("orgs"), list) else []
        # exactly, and only names the Hub allows: compared without case (casefold), look-alikes such as 'kiß' and
        # 'kiss', or a Kelvin sign and 'K', would pass for each other
        org_names = {org.get("name") for org in orgs
                     if isinstance(org, dict) and isinstance(org.get("name"), str) and is_hub_name(org.get("name"))}
        if organization is not None and organization in org_names:
            return name
        if organization is not None and organization.lower() in {org.lower() for org in org_names}:
            logger.warning(f"{name} is a member of an organization whose name differs from --organization "
                           f"{organization} in case only: names are compared exactly; give the name as the Hub "
                           f"writes it")
        if organization is None:
            raise Refusal(403, f"{name} is not on this run's list of participants: ask the run's organisers to "
                               f"add you")
        raise Refusal(403, f"{name} is not a member of the Hugging Face organization {organization}, whose members "
                           f"train this run: join {self.settings.hub_endpoint}/{organization} (ask its admins "
                           f"for an invite) and try again")

    def admit(self, username: str, peer_public_key: bytes, now: Optional[float] = None) -> dict:
        """Check the rate, sign and record the join; the 200 answer. :raises Refusal: 429 past the rate."""
        with self._admit_lock:
            now = time.time() if now is None else now
            recent = self.ledger.joins_since(username, now - RATE_WINDOW_SECONDS)
            limit = self.settings.joins_per_minute
            if len(recent) >= limit:
                wait = max(1, int(recent[len(recent) - limit] + RATE_WINDOW_SECONDS - now) + 1)
                raise Refusal(429, f"{username} joined {len(recent)} times in the last minute, the most this run "
                                   f"allows is {limit}: try again in {wait} s (a token lasts "
                                   f"{_minutes(self.settings.token_lifetime)}; keep it rather than join again)",
                              {"Retry-After": str(wait)})
            moment = datetime.datetime.fromtimestamp(now, datetime.timezone.utc)
            token = issue_token(self.private_key, username, peer_public_key, self.settings.token_lifetime, now=moment)
            self.ledger.record_join(username, peer_public_key, now, token.expiration_time)
        logger.info(f"{username} joined run {self.settings.run_id} (token until {token.expiration_time})")
        return {"username": username, "access_token": token_to_json(token),
                "auth_server_public_key": self.public_key_text,
                "coordinator_addresses": list(self.settings.coordinator_addresses), "run_id": self.settings.run_id}

    async def join(self, authorization: Optional[str], content_type: Optional[str], body: bytes) -> dict:
        """All the checks of one join, in order; the 200 answer. :raises Refusal: for any other answer."""
        token = self.read_token(authorization)
        peer_public_key = self.read_body(content_type, body)  # a malformed body never costs a Hub call
        if self._pending_hub_checks >= self.settings.max_pending_hub_checks:
            raise Refusal(503, "too many joins are being checked right now: try again in a few seconds",
                          {"Retry-After": "5"})
        self._pending_hub_checks += 1
        try:
            future = asyncio.wrap_future(self._hub_threads.submit(self.whoami, token))
            try:
                whoami = await asyncio.wait_for(future, self.settings.hub_timeout)
            except asyncio.TimeoutError:
                logger.warning(f"the Hub at {self.settings.hub_endpoint} did not answer whoami within "
                               f"{self.settings.hub_timeout} s")
                raise Refusal(503, "the Hugging Face Hub did not answer in time; try again in a minute",
                              {"Retry-After": "60"}) from None
        finally:
            self._pending_hub_checks -= 1
        username = self.check_member(whoami)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.admit, username, peer_public_key)


def _json_type(value) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _rsa_key_bits(key_bytes: bytes) -> int:
    from cryptography.hazmat.primitives import serialization

    return serialization.load_ssh_public_key(key_bytes).key_size  # read_public_key has checked it is RSA


def _minutes(delta: datetime.timedelta) -> str:
    minutes = delta.total_seconds() / 60
    return f"{minutes:g} minutes" if minutes != 1 else "1 minute"


# ---------------------------------------------------------------------------------------------
# HTTP


async def _read_limited(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) past ``limit`` bytes: from its Content-Length before reading, else as it
    streams in. uvicorn drains what is left of a refused body, so the client reads the 413."""
    too_large = Refusal(413, f"the request body is over {limit} bytes; a join's body is about 500 bytes: "
                             f'{{"peer_public_key": "<base64>"}}')
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
        problems = "; ".join(f"{'.'.join(str(part) for part in e.get('loc', ()))}: {e.get('msg')}"
                             for e in error.errors()[:3])
        return JSONResponse({"detail": f"malformed request ({problems})"}, status_code=400)

    @app.put(JOIN_PATH)
    async def join(request: Request):
        try:
            body = await _read_limited(request, settings.max_body_bytes)
            answer = await auth.join(request.headers.get("authorization"), request.headers.get("content-type"),
                                     body)
        except Refusal as refusal:
            if refusal.status >= 500:
                logger.warning(f"join answered {refusal.status}: {refusal.detail}")
            else:
                logger.debug(f"join refused ({refusal.status}): {refusal.detail}")
            return JSONResponse({"detail": refusal.detail}, status_code=refusal.status, headers=refusal.headers)
        return JSONResponse(answer)

    return app


def _request_timeout_answer(deadline: float) -> bytes:
    body = json.dumps({"detail": f"the request did not arrive whole within {deadline:g} s; send it again, "
                                 f"at once"}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def guarded_protocol_class(request_deadline: float, connections_per_client: int) -> type:
    """uvicorn's h11 protocol with what it lacks against slow and idle clients, for one server: a deadline for each
    whole request, and a cap on connections per client address (see ``AuthServerSettings``).

    uvicorn waits forever for a request that stops halfway, and its ``limit_concurrency`` counts such connections:
    one client holding a few hundred half-sent requests would have every other join answered 503.
    """
    open_connections: Dict[str, int] = {}  # client address -> connections open now
    refused: Dict[str, int] = {}  # client address -> connections closed for the cap (for the log)

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._deadline_timer = None
            self._address = self.client[0] if self.client else None
            if self._address is not None:
                open_connections[self._address] = open_connections.get(self._address, 0) + 1
                if connections_per_client and open_connections[self._address] > connections_per_client:
                    refused[self._address] = refused.get(self._address, 0) + 1
                    if refused[self._address] % 100 == 1:  # one line per hundred, not one per connection
                        logger.warning(f"{self._address} holds {connections_per_client} connections already: "
                                       f"closing its new ones ({refused[self._address]} so far)")
                    transport.close()
                    return
            self._arm_deadline()  # a connection that never sends a byte is closed at the deadline too

        def data_received(self, data: bytes) -> None:
            if self._deadline_timer is None and self.conn.their_state is h11.IDLE:
                self._arm_deadline()  # the first bytes of a new request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
                self._disarm_deadline()  # the whole request is in

        def connection_lost(self, exc) -> None:
            self._disarm_deadline()
            if self._address is not None:
                left = open_connections.get(self._address, 1) - 1
                if left > 0:
                    open_connections[self._address] = left
                else:
                    open_connections.pop(self._address, None)
                    refused.pop(self._address, None)
            super().connection_lost(exc)

        def _arm_deadline(self) -> None:
            self._deadline_timer = self.loop.call_later(request_deadline, self._deadline_passed)

        def _disarm_deadline(self) -> None:
            if getattr(self, "_deadline_timer", None) is not None:
                self._deadline_timer.cancel()
                self._deadline_timer = None

        def _deadline_passed(self) -> None:
            self._deadline_timer = None
            if self.transport.is_closing() or self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
                return
            logger.info(f"closed a connection from {self._address}: its request did not arrive whole within "
                        f"{request_deadline:g} s")
            answering = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
            if not answering:  # (the cycle of a kept-alive connection's last request is over)
                self.transport.write(_request_timeout_answer(request_deadline))
            self.transport.close()

    return GuardedH11Protocol


def listening_line(settings: AuthServerSettings, host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"auth server for run {settings.run_id} ({settings.who_may_join}) listening on http://{shown}:{port}"


def serve(settings: AuthServerSettings, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
          on_listening: Optional[Callable[[str], None]] = None) -> None:
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
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
                            timeout_keep_alive=5, limit_concurrency=256, server_header=False,
                            http=guarded_protocol_class(settings.request_deadline, settings.connections_per_client))

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:  # the port bound, which port 0 leaves to the system
                on_listening(listening_line(settings, host, self.servers[0].sockets[0].getsockname()[1]))

    server = Server(config)
    server.run()
    if not server.started:  # uvicorn logs why (the port is taken, ...) and returns
        raise ValueError(f"the auth server could not listen on {host}:{port} (see the error above): "
                         f"pick another --port or --host")

