"""Access tokens of a run: what the authentication server signs and what every peer checks.

A token says "user U may take part in this run with the RSA key K until time T", signed by the run's
authentication server (``collab-kit auth-server``). On the wire it is hivemind's ``AccessToken``
protobuf (username, public_key, expiration_time, signature), so hivemind's DHT authorization
(``TokenAuthorizerBase``) carries it as it is; over HTTP it travels as JSON (``token_to_json``).

A peer also *binds* its libp2p peer id to its token: it signs the peer id with the token's key
(``sign_peer_binding``). libp2p proves the peer id of every connection in its handshake, so a peer
that checks the binding of whoever calls it knows the caller holds a valid token: this is how
averaging and state downloads are authorized, not only the DHT.

Everything here is plain data and signatures: nothing is unpickled or executed.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import os

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from collab_kit.errors import CollabKitError

DEFAULT_TOKEN_LIFETIME = datetime.timedelta(hours=1)
_BINDING_CONTEXT = b"collab_kit peer binding v1:"


class MalformedToken(CollabKitError, ValueError):
    """A token (or its JSON) that cannot even be read; the message says which field is wrong."""


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def format_time(moment: datetime.datetime) -> str:
    """ISO 8601 in UTC, to the second: how a token states its expiry."""
    return moment.astimezone(datetime.timezone.utc).replace(microsecond=0).isoformat()


def parse_time(text: str) -> datetime.datetime:
    try:
        moment = datetime.datetime.fromisoformat(text)
    except (TypeError, ValueError):
        raise MalformedToken(f"expiration_time {text!r} is not an ISO 8601 time") from None
    if moment.tzinfo is None:
        raise MalformedToken(f"expiration_time {text!r} has no time zone")
    return moment


def token_payload(username: str, public_key: bytes, expiration_time: str) -> bytes:
    """The bytes the server signs: every field of the token but the signature, unambiguously joined."""
    return b"\n".join([b"collab_kit access token v1", username.encode(), public_key, expiration_time.encode()])


def issue_token(
    server_key: RSAPrivateKey,
    username: str,
    peer_public_key: bytes,
    lifetime: datetime.timedelta = DEFAULT_TOKEN_LIFETIME,
    now: datetime.datetime | None = None,
) -> AccessToken:
    """A token for ``username``'s peer key, valid for ``lifetime``, signed by the server.

    :param peer_public_key: the peer's RSA public key as ``RSAPublicKey.to_bytes()`` (OpenSSH format)
    :raises MalformedToken: if the key is not an RSA public key
    """
    read_public_key(peer_public_key)
    expiration_time = format_time((now or utc_now()) + lifetime)
    signature = server_key.sign(token_payload(username, peer_public_key, expiration_time))
    return AccessToken(
        username=username, public_key=peer_public_key, expiration_time=expiration_time, signature=signature
    )


def read_public_key(key: bytes) -> RSAPublicKey:
    """An RSA public key from its OpenSSH bytes; :raises MalformedToken: with what is wrong."""
    try:
        return RSAPublicKey.from_bytes(key)
    except (ValueError, TypeError, IndexError, binascii.Error) as e:
        raise MalformedToken(f"not an RSA public key in OpenSSH format ({e})") from None
    except Exception as e:  # cryptography raises a few others (UnsupportedAlgorithm) for foreign keys
        raise MalformedToken(f"not an RSA public key in OpenSSH format ({type(e).__name__})") from None


def token_problem(
    token: AccessToken, server_public_key: RSAPublicKey, now: datetime.datetime | None = None
) -> str | None:
    """Why ``token`` is not valid now (forged, expired, malformed), or None when it is."""
    if not token.username or not token.public_key or not token.expiration_time or not token.signature:
        return "the token misses a field"
    try:
        expires = parse_time(token.expiration_time)
        read_public_key(token.public_key)
    except MalformedToken as e:
        return str(e)
    if not server_public_key.verify(
        token_payload(token.username, token.public_key, token.expiration_time), token.signature
    ):
        return "the token's signature is not the authentication server's"
    if expires <= (now or utc_now()):
        return f"the token expired at {token.expiration_time}"
    return None


def seconds_left(token: AccessToken, now: datetime.datetime | None = None) -> float:
    return (parse_time(token.expiration_time) - (now or utc_now())).total_seconds()


# ---------------------------------------------------------------------------------------------
# JSON, as the authentication server sends it


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(value, field: str) -> bytes:
    if not isinstance(value, str):
        raise MalformedToken(f"{field} must be a base64 string, got {type(value).__name__}")
    try:
        return base64.b64decode(value.encode(), validate=True)
    except (binascii.Error, ValueError):
        raise MalformedToken(f"{field} is not valid base64") from None


def token_to_json(token: AccessToken) -> dict:
    return dict(
        username=token.username,
        public_key=_b64(token.public_key),
        expiration_time=token.expiration_time,
        signature=token.signature.decode(),
    )


def token_from_json(data) -> AccessToken:
    """The token of ``token_to_json``; :raises MalformedToken: naming the missing or wrong field."""
    if not isinstance(data, dict):
        raise MalformedToken(f"expected a JSON object for the token, got {type(data).__name__}")
    for field in ("username", "public_key", "expiration_time", "signature"):
        if not isinstance(data.get(field), str) or not data[field]:
            raise MalformedToken(f"the token's {field!r} must be a non-empty string")
    parse_time(data["expiration_time"])
    _unb64(data["signature"], "signature")
    return AccessToken(
        username=data["username"],
        public_key=_unb64(data["public_key"], "public_key"),
        expiration_time=data["expiration_time"],
        signature=data["signature"].encode(),
    )


def public_key_to_text(key: RSAPublicKey) -> str:
    """A public key as text (OpenSSH, base64 of it) for JSON."""
    return _b64(key.to_bytes())


def public_key_from_text(text) -> RSAPublicKey:
    return read_public_key(_unb64(text, "public key"))


# ---------------------------------------------------------------------------------------------
# keys kept on disk (the server's, one per run, across restarts)


def private_key_from_der(data: bytes) -> RSAPrivateKey:
    """hivemind's RSAPrivateKey of a DER (TraditionalOpenSSL) key, as ``RSAPrivateKey.to_bytes()`` writes it."""
    loaded = serialization.load_der_private_key(data, password=None)
    if not isinstance(loaded, rsa.RSAPrivateKey):
        raise ValueError("the key file does not hold an RSA private key")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = loaded  # as RSAPrivateKey.__setstate__ does
    return key


def load_or_create_private_key(path: str) -> RSAPrivateKey:
    """The RSA key kept in ``path`` (DER), made and written (readable by its owner only) the first time."""
    if os.path.exists(path):
        with open(path, "rb") as f:
            try:
                return private_key_from_der(f.read())
            except ValueError as e:
                raise ValueError(
                    f"{path} is not an RSA private key ({e}): move it away to make a new key "
                    f"(tokens signed with the old one stop working)"
                ) from None
    key = RSAPrivateKey()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    staging = f"{path}.tmp-{os.getpid()}"
    with open(os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(key.to_bytes())
    os.replace(staging, path)
    return key


# ---------------------------------------------------------------------------------------------
# binding a libp2p peer id to a token


def sign_peer_binding(private_key: RSAPrivateKey, token: AccessToken, peer_id: bytes) -> bytes:
    """The peer's signature (with its token's key) that ``peer_id`` is the peer holding ``token``."""
    return private_key.sign(_BINDING_CONTEXT + peer_id + b"\n" + token.signature)


def binding_problem(
    token: AccessToken,
    peer_id: bytes,
    binding_signature: bytes,
    server_public_key: RSAPublicKey,
    now: datetime.datetime | None = None,
) -> str | None:
    """Why ``peer_id`` is not proven to hold a valid ``token``, or None when it is."""
    problem = token_problem(token, server_public_key, now)
    if problem is not None:
        return problem
    key = read_public_key(token.public_key)
    if not key.verify(_BINDING_CONTEXT + peer_id + b"\n" + token.signature, binding_signature):
        return "the peer id is not bound to this token (signed with another key)"
    return None
