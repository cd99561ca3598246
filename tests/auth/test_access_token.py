"""Access tokens: signed by the run's server, checked by every peer; a peer id bound to a token."""

import datetime

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from collab_kit.auth.tokens import (
    MalformedToken,
    binding_problem,
    issue_token,
    load_or_create_private_key,
    public_key_from_text,
    public_key_to_text,
    seconds_left,
    sign_peer_binding,
    token_from_json,
    token_problem,
    token_to_json,
)


@pytest.fixture(scope="module")
def keys():
    return RSAPrivateKey(), RSAPrivateKey(), RSAPrivateKey()  # the server, a peer, someone else


def test_a_token_is_valid_until_it_expires_and_only_with_the_servers_signature(keys):
    server, peer, other = keys
    now = datetime.datetime(2026, 11, 22, 12, 0, tzinfo=datetime.timezone.utc)
    token = issue_token(server, "alice", peer.get_public_key().to_bytes(), datetime.timedelta(minutes=10), now=now)
    assert token.username == "alice" and token.expiration_time == "2026-11-22T12:10:00+00:00"
    assert token_problem(token, server.get_public_key(), now=now) is None
    assert seconds_left(token, now=now) == 600
    assert "expired" in token_problem(token, server.get_public_key(), now=now + datetime.timedelta(minutes=10))
    # signed by another key, or changed after signing: refused
    assert "signature" in token_problem(token, other.get_public_key(), now=now)
    forged = issue_token(other, "alice", peer.get_public_key().to_bytes(), now=now)
    assert "signature" in token_problem(forged, server.get_public_key(), now=now)
    for field, value in (
        ("username", "mallory"),
        ("expiration_time", "2030-01-01T00:00:00+00:00"),
        ("public_key", other.get_public_key().to_bytes()),
    ):
        changed = type(token)()
        changed.CopyFrom(token)
        setattr(changed, field, value)
        assert "signature" in token_problem(changed, server.get_public_key(), now=now), field


def test_tokens_and_keys_travel_as_json_and_bad_json_is_named(keys):
    server, peer, _ = keys
    token = issue_token(server, "bob", peer.get_public_key().to_bytes())
    again = token_from_json(token_to_json(token))
    assert again == token and token_problem(again, server.get_public_key()) is None
    assert (
        public_key_from_text(public_key_to_text(peer.get_public_key())).to_bytes() == peer.get_public_key().to_bytes()
    )
    good = token_to_json(token)
    for bad, message in (
        (None, "JSON object"),
        ({**good, "username": 5}, "'username'"),
        ({**good, "public_key": "!!"}, "base64"),
        ({**good, "expiration_time": "soon"}, "ISO 8601"),
        ({**good, "expiration_time": "2026-11-22T12:00:00"}, "time zone"),
    ):
        with pytest.raises(MalformedToken, match=message):
            token_from_json(bad)
    with pytest.raises(MalformedToken, match="RSA public key"):
        issue_token(server, "bob", b"ssh-ed25519 AAAA")
    with pytest.raises(MalformedToken, match="RSA public key"):
        public_key_from_text("bm90IGEga2V5")


def test_a_peer_id_is_bound_to_the_token_by_the_tokens_key(keys):
    server, peer, other = keys
    token = issue_token(server, "carol", peer.get_public_key().to_bytes())
    peer_id = b"\x00\x24peer-one"
    binding = sign_peer_binding(peer, token, peer_id)
    assert binding_problem(token, peer_id, binding, server.get_public_key()) is None
    assert "not bound" in binding_problem(token, b"\x00\x24peer-two", binding, server.get_public_key())
    # someone who copies carol's token cannot bind their own peer id to it
    assert "not bound" in binding_problem(
        token, b"\x00\x24mallory", sign_peer_binding(other, token, b"\x00\x24mallory"), server.get_public_key()
    )
    expired = issue_token(server, "carol", peer.get_public_key().to_bytes(), datetime.timedelta(seconds=-1))
    assert "expired" in binding_problem(
        expired, peer_id, sign_peer_binding(peer, expired, peer_id), server.get_public_key()
    )


def test_the_server_key_is_made_once_and_kept(tmp_path):
    path = tmp_path / "run" / "server_key.der"
    first = load_or_create_private_key(str(path))
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    second = load_or_create_private_key(str(path))
    assert second.get_public_key().to_bytes() == first.get_public_key().to_bytes()
    assert second.get_public_key().verify(b"x", first.sign(b"x"))
    path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="move it away"):
        load_or_create_private_key(str(path))
