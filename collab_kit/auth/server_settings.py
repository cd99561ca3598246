"""What the run's authentication server is set to: who may join, for how long, and its limits against abuse.

``AuthServerSettings`` checks every field when it is built (a name the Hub would not allow, a non-positive limit),
so ``collab-kit auth-server`` fails at once with what to change; collab_kit.auth.server serves with them.
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from huggingface_hub import constants

from collab_kit.addresses import parse_initial_peers
from collab_kit.auth.tokens import DEFAULT_TOKEN_LIFETIME

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

    organization: str | None = None
    allowlist: Sequence[str] = ()
    run_id: str = "collab_kit"
    database_path: str = DEFAULT_DATABASE
    key_path: str | None = None
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
            raise ValueError(
                "nobody could join this run: give the organization whose members may join "
                "(--organization ORG) and/or the users who may (--allow USER)"
            )
        if not (isinstance(self.run_id, str) and self.run_id.replace("_", "").replace("-", "").isalnum()):
            raise ValueError(
                f"run_id={self.run_id!r} is not allowed: use letters, digits, '_' and '-' only "
                f"(the run id the peers use)"
            )
        if not isinstance(self.database_path, str) or not self.database_path.strip():
            raise ValueError(f"database_path={self.database_path!r} is not allowed: expected a file path")
        if self.key_path is None:
            stem = os.path.splitext(os.path.abspath(self.database_path))[0]
            self.key_path = f"{stem}_key.der"
        if not isinstance(self.token_lifetime, datetime.timedelta) or self.token_lifetime.total_seconds() <= 0:
            raise ValueError(
                f"token_lifetime={self.token_lifetime!r} is not allowed: expected a positive "
                f"datetime.timedelta (e.g. one hour)"
            )
        if not _positive_int(self.joins_per_minute):
            raise ValueError(
                f"joins_per_minute={self.joins_per_minute!r} is not allowed: expected a positive "
                f"integer (a peer joins once per token lifetime; allow a few restarts)"
            )
        if isinstance(self.coordinator_addresses, str):
            self.coordinator_addresses = (self.coordinator_addresses,)

        try:
            self.coordinator_addresses = tuple(parse_initial_peers(list(self.coordinator_addresses)))
        except ValueError as e:
            raise ValueError(f"coordinator_addresses: {e}") from None
        if not (isinstance(self.hub_endpoint, str) and re.match(r"^https?://[^/\s]+", self.hub_endpoint)):
            raise ValueError(
                f"hub_endpoint={self.hub_endpoint!r} is not allowed: expected the Hub's URL, "
                f"e.g. https://huggingface.co"
            )
        self.hub_endpoint = self.hub_endpoint.rstrip("/")
        if not (
            isinstance(self.hub_timeout, (int, float))
            and not isinstance(self.hub_timeout, bool)
            and self.hub_timeout > 0
        ):
            raise ValueError(f"hub_timeout={self.hub_timeout!r} is not allowed: expected positive seconds")
        if not (
            isinstance(self.request_deadline, (int, float))
            and not isinstance(self.request_deadline, bool)
            and 0 < self.request_deadline < float("inf")
        ):
            raise ValueError(
                f"request_deadline={self.request_deadline!r} is not allowed: expected positive seconds "
                f"(a join's request is under a kilobyte: a few seconds are plenty)"
            )
        if not (
            isinstance(self.connections_per_client, int)
            and not isinstance(self.connections_per_client, bool)
            and self.connections_per_client >= 0
        ):
            raise ValueError(
                f"connections_per_client={self.connections_per_client!r} is not allowed: expected a count (0: no cap)"
            )
        if not _positive_int(self.max_body_bytes) or self.max_body_bytes < 1024:
            raise ValueError(
                f"max_body_bytes={self.max_body_bytes!r} is not allowed: expected at least 1024 "
                f"(a join's body is about 500 bytes)"
            )
        self.accepted_auth_types = tuple(self.accepted_auth_types)
        if not self.accepted_auth_types:
            raise ValueError(
                "accepted_auth_types is empty: no token could join; the Hub's user access tokens are 'access_token'"
            )
        if not _positive_int(self.max_pending_hub_checks):
            raise ValueError(
                f"max_pending_hub_checks={self.max_pending_hub_checks!r} is not allowed: expected a positive integer"
            )

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
        raise ValueError(
            f"{what}: {name!r} is not a Hugging Face user or organization name{hint}; names are "
            f"letters, digits, '-', '_' and '.'"
        )
