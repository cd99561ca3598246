"""The authentication server: a Hugging Face user token in, a signed access token out, never a 5xx for a client.

Every server here is the real one, started as ``collab-kit auth-server --port 0`` in a subprocess (the test process
runs with HF_HUB_OFFLINE, which huggingface_hub reads once, at import) and pointed at the stand-in Hub on 127.0.0.1
with ``--hub-endpoint``; the Hub's whoami-v2 answers from the tokens each test registers. Requests go through
``requests`` or, for the malformed ones, raw sockets. Every process started is killed at the end.
"""

import base64
import contextlib
import datetime
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests
from auth_server_process import ORG, AuthServerProcess
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from hivemind.utils.crypto import RSAPrivateKey
from hub_server import REPO_ROOT, StandInHub

from collab_kit.addresses import ADDRESS_EXAMPLE
from collab_kit.auth.client import JOIN_PATH
from collab_kit.auth.ledger import JoinLedger
from collab_kit.auth.server_settings import AuthServerSettings
from collab_kit.auth.tokens import public_key_from_text, token_from_json, token_problem


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """One stand-in Hub for the module (each test registers tokens of its own users)."""
    with StandInHub(str(tmp_path_factory.mktemp("stand_in_hub"))) as hub:
        yield hub


@pytest.fixture(scope="module")
def server(hub, tmp_path_factory):
    """The run's server: members of ORG and the allowlisted 'guest-gwen', 3 joins a minute, one coordinator."""
    folder = tmp_path_factory.mktemp("auth_server")
    process = AuthServerProcess(
        "--organization",
        ORG,
        "--allow",
        "guest-gwen",
        "--db",
        str(folder / "auth.sqlite3"),
        "--run-id",
        "ttt_run",
        "--coordinator",
        ADDRESS_EXAMPLE,
        "--rate-limit",
        "3",
        "--token-lifetime",
        "30",
        hub_endpoint=hub.endpoint,
    )
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def peer_key():
    return RSAPrivateKey()


def session() -> requests.Session:
    http = requests.Session()
    http.trust_env = False  # no proxy from the environment for 127.0.0.1
    return http


def join(url: str, token=None, key=None, body=..., **kwargs) -> requests.Response:
    """PUT a join with ``token``, for ``key`` (an RSAPrivateKey) or with the JSON ``body`` given."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    if body is ...:
        body = {"peer_public_key": base64.b64encode(key.get_public_key().to_bytes()).decode()}
    with session() as http:
        return http.put(url + JOIN_PATH, headers=headers, json=body, timeout=30, **kwargs)


# ---------------------------------------------------------------------------------------------
# who may join


def test_a_member_gets_a_token_bound_to_its_key(hub, server, peer_key):
    token = hub.add_user_token("member-mia", orgs=["someone-else", ORG])
    before = datetime.datetime.now(datetime.timezone.utc)
    answer = join(server.url, token, peer_key)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    assert data["username"] == "member-mia" and data["run_id"] == "ttt_run"
    assert data["coordinator_addresses"] == [ADDRESS_EXAMPLE]
    access_token = token_from_json(data["access_token"])
    server_key = public_key_from_text(data["auth_server_public_key"])
    assert token_problem(access_token, server_key) is None
    assert access_token.username == "member-mia"
    assert access_token.public_key == peer_key.get_public_key().to_bytes()  # bound to the key it sent
    # --token-lifetime 30: valid for 30 minutes from now, not an hour
    expires = datetime.datetime.fromisoformat(access_token.expiration_time)
    assert datetime.timedelta(minutes=29) < expires - before <= datetime.timedelta(minutes=30, seconds=5)
    # the signature covers the username: the same token under another name is refused
    access_token.username = "mallory"
    assert "signature" in token_problem(access_token, server_key)


def test_a_non_member_is_told_which_organization_to_join_and_the_allowlist_lets_one_in(hub, server, peer_key):
    answer = join(server.url, hub.add_user_token("outsider-otto", orgs=["other-org"]), peer_key)
    assert answer.status_code == 403
    assert "outsider-otto" in answer.json()["detail"] and f"join {hub.endpoint}/{ORG}" in answer.json()["detail"]
    # names are compared exactly: an organization of another case is another name (the organiser's log says so)
    assert join(server.url, hub.add_user_token("member-max", orgs=[ORG.upper()]), peer_key).status_code == 403
    server.wait_for_line("differs from --organization")
    allowed = join(server.url, hub.add_user_token("guest-gwen"), peer_key)
    assert allowed.status_code == 200 and allowed.json()["username"] == "guest-gwen"


def test_organization_and_app_tokens_are_refused_with_a_hint_to_use_a_user_token(hub, server, peer_key):
    # an app acting for a member has the member's name and orgs: only auth.type tells it apart
    for token in (
        hub.add_org_token(ORG),
        hub.add_app_token("some-space"),
        hub.add_app_token("some-space", as_user="member-mia", orgs=[ORG]),
    ):
        answer = join(server.url, token, peer_key)
        assert answer.status_code == 403, hub.tokens[token]
        assert "personal user access token" in answer.json()["detail"]
        assert f"{hub.endpoint}/settings/tokens" in answer.json()["detail"]


def test_a_missing_or_unknown_token_is_401_with_how_to_log_in(hub, server, peer_key):
    whoami_calls = hub.requests.count("GET /api/whoami-v2")
    for headers in (
        {},
        {"Authorization": "Basic dXNlcjpwYXNz"},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer hf_with a space"},
    ):
        with session() as http:
            answer = http.put(
                server.url + JOIN_PATH,
                headers=headers,
                timeout=30,
                json={"peer_public_key": base64.b64encode(peer_key.get_public_key().to_bytes()).decode()},
            )
        assert answer.status_code == 401, headers
        assert "settings/tokens" in answer.json()["detail"] and answer.headers["WWW-Authenticate"] == "Bearer"
    assert hub.requests.count("GET /api/whoami-v2") == whoami_calls  # refused before asking the Hub
    answer = join(server.url, "hf_" + "x" * 34, peer_key)  # well formed, but the Hub does not know it
    assert answer.status_code == 401 and "invalid, expired or revoked" in answer.json()["detail"]
    assert hub.requests.count("GET /api/whoami-v2") == whoami_calls + 1


def _rsa_bytes(bits: int) -> bytes:
    key = rsa.generate_private_key(public_exponent=65537, key_size=bits)
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)


def test_a_malformed_body_or_key_is_400_naming_the_field(hub, server, peer_key):
    token = hub.add_user_token("member-meg", orgs=[ORG])
    whoami_calls = hub.requests.count("GET /api/whoami-v2")
    ec_key = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    )
    cases = [
        ([1, 2], "JSON array"),
        ("a string", "JSON string"),
        (None, "the body is empty"),
        ({}, "no 'peer_public_key'"),
        ({"peer_key": "AAAA"}, "no 'peer_public_key'"),
        ({"peer_public_key": 5}, "'peer_public_key' is a JSON number"),
        ({"peer_public_key": ["AAAA"]}, "'peer_public_key' is a JSON array"),
        ({"peer_public_key": "not base64!"}, "'peer_public_key' is not valid base64"),
        ({"peer_public_key": "ключ"}, "'peer_public_key' is not valid base64"),
        ({"peer_public_key": base64.b64encode(b"hello").decode()}, "not an RSA public key"),
        ({"peer_public_key": base64.b64encode(ec_key).decode()}, "not an RSA public key"),
        ({"peer_public_key": base64.b64encode(_rsa_bytes(1024)).decode()}, "RSA key of 1024 bits"),
    ]
    for body, message in cases:
        answer = join(server.url, token, body=body)
        assert answer.status_code == 400, body
        assert message in answer.json()["detail"], (body, answer.json())
        assert "peer_public_key" in answer.json()["detail"]
    with session() as http:
        for data, headers, status, message in (
            (b'{"peer_public_key": ', {}, 400, "not valid JSON"),
            (b"null", {}, 400, "JSON null"),
            (b"\xff\xfe{}", {}, 400, "not valid JSON"),
            (b"[" * 50_000, {}, 400, "not valid JSON"),  # nested past Python's recursion limit
            (b'{"peer_public_key": "AAAA"}', {"Content-Type": "text/plain"}, 415, "application/json"),
            (b"x" * 70_000, {}, 413, "over 65536 bytes"),
            (b"x" * 5_000_000, {}, 413, "over 65536 bytes"),
        ):  # refused at once, the rest drained
            answer = http.put(
                server.url + JOIN_PATH, data=data, timeout=30, headers={"Authorization": f"Bearer {token}", **headers}
            )
            assert answer.status_code == status and message in answer.json()["detail"], (data[:20], answer.text)
    assert hub.requests.count("GET /api/whoami-v2") == whoami_calls  # a bad body never costs a Hub call


def test_the_rate_limit_is_per_user(hub, server, peer_key):
    rita = hub.add_user_token("rate-rita", orgs=[ORG])
    assert [join(server.url, rita, peer_key).status_code for _ in range(3)] == [200, 200, 200]
    answer = join(server.url, rita, peer_key)
    assert answer.status_code == 429 and "most this run allows is 3" in answer.json()["detail"]
    assert 1 <= int(answer.headers["Retry-After"]) <= 61
    assert join(server.url, hub.add_user_token("rate-rob", orgs=[ORG]), peer_key).status_code == 200


def test_a_restarted_server_keeps_its_key_and_its_ledger(hub, tmp_path, peer_key):
    database = tmp_path / "state" / "run.sqlite3"
    token = hub.add_user_token("restart-rhea", orgs=[ORG])
    first = AuthServerProcess("--organization", ORG, "--db", str(database), hub_endpoint=hub.endpoint)
    try:
        before = join(first.url, token, peer_key).json()
    finally:
        first.stop()
    assert (tmp_path / "state" / "run_key.der").exists()  # the key's default place: beside the database
    second = AuthServerProcess("--organization", ORG, "--db", str(database), hub_endpoint=hub.endpoint)
    try:
        after = join(second.url, token, peer_key).json()
    finally:
        second.stop()
    assert after["auth_server_public_key"] == before["auth_server_public_key"]
    # a token issued before the restart verifies with the key served after it
    assert (
        token_problem(token_from_json(before["access_token"]), public_key_from_text(after["auth_server_public_key"]))
        is None
    )
    ledger = JoinLedger(str(database))
    try:
        stats = ledger.user_stats("restart-rhea")
        assert stats.joins == 2 and stats.first_seen <= stats.last_seen and ledger.count_joins() == 2
        assert ledger.user_stats("nobody") is None
    finally:
        ledger.close()


def test_the_cli_prints_where_it_listens_and_a_hub_it_cannot_reach_is_503(tmp_path, peer_key):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead_hub = f"http://127.0.0.1:{probe.getsockname()[1]}"
    process = AuthServerProcess(
        "--allow", "solo-sam", "--db", str(tmp_path / "auth.sqlite3"), "--run-id", "solo", hub_endpoint=dead_hub
    )
    try:
        assert process.line == f"auth server for run solo (1 allowed user) listening on {process.url}"
        assert process.port != 0
        answer = join(process.url, "hf_" + "s" * 34, peer_key)
        assert answer.status_code == 503 and "could not reach the Hugging Face Hub" in answer.json()["detail"]
    finally:
        process.stop()
    assert process.process.returncode == 0 and "auth server stopped" in "".join(process.output)
    assert "Traceback" not in "".join(process.output)


def test_settings_are_checked_with_clear_errors(tmp_path):
    database = str(tmp_path / "auth.sqlite3")
    settings = AuthServerSettings(organization=ORG, database_path=database, hub_endpoint="http://hub.test/")
    assert settings.key_path == str(tmp_path / "auth_key.der") and settings.hub_endpoint == "http://hub.test"
    for kwargs, message in (
        (dict(), "nobody could join"),
        (dict(organization="https://huggingface.co/my-org"), "give the name alone: 'my-org'"),
        (dict(organization=ORG, allowlist=["bad name"]), "not a Hugging Face user"),
        (dict(organization=ORG, run_id="my run"), "run_id"),
        (dict(organization=ORG, joins_per_minute=0), "joins_per_minute"),
        (dict(organization=ORG, token_lifetime=datetime.timedelta(0)), "token_lifetime"),
        (dict(organization=ORG, coordinator_addresses=["localhost:31337"]), "coordinator_addresses"),
        (dict(organization=ORG, hub_endpoint="huggingface.co"), "hub_endpoint"),
        (dict(organization=ORG, max_body_bytes=10), "max_body_bytes"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            AuthServerSettings(database_path=database, **kwargs)
    result = subprocess.run(
        [sys.executable, "-m", "collab_kit.cli", "auth-server", "--db", database],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 2 and "--organization ORG" in result.stderr and "Traceback" not in result.stderr


# ---------------------------------------------------------------------------------------------
# fuzz: malformed requests of every kind, never a 5xx, never a hang


def raw_exchange(port: int, data: bytes, patience: float = 0.75, timeout: float = 20) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it.

    A request that is incomplete gets no answer until the server sees the end of the stream, so after ``patience``
    seconds without one this closes its side (not at once: uvicorn takes a client's half-close for a disconnect
    and drops the answer of a request still in flight). Past ``timeout`` more seconds, the server hangs: it fails.
    """
    received = []
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        try:
            connection.sendall(data)
        except OSError:  # the server answered and closed before reading it all (broken pipe, reset)
            pass
        connection.settimeout(patience)
        while True:
            try:
                chunk = connection.recv(65536)
            except TimeoutError:
                if connection.gettimeout() == timeout:
                    raise AssertionError(
                        f"no answer and no close within {timeout} s after the end of the request"
                    ) from None
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_WR)
                connection.settimeout(timeout)
                continue
            except (ConnectionResetError, BrokenPipeError):  # closed on a body it had refused: no answer to read
                break
            if not chunk:
                break
            received.append(chunk)
    return b"".join(received)


def statuses(response: bytes):
    """The status codes of the responses in ``response`` (several when requests were pipelined)."""
    return [int(code) for code in re.findall(rb"(?:^|\r\n)HTTP/1\.[01] (\d{3}) ", response)]


def request_bytes(
    method: bytes, path: bytes, headers, body: bytes = b"", chunked: bool = False, content_length: bool = True
) -> bytes:
    lines = [method + b" " + path + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
    lines += [name + b": " + value for name, value in headers]
    if chunked:
        lines.append(b"Transfer-Encoding: chunked")
        pieces = [body[i : i + 65536] for i in range(0, len(body), 65536)]
        body = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"
    elif content_length:
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def malformed_requests(rng: random.Random, member_token: str, good_key: str):
    """(what, bytes) pairs: about 260 requests that are wrong in every way a client can be wrong."""
    path = JOIN_PATH.encode()
    auth = (b"Authorization", b"Bearer " + member_token.encode())
    json_type = (b"Content-Type", b"application/json")

    def body_of(value) -> bytes:
        return json.dumps(value).encode()

    def random_json(depth=0):
        makers = [
            lambda: None,
            lambda: rng.random() < 0.5,
            lambda: rng.randint(-(2**70), 2**70),
            lambda: rng.random() * 1e300,
            lambda: "".join(chr(rng.randrange(1, 0xD800)) for _ in range(rng.randrange(30))),
            lambda: [random_json(depth + 1) for _ in range(rng.randrange(4))],
            lambda: {str(rng.random()): random_json(depth + 1) for _ in range(rng.randrange(4))},
            lambda: {"peer_public_key": random_json(depth + 1)},
        ]
        return makers[rng.randrange(8 if depth < 3 else 5)]()

    cases = []
    for i in range(50):  # random bytes and random JSON as the body, a valid token
        blob = rng.randbytes(rng.randrange(1, 3000))
        cases.append((f"random body {i}", request_bytes(b"PUT", path, [auth, json_type], blob)))
        cases.append((f"random JSON {i}", request_bytes(b"PUT", path, [auth, json_type], body_of(random_json()))))
    key_bytes = base64.b64decode(good_key)
    for i in range(30):  # keys that are almost keys
        mutated = bytearray(key_bytes)
        for _ in range(rng.randrange(1, 6)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        candidates = [
            base64.b64encode(bytes(mutated)).decode(),
            good_key[: rng.randrange(len(good_key))],
            good_key + rng.choice(["=", "==", "A", "!", "\n", " ", "\u00e9"]),
            base64.urlsafe_b64encode(rng.randbytes(300)).decode(),
            good_key.replace("A", "\u0410", 1),
            base64.b64encode(key_bytes[: rng.randrange(len(key_bytes))]).decode(),
        ]
        key = rng.choice(candidates)
        cases.append(
            (
                f"bad key {i}",
                request_bytes(
                    b"PUT", path, [auth, json_type], body_of({"peer_public_key": key, "extra": random_json()})
                ),
            )
        )
    for size in (1_000_000, 2_500_000, 5_000_000):  # huge bodies, declared and streamed
        blob = b'{"peer_public_key": "' + b"A" * size + b'"}'
        cases.append((f"huge body {size}", request_bytes(b"PUT", path, [auth, json_type], blob)))
        cases.append((f"huge chunked body {size}", request_bytes(b"PUT", path, [auth, json_type], blob, chunked=True)))
        cases.append((f"huge body, no token {size}", request_bytes(b"PUT", path, [json_type], blob)))
    good_body = body_of({"peer_public_key": good_key})
    for i, value in enumerate(
        [
            b"",
            b"Bearer",
            b"Bearer ",
            b"bearer  " + member_token.encode(),
            b"Basic Zm9vOmJhcg==",
            b"Bearer \x01\x02\x7f",
            b"Bearer " + "h\u00e9llo".encode("latin-1"),
            b"Bearer " + "\u4f60\u597d".encode(),
            b"Bearer " + b"A" * 12_000,
            b"Bearer hf_" + bytes(rng.randrange(0x21, 0x7F) for _ in range(40)),
            b"Token " + member_token.encode(),
            b"\xff\xfe\xfd",
        ]
    ):
        cases.append(
            (f"authorization {i}", request_bytes(b"PUT", path, [(b"Authorization", value), json_type], good_body))
        )
    cases.append(
        ("two authorizations", request_bytes(b"PUT", path, [auth, (b"Authorization", b"Bearer x")], good_body))
    )
    for i, value in enumerate(
        [
            b"text/plain",
            b"multipart/form-data; boundary=x",
            b"application/x-www-form-urlencoded",
            b"application/json; charset=utf-16",
            b"\x00\x01",
            b"a" * 5000,
            b"application/xml",
            b"application/vnd.api+json",
            "application/j\u00e9son".encode("latin-1"),
        ]
    ):
        cases.append((f"content type {i}", request_bytes(b"PUT", path, [auth, (b"Content-Type", value)], good_body)))
    for method in (
        b"GET",
        b"POST",
        b"DELETE",
        b"PATCH",
        b"OPTIONS",
        b"HEAD",
        b"TRACE",
        b"FOO",
        b"put",
        b"P\xffT",
        b"CONNECT",
        b"X" * 300,
    ):
        cases.append((f"method {method[:10]!r}", request_bytes(method, path, [auth, json_type], good_body)))
    for i, odd_path in enumerate(
        [
            b"/",
            b"/api",
            b"/api/experiments/join/",
            b"/api/experiments/join?x=" + b"y" * 8000,
            b"/" + b"a" * 20_000,
            b"/../../etc/passwd",
            b"/api/experiments/%00join",
            "/api/\u00e9xp\u00e9riments".encode(),
            b"/api/experiments/join#frag",
            b"*",
            b"http://evil.example/api/experiments/join",
            b"//api//experiments//join",
            b"/docs",
            b"/openapi.json",
            b"/api/experiments/join%2F..%2F",
        ]
    ):
        cases.append((f"path {i}", request_bytes(b"PUT", odd_path, [auth, json_type], good_body)))
    for i, header in enumerate(
        [
            (b"X-Long", b"v" * 70_000),
            (b"X-" + b"n" * 20_000, b"v"),
            (b"Bad Header", b"v"),
            (b"X-Null", b"a\x00b"),
            (b"X-Utf8", "\u2603".encode()),
            (b"", b"empty name"),
            (b"Content-Length", b"5"),
            (b"Content-Length", b"-1"),
            (b"Transfer-Encoding", b"gzip"),
            (b"Expect", b"100-continue"),
        ]
    ):
        cases.append((f"header {i}", request_bytes(b"PUT", path, [auth, json_type, header], good_body)))
    for count in (10, 150, 2000):  # many headers
        extra = [(b"X-%d" % n, b"v") for n in range(count)]
        cases.append((f"{count} headers", request_bytes(b"PUT", path, [auth, json_type] + extra, good_body)))
    # raw bytes that are not HTTP at all, or broken HTTP
    ugly = [
        b"",
        b"\r\n\r\n",
        b"GET /\r\n",
        b"garbage\r\n\r\n",
        rng.randbytes(2000),
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"PUT " + path + b" HTTP/1.1\r\n",
        b"PUT " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
        b"PUT " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
        b"PUT " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        b"PUT " + path + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        b"PUT " + path + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffff\r\n{}",
        b"PUT " + path + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n{}",
        b"PUT " + path + b" HTTP/9.9\r\nHost: x\r\n\r\n",
        b"PUT " + path + b"\r\nHost: x\r\n\r\n",
        b"PUT  " + path + b"  HTTP/1.1\r\n\r\n",
        b"PUT " + path + b" HTTP/1.1\nHost: x\n\n",
        b"PUT " + path + b" HTTP/1.1\r\nHost: x\r\n folded: header\r\n\r\n",
        b"PUT " + path + b" HTTP/1.0\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + rng.randbytes(200),
    ]
    for i, data in enumerate(ugly):
        cases.append((f"ugly {i}", data))
    for i in range(3):  # pipelined requests on one connection, the last one malformed
        one = request_bytes(b"PUT", path, [auth, json_type], body_of(random_json())).replace(
            b"Connection: close\r\n", b""
        )
        cases.append((f"pipelined {i}", one * 3 + rng.randbytes(100)))
    rng.shuffle(cases)
    return cases


def test_fuzz_no_malformed_request_gets_a_5xx_or_hangs(hub, server, peer_key):
    rng = random.Random(20211206)
    member_token = hub.add_user_token("fuzz-fred", orgs=[ORG])
    good_key = base64.b64encode(peer_key.get_public_key().to_bytes()).decode()
    cases = malformed_requests(rng, member_token, good_key)
    assert len(cases) >= 200
    seen = {}
    started = time.monotonic()
    for what, data in cases:
        response = raw_exchange(server.port, data)
        codes = statuses(response)
        assert all(code < 500 for code in codes), (what, response[:500])
        for code in codes:
            seen[code] = seen.get(code, 0) + 1
    elapsed = time.monotonic() - started
    assert server.alive()
    # nothing failed inside either, out of a client's sight (an error after the client had gone)
    assert "Traceback" not in "".join(server.output) and "Exception in ASGI" not in "".join(server.output)
    # the malformed requests met the checks that should refuse them (not, say, all a 404)
    assert {400, 401, 405, 413, 415} <= set(seen), seen
    # ... and a valid join still works afterwards
    answer = join(server.url, hub.add_user_token("after-fuzz-ava", orgs=[ORG]), peer_key)
    assert answer.status_code == 200, answer.text
    print(f"fuzz: {len(cases)} requests in {elapsed:.1f} s, statuses {dict(sorted(seen.items()))}")


# ---------------------------------------------------------------------------------------------
# hostile clients: slow, idle and many connections, look-alike and invalid names

LOOKALIKE_ORG = "kiss-ff-lab"
DEADLINE = 4.0


@pytest.fixture(scope="module")
def guarded_server(hub, tmp_path_factory):
    """A server with a short request deadline and a small cap on connections per client address."""
    folder = tmp_path_factory.mktemp("guarded_auth_server")
    process = AuthServerProcess(
        "--organization",
        LOOKALIKE_ORG,
        "--allow",
        "kevin-k",
        "--db",
        str(folder / "auth.sqlite3"),
        "--request-deadline",
        str(DEADLINE),
        "--connections-per-client",
        "8",
        hub_endpoint=hub.endpoint,
    )
    try:
        yield process
    finally:
        process.stop()


def half_sent_connection(port: int, source: str) -> socket.socket:
    """A connection from ``source`` (an address of the loopback's 127.0.0.0/8) that sends half a join and stalls."""
    connection = socket.socket()
    connection.bind((source, 0))
    connection.settimeout(10)
    connection.connect(("127.0.0.1", port))
    with contextlib.suppress(OSError):  # closed at once by the cap: nothing to send on
        connection.sendall(
            b"PUT " + JOIN_PATH.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b'Content-Type: application/json\r\nContent-Length: 600\r\n\r\n{"peer_pub'
        )
    return connection


def closed_by_server(connection: socket.socket) -> bool:
    """Whether the server has closed (or answered and closed) this connection, without waiting."""
    connection.setblocking(False)
    try:
        return connection.recv(1 << 16, socket.MSG_PEEK) == b"" or True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True
    finally:
        connection.setblocking(True)


def test_many_half_sent_connections_from_one_address_do_not_keep_others_out(hub, guarded_server, peer_key):
    token = hub.add_user_token("patient-pia", orgs=[LOOKALIKE_ORG])
    attackers = []
    try:
        opened = time.monotonic()
        attackers = [half_sent_connection(guarded_server.port, "127.0.0.2") for _ in range(300)]
        # another client, from another address, joins while they are held: answered, and promptly
        with session() as http:
            answer = http.put(
                guarded_server.url + JOIN_PATH,
                headers={"Authorization": f"Bearer {token}"},
                json={"peer_public_key": base64.b64encode(peer_key.get_public_key().to_bytes()).decode()},
                timeout=2,
            )
        assert answer.status_code == 200, answer.text
        held = [connection for connection in attackers if not closed_by_server(connection)]
        assert time.monotonic() - opened < DEADLINE  # the join came while the attacker held its connections ...
        assert len(held) == 8  # ... as many as the cap lets one address hold; the rest were closed as they opened
        # the ones held are answered 408 and closed at the deadline
        for connection in held:
            connection.settimeout(DEADLINE + 10)
            answer_bytes = b"".join(iter(lambda: connection.recv(65536), b""))
            assert answer_bytes.startswith(b"HTTP/1.1 408 "), answer_bytes[:200]
            assert b"did not arrive whole within 4 s" in answer_bytes
    finally:
        for connection in attackers:
            connection.close()
    assert guarded_server.alive()
    assert "Traceback" not in "".join(guarded_server.output)


def test_a_body_sent_a_byte_at_a_time_is_cut_at_the_deadline(hub, guarded_server, peer_key):
    token = hub.add_user_token("trickling-tom", orgs=[LOOKALIKE_ORG])
    body = json.dumps({"peer_public_key": base64.b64encode(peer_key.get_public_key().to_bytes()).decode()}).encode()
    head = (
        f"PUT {JOIN_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    stop = threading.Event()
    with socket.create_connection(("127.0.0.1", guarded_server.port), timeout=DEADLINE + 10) as connection:
        started = time.monotonic()
        connection.sendall(head)

        def trickle():  # one byte every 0.2 s: the whole body would take minutes
            for byte in body:
                if stop.wait(0.2):
                    return
                try:
                    connection.sendall(bytes([byte]))
                except OSError:
                    return

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        try:
            answer_bytes = b"".join(iter(lambda: connection.recv(65536), b""))
        finally:
            stop.set()
            sender.join(5)
        elapsed = time.monotonic() - started
    assert answer_bytes.startswith(b"HTTP/1.1 408 "), answer_bytes[:200]
    assert DEADLINE - 0.5 <= elapsed, elapsed  # cut at the deadline, not before
    assert "Traceback" not in "".join(guarded_server.output)


def test_an_idle_connection_is_closed_and_a_kept_alive_one_gets_a_deadline_for_its_next_request(
    hub, guarded_server, peer_key
):
    with socket.create_connection(("127.0.0.1", guarded_server.port), timeout=DEADLINE + 10) as idle:
        assert b"".join(iter(lambda: idle.recv(65536), b"")).startswith(b"HTTP/1.1 408 ")  # it never sent a byte
    token = hub.add_user_token("keepalive-kai", orgs=[LOOKALIKE_ORG])
    body = json.dumps({"peer_public_key": base64.b64encode(peer_key.get_public_key().to_bytes()).decode()}).encode()
    request = (
        f"PUT {JOIN_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection(("127.0.0.1", guarded_server.port), timeout=DEADLINE + 10) as connection:
        connection.sendall(request)
        first = b""
        while b"}" not in first.partition(b"\r\n\r\n")[2] or not first.rstrip().endswith(b"}"):
            first += connection.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first[:200]
        connection.sendall(request[:40])  # half of a second request on the kept-alive connection, then nothing
        rest = b"".join(iter(lambda: connection.recv(65536), b""))
    assert rest.startswith(b"HTTP/1.1 408 "), rest[:200]


def test_look_alike_and_invalid_names_are_refused_with_4xx(hub, guarded_server, peer_key):
    assert join(guarded_server.url, hub.add_user_token("member-mo", orgs=[LOOKALIKE_ORG]), peer_key).status_code == 200
    assert join(guarded_server.url, hub.add_user_token("kevin-k"), peer_key).status_code == 200  # allowlisted
    # organizations whose names casefold to the configured one: not members
    for organization in ("kiß-ff-lab", "kiſſ-ff-lab", "kiss-\ufb00-lab", "KISS-FF-LAB", "kiss-ff-lab\n"):
        answer = join(guarded_server.url, hub.add_user_token("lookalike-lou", orgs=[organization]), peer_key)
        assert answer.status_code == 403 and "not a member" in answer.json()["detail"], (organization, answer.text)
    # user names that are not Hub names (a Kelvin sign for K, a lone surrogate, a newline, too long): refused
    for name in ("\u212aevin-k", "kevin-k\n", "mallory\udcff", "x" * 97, "-dash-first", "space y"):
        answer = join(guarded_server.url, hub.add_user_token(name), peer_key)
        assert answer.status_code == 403, (name, answer.status_code, answer.text)
        assert "not a Hugging Face user name" in answer.json()["detail"]
    assert guarded_server.alive()
    output = "".join(guarded_server.output)
    assert "Traceback" not in output and "Exception in ASGI" not in output
