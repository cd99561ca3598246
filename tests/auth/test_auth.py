"""Authorization inside the swarm: the DHT refuses peers without a valid token, and so do the averagers.

Tokens here are issued by a server key made in the test (``collab_kit.auth.tokens.issue_token``), as the
authentication server would issue them; the DHTs, averagers and libp2p connections are real, on 127.0.0.1.
"""

import asyncio
import datetime
import re
import time

import hivemind
import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.proto import averaging_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time
from waiting import wait_until

from collab_kit.auth.client import HubAuthorizer, JoinAnswer
from collab_kit.auth.tokens import issue_token
from collab_kit.swarm.bindings import PeerGate, authorized_averager_class, binding_record, publish_peer_binding

RUN = "authrun"


@pytest.fixture(scope="module")
def server_key():
    return RSAPrivateKey()


def authorizer_for(server_key, username, lifetime=datetime.timedelta(hours=1)):
    """A HubAuthorizer holding a token the run's server key signed (what HubAuthorizer.join would get)."""
    authorizer = HubAuthorizer("http://127.0.0.1:9", "hf_unused", private_key=RSAPrivateKey())
    token = issue_token(server_key, username, authorizer.local_public_key.to_bytes(), lifetime)
    authorizer._accept(JoinAnswer(username=username, token=token, server_public_key=server_key.get_public_key()))
    return authorizer


def start(initial_peers=(), authorizer=None, ensure_bootstrap_success=True):
    return hivemind.DHT(
        initial_peers=list(initial_peers),
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        start=True,
        authorizer=authorizer,
        ensure_bootstrap_success=ensure_bootstrap_success,
    )


def visible(dht):
    return [str(a) for a in dht.get_visible_maddrs()]


def test_the_dht_serves_only_peers_with_a_valid_token(server_key):
    dhts = []
    try:
        first = start(authorizer=authorizer_for(server_key, "alice"))
        dhts.append(first)
        member = start(visible(first), authorizer=authorizer_for(server_key, "bob"))
        dhts.append(member)
        assert first.store("authrun_progress", "alice's", get_dht_time() + 60)
        assert (
            wait_until(lambda: member.get("authrun_progress", latest=True), what="bob reading alice's key").value
            == "alice's"
        )

        # without a token, or with a forged one, a peer's pings go unanswered: it cannot even join the DHT ...
        for authorizer in (None, authorizer_for(RSAPrivateKey(), "mallory")):
            with pytest.raises(RuntimeError, match="bootstrap failed"):
                start(visible(first), authorizer=authorizer)
        # ... and if it starts anyway, it reads and writes nothing of the run's
        intruders = [
            start(visible(first), ensure_bootstrap_success=False),
            start(
                visible(first), authorizer=authorizer_for(RSAPrivateKey(), "mallory"), ensure_bootstrap_success=False
            ),
        ]
        dhts += intruders
        for intruder in intruders:
            assert intruder.get("authrun_progress", latest=True) is None  # cannot read the run's keys
            intruder.store("authrun_progress", "poisoned", get_dht_time() + 120)  # nor write them
            intruder.store("authrun_other", "poisoned", get_dht_time() + 120)
        assert first.get("authrun_progress", latest=True).value == "alice's"
        assert member.get("authrun_other", latest=True) is None
        # the members go on as before
        assert member.store("authrun_progress", "bob's", get_dht_time() + 60)
        assert wait_until(
            lambda: (
                (first.get("authrun_progress", latest=True) or None)
                and first.get("authrun_progress", latest=True).value == "bob's"
            ),
            what="alice reading bob's key",
        )
    finally:
        for dht in dhts:
            dht.shutdown()


Averager = authorized_averager_class(DecentralizedAverager)


async def _ask(dht, target, prefix):
    """Ask ``target``'s averager to take us in a group, then for its state, as a peer would."""
    p2p = await dht.replicate_p2p()
    stub = Averager.get_stub(p2p, target, namespace=prefix)
    join = await stub.rpc_join_group(
        averaging_pb2.JoinRequest(schema_hash=b"x", expiration=get_dht_time() + 30, group_key=f"{prefix}.0b")
    )
    first_answer = None
    async for message in join:
        first_answer = message
        break
    download = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
    parts = [message async for message in download]
    return first_answer, parts


def test_averagers_let_in_only_peers_bound_to_a_valid_token(server_key):
    dhts, averagers = [], []
    try:
        alice, bob, mallory = (authorizer_for(server_key, name) for name in ("alice", "bob", "mallory"))
        first = start(authorizer=alice)
        member = start(visible(first), authorizer=bob)
        dhts += [first, member]
        # the averager's DHT handle goes with it into its own process, and so does its gate
        averager = Averager(
            [torch.arange(6, dtype=torch.float32)],
            dht=first,
            prefix="authrun_state",
            start=False,
            target_group_size=2,
            min_matchmaking_time=1.0,
            request_timeout=0.5,
        )
        averager.peer_gate = PeerGate(first, RUN, server_key.get_public_key().to_bytes())
        averager.allow_state_sharing = True
        averager.run_in_background(await_ready=True)
        averagers.append(averager)

        assert publish_peer_binding(first, alice, RUN)
        assert publish_peer_binding(member, bob, RUN)
        answer, parts = asyncio.run(_ask(member, first.peer_id, "authrun_state"))
        assert answer is not None and answer.code != averaging_pb2.PROTOCOL_VIOLATION  # let in (not looking yet)
        assert parts and parts[0].tensor_part.buffer  # the state came

        # a peer whose DHT node has a valid token but that bound its peer id to nobody, and one that copies
        # bob's binding record under its own peer id: both refused
        stranger = start(visible(first), authorizer=mallory)  # mallory's token is valid: its DHT node may join
        dhts.append(stranger)
        answer, parts = asyncio.run(_ask(stranger, first.peer_id, "authrun_state"))
        assert answer.code == averaging_pb2.PROTOCOL_VIOLATION and parts == []
        copied = binding_record(bob, member.peer_id.to_bytes())
        assert member.store(
            f"{RUN}_peer_tokens", subkey=stranger.peer_id.to_bytes(), value=copied, expiration_time=get_dht_time() + 60
        )
        time.sleep(2.5)  # the gate remembers a refusal for 2 s
        answer, parts = asyncio.run(_ask(stranger, first.peer_id, "authrun_state"))
        assert answer.code == averaging_pb2.PROTOCOL_VIOLATION and parts == []
        # with its own binding published, the same peer is let in
        assert publish_peer_binding(stranger, mallory, RUN)
        time.sleep(2.5)
        answer, parts = asyncio.run(_ask(stranger, first.peer_id, "authrun_state"))
        assert answer.code != averaging_pb2.PROTOCOL_VIOLATION and parts
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


def test_a_token_used_with_another_key_gets_no_answer_from_the_dht(server_key):
    first = start(authorizer=authorizer_for(server_key, "alice"))
    try:
        # mallory holds bob's genuine token, but signs her requests with her own key
        bob = authorizer_for(server_key, "bob")
        mallory = HubAuthorizer("http://127.0.0.1:9", "hf_unused", private_key=RSAPrivateKey())
        mallory.answer, mallory._local_access_token = bob.answer, bob.access_token
        with pytest.raises(RuntimeError, match="bootstrap failed"):
            start(visible(first), authorizer=mallory)
    finally:
        first.shutdown()


def test_the_authorizer_takes_only_tokens_for_its_key_from_its_server(server_key):
    alice = authorizer_for(server_key, "alice")
    other_key_token = issue_token(server_key, "alice", RSAPrivateKey().get_public_key().to_bytes())
    with pytest.raises(Exception, match="another key"):
        alice._accept(JoinAnswer("alice", other_key_token, server_key.get_public_key()))
    other_server = RSAPrivateKey()
    token = issue_token(other_server, "alice", alice.local_public_key.to_bytes())
    with pytest.raises(Exception, match="key changed"):
        alice._accept(JoinAnswer("alice", token, other_server.get_public_key()))
    expired = issue_token(server_key, "alice", alice.local_public_key.to_bytes(), datetime.timedelta(seconds=-5))
    with pytest.raises(Exception, match="expired"):
        alice._accept(JoinAnswer("alice", expired, server_key.get_public_key()))
    # a short token is renewed a quarter of its life before it ends, a long one 5 minutes before
    short = authorizer_for(server_key, "bob", lifetime=datetime.timedelta(seconds=40))
    assert not short.does_token_need_refreshing(short.access_token)
    soon = issue_token(server_key, "bob", short.local_public_key.to_bytes(), datetime.timedelta(seconds=8))
    assert short.does_token_need_refreshing(soon)
    assert alice.does_token_need_refreshing(
        issue_token(server_key, "alice", alice.local_public_key.to_bytes(), datetime.timedelta(minutes=4))
    )


def test_binding_records_from_the_dht_are_schema_checked(server_key):
    alice = authorizer_for(server_key, "alice")
    gate = PeerGate(None, RUN, server_key.get_public_key().to_bytes())
    peer_id = b"\x00\x24alice-peer"
    good = binding_record(alice, peer_id)
    assert gate.check_record(peer_id, good) is None
    for bad in (
        None,
        "text",
        [1, 2],
        {"token": "str", "binding": b"x"},
        {"token": b"\xff\xfe garbage", "binding": b"x"},
        {**good, "binding": b"not a signature"},
        {"token": good["token"]},
    ):
        assert gate.check_record(peer_id, bad) is not None, bad


def test_login_takes_the_token_from_the_environment_or_says_where_to_make_one(monkeypatch):
    from collab_kit.auth.client import AuthorizationError, login

    monkeypatch.setenv("HF_TOKEN", "hf_from_the_environment")
    assert login() == "hf_from_the_environment"
    assert login("hf_given") == "hf_given"
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(AuthorizationError, match="huggingface.co/settings/tokens"):
        login()


def test_nothing_from_a_peer_is_unpickled():
    """What crosses the wire is protobuf, msgpack and tensor bytes: no module on the way imports pickle."""
    import importlib
    import inspect
    import pkgutil

    network_packages = [
        importlib.import_module(name)
        for name in (
            "hivemind.dht",
            "hivemind.averaging",
            "hivemind.p2p",
            "hivemind.optim",
            "hivemind.compression",
            "collab_kit.auth",
            "collab_kit.swarm",
            "collab_kit.roles",
            "collab_kit.data",
        )
    ]
    modules = [importlib.import_module(f"hivemind.utils.{name}") for name in ("serializer", "auth", "streaming")]
    modules.append(importlib.import_module("collab_kit.addresses"))
    for package in network_packages:
        modules += [
            importlib.import_module(info.name)
            for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
        ]
    collab_kit_modules = {module.__name__ for module in modules if module.__name__.startswith("collab_kit.")}
    # The peer-facing parts of the kit: tokens and their checks, the swarm, the roles that run it, the data it streams.
    assert {
        "collab_kit.auth.tokens",
        "collab_kit.auth.server",
        "collab_kit.swarm.optimizer",
        "collab_kit.swarm.robust",
        "collab_kit.roles.volunteer",
        "collab_kit.roles.monitor",
        "collab_kit.data.stream",
    } <= collab_kit_modules
    assert len(modules) > 30
    forbidden = re.compile(
        r"\bimport (cloud)?pickle\b|\bfrom (cloud)?pickle\b|\bimport dill\b|\bmarshal\.loads\b|"
        r"(?<![\w.])(eval|exec)\("
    )
    for module in modules:
        found = forbidden.search(inspect.getsource(module))
        assert found is None, f"{module.__name__} uses {found.group(0)}"
