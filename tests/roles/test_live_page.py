"""The run's live page, served by a real monitor (``collab-kit monitor --dashboard-port``) while two volunteers
train on 127.0.0.1, watched in headless Chromium through Playwright: it updates itself without a reload, its
leaderboard has a row per contributor, a volunteer killed with SIGKILL shows as gone within two of the monitor's
polls, its charts grow, its console stays clean; and nothing the API serves names a path, a key, a token or a
volunteer's address.
"""

import hashlib
import json
import os
import re
import shlex
import signal
import socket
import time
import urllib.request

import pytest
from headless_chromium import chromium  # noqa: F401 (the fixture)
from playwright.sync_api import sync_playwright
from waiting import wait_until

pytestmark = pytest.mark.slow

DEADLINE = 240  # seconds: the machines these run on are shared and often loaded
POLL_EVERY = 2.0
TARGET = "optimizer.target_batch_size=512"
SCREENSHOTS = os.environ.get("COLLAB_KIT_SCREENSHOTS")  # a folder to keep the page's screenshots in (the closing note)


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read())


def join_line(monitor):
    """The line the monitor printed for volunteers, as they would paste it."""
    with open(monitor.log_path) as log:
        lines = [line for line in log if line.startswith("To join this swarm: ")]
    assert lines, "the monitor printed no join line"
    return shlex.split(lines[-1][len("To join this swarm: ") :])


def strings_in(value, where="$"):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from strings_in(key, f"{where}.{key}")
            yield from strings_in(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from strings_in(item, f"{where}[{index}]")
    elif isinstance(value, str):
        yield where, value


def page_state(page):
    return page.evaluate("""() => ({
        epoch: document.getElementById('epoch').textContent, loss: document.getElementById('loss').textContent,
        poll: Number(document.body.dataset.poll || -1), reloaded: window.__sameDocument !== true,
        points: Chart.getChart('chart-loss-time').data.datasets[0].data.length,
        peerPoints: Chart.getChart('chart-peers').data.datasets[0].data.length,
        board: [...document.querySelectorAll('#leaderboard tbody tr td.name')].map(td => td.textContent),
        peers: Object.fromEntries([...document.querySelectorAll('#peers tbody tr[data-state]')]
                                  .map(tr => [tr.querySelector('td.name').textContent, tr.dataset.state])),
    })""")


def test_the_live_page_follows_the_run_without_a_reload(start_peer, tiny_shards, tmp_path, chromium):  # noqa: F811
    monitor = start_peer(
        "monitor",
        "monitor",
        "--preset",
        "tiny",
        "--run-id",
        "live_page",
        "--host",
        "127.0.0.1",
        "--events",
        "--poll-every",
        str(POLL_EVERY),
        "--db",
        str(tmp_path / "monitor" / "run.sqlite"),
        "--checkpoints",
        str(tmp_path / "monitor" / "checkpoints"),
        "--checkpoint-every",
        "3",
        "--data",
        tiny_shards,
        "--set",
        TARGET,
        "--dashboard-port",
        "0",
    )
    url = monitor.wait_for(lambda e: e["type"] == "live_page", DEADLINE, "the page's link")["url"]
    ready = monitor.wait_for(lambda e: e["type"] == "ready", DEADLINE, "the monitor ready")
    assert url.startswith("http://127.0.0.1:")
    line = join_line(monitor)
    volunteers = [
        start_peer(
            f"volunteer-{i}",
            *line[1:],
            "--host",
            "127.0.0.1",
            "--events",
            "--threads",
            "1",
            "--no-progress",
            "--wait-for-peers",
            "2",
        )
        for i in range(2)
    ]
    volunteer_ready = [v.wait_for(lambda e: e["type"] == "ready", DEADLINE, "a volunteer ready") for v in volunteers]
    names = [event["peer_id"] for event in volunteer_ready]

    console_errors = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda message: message.type == "error" and console_errors.append(message.text))
            page.on("pageerror", lambda error: console_errors.append(str(error)))
            page.goto(url)
            page.evaluate("() => { window.__sameDocument = true; }")  # gone if the page reloads
            first = wait_until(
                lambda: (state := page_state(page))["loss"] != "–" and len(state["board"]) == 2 and state,
                DEADLINE,
                "a loss and both volunteers on the page",
            )
            assert sorted(first["board"]) == sorted(names)
            shoot(page, tmp_path, "desktop-1")
            later = wait_until(
                lambda: (
                    (state := page_state(page))["epoch"] != first["epoch"]
                    and state["loss"] != first["loss"]
                    and state["points"] > first["points"] + 1
                    and state
                ),
                DEADLINE,
                "the page's epoch, loss and chart moving on",
            )
            assert int(later["epoch"]) > int(first["epoch"]) and not later["reloaded"]
            assert later["peerPoints"] > first["peerPoints"] and sorted(later["board"]) == sorted(names)
            assert all(later["peers"].get(name) != "gone" for name in names), later["peers"]

            # one volunteer dies at once: no goodbye, its records stay in the DHT for minutes
            victim = names[1]
            killed_at = time.time()
            os.killpg(volunteers[1].process.pid, signal.SIGKILL)
            # the monitor's polls that looked for peers after the kill: the second at the latest counts it gone
            counted = monitor.wait_for(
                lambda e: e["type"] == "poll" and victim in e["gone"],
                DEADLINE,
                "a poll that counts the killed volunteer gone",
            )
            polls_after = [e for e in monitor.events if e["type"] == "poll" and e["presence_checked_at"] > killed_at]
            assert counted in polls_after[:2], [(e["presence_checked_at"] - killed_at, e["gone"]) for e in polls_after]
            shown = wait_until(
                lambda: (state := page_state(page))["peers"].get(victim) == "gone" and state,
                DEADLINE,
                "the killed volunteer shown as gone",
            )
            assert shown["poll"] >= 1 and shown["peers"][names[0]] != "gone" and not shown["reloaded"]
            assert sorted(shown["board"]) == sorted(names)  # what it gave stays on the leaderboard

            page.set_viewport_size({"width": 390, "height": 844})  # a phone
            shoot(page, tmp_path, "phone-2")
            width = page.evaluate("() => document.documentElement.scrollWidth")
            assert width <= 390, f"the page is {width} px wide on a 390 px phone"
            page.set_viewport_size({"width": 1280, "height": 900})
            shoot(page, tmp_path, "desktop-2")
        finally:
            browser.close()
    assert not console_errors, console_errors

    # nothing served names a path, a key, a token or a volunteer's address
    served = {"status": get_json(url + "api/status"), "series": get_json(url + "api/series")}
    volunteer_ports = {
        re.search(r"/tcp/(\d+)", address).group(1) for event in volunteer_ready for address in event["addresses"]
    }
    monitor_addresses = set(ready["addresses"])
    for where, text in strings_in(served):
        assert str(tmp_path) not in text and tiny_shards not in text and "/tmp/" not in text, (where, text)
        assert not re.search(r"hf_[A-Za-z0-9]{4,}|BEGIN|ssh-rsa|[A-Za-z0-9+/=]{80,}", text), (where, text)
        assert not any(f"/tcp/{port}" in text or f":{port}" in text for port in volunteer_ports), (where, text)
        if where != "$.status.run.join_line":
            assert not re.search(r"\d+\.\d+\.\d+\.\d+", text), (where, text)
    join = served["status"]["run"]["join_line"].split()
    assert {word for word in join if word.startswith("/ip4/")} == monitor_addresses
    assert "PATH-TO-YOUR-COPY" in join  # the run's data is a folder here: the page does not name it


def shoot(page, tmp_path, name):
    path = tmp_path / f"live-page-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    if SCREENSHOTS:
        os.makedirs(SCREENSHOTS, exist_ok=True)
        page.screenshot(path=os.path.join(SCREENSHOTS, f"live-page-{name}.png"), full_page=True)


# ---------------------------------------------------------------------------------------------
# hostile requests and hostile names, on the page process alone (a made-up run's document)


DEADLINE_SLOW = 2.0  # the page's request deadline in this test


@pytest.fixture
def example_page(tmp_path, caplog):
    from example_history import POLL_EVERY as EXAMPLE_POLL
    from example_history import START, write_example_history

    from collab_kit.config import get_preset
    from collab_kit.roles.live_page import LivePage
    from collab_kit.roles.live_status import page_document, page_document_path, run_facts, write_document
    from collab_kit.roles.run_history import RunHistory

    db = str(tmp_path / "run.sqlite")
    expected = write_example_history(db)
    config = get_preset("tiny", swarm=dict(run_id="example"))
    with RunHistory(db, read_only=True) as history:
        run = run_facts(
            config, str(tmp_path / "shards"), ["/ip4/127.0.0.1/tcp/31337/p2p/QmExampleMonitor"], EXAMPLE_POLL
        )
        write_document(
            page_document_path(db),
            page_document(history, run, {"12D3KooWPeer1"}, poll=24, now=START + 24 * EXAMPLE_POLL),
        )
    page = LivePage(page_document_path(db), request_deadline=DEADLINE_SLOW)
    yield page, expected
    page.stop()
    assert not [record for record in caplog.records if "Traceback" in record.getMessage()]


def raw_request(url, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` as it is and return what came back before the server closed the connection (b"" if nothing)."""
    host, port = url.split("//")[1].rstrip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as connection:
        connection.sendall(data)
        answer = b""
        try:
            while chunk := connection.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
        return answer


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def test_hostile_requests_get_a_4xx_or_a_closed_connection_and_the_page_goes_on(example_page):
    page, _ = example_page
    get = lambda target, extra=b"": raw_request(  # noqa: E731
        page.url, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + extra + b"\r\n"
    )
    for target in (
        b"/../../etc/passwd",
        b"/%2e%2e/%2e%2e/etc/passwd",
        b"/vendor/..%2f..%2flive_page.py",
        b"/page_assets/index.html",
        b"/api/nope",
        b"/api/status/../../x",
        b"//etc/passwd",
    ):
        answer = get(target)
        assert status_of(answer) == 404 and b"root:" not in answer and b"import" not in answer, (target, answer[:200])
    for target in (
        b"/api/series?since=abc",
        b"/api/series?since=nan",
        b"/api/series?since=1e999",
        b"/api/series?since=",
    ):
        assert status_of(get(target)) == 400, target
    assert status_of(get(b"/api/series?since=" + b"9" * 5000)) == 414
    assert status_of(get(b"/api/status?" + b"a" * 100_000)) in (0, 400, 414)  # refused, or the connection closed
    assert status_of(get(b"/", b"X-Junk: " + b"j" * 100_000 + b"\r\n")) in (0, 400, 431)
    assert (
        status_of(
            raw_request(
                page.url, b"POST /api/status HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
            )
        )
        == 405
    )
    assert status_of(raw_request(page.url, b"BLAH\r\n\r\n")) in (0, 400)
    assert status_of(raw_request(page.url, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64))) in (0, 400)

    # a client that stops halfway: its connection is closed at the deadline, and others are answered meanwhile
    host, port = page.url.split("//")[1].rstrip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=10 * DEADLINE_SLOW) as slow:
        slow.sendall(b"GET /api/status HTTP/1.1\r\nHost: x\r\n")
        assert get_json(page.url + "api/status")["poll"] == 24
        answer = slow.recv(65536)
        assert status_of(answer) in (0, 408) and not slow.recv(65536)  # then closed
    assert get_json(page.url + "api/status")["poll"] == 24 and page.process.poll() is None


def test_names_from_peers_are_shown_as_text_and_the_run_folder_is_not_named(example_page, chromium):  # noqa: F811
    page_process, expected = example_page
    status = get_json(page_process.url + "api/status")
    assert status["run"]["data"].startswith("a folder of the organizers'")
    assert all("/shards" not in text for _, text in strings_in(status))
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(color_scheme="dark")
            dialogs = []
            page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
            page.goto(page_process.url)
            board = wait_until(
                lambda: len((state := page_state(page))["board"]) == len(expected["names"]) and state,
                60,
                "the leaderboard drawn",
            )
            assert sorted(board["board"]) == sorted(expected["names"])  # the markup in two names shown as text
            assert board["peers"]["bob"] == "gone" and "pwned" not in page.title() and not dialogs
            background = page.evaluate("() => getComputedStyle(document.body).backgroundColor")
            assert background == "rgb(13, 17, 23)", background  # dark mode when the reader's system asks for it
        finally:
            browser.close()


def test_a_peer_downloading_the_state_is_shown_so_until_its_next_epoch(tmp_path):
    import hivemind

    from collab_kit.config import get_preset
    from collab_kit.roles.live_status import page_document, run_facts
    from collab_kit.roles.run_history import RunHistory
    from collab_kit.swarm.metrics import MetricsPublisher, read_metrics, summarize

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    run = run_facts(get_preset("tiny", swarm=dict(run_id="activity")), "synthetic", [], 2.0)
    try:
        publisher = MetricsPublisher(dht, "activity")
        with RunHistory(str(tmp_path / "run.sqlite")) as history:

            def poll(newer_than):
                records = wait_until(
                    lambda: [r for r in read_metrics(dht, "activity") if r[1].time > newer_than],
                    30,
                    "the record in the DHT",
                )
                history.record(summarize([record for _, record in records]), [(k, r, r.peer_id) for k, r in records])
                status = page_document(history, run, set(), poll=1)["status"]
                return records[0][1], status["peers"][0], status["now"]["loss"]

            # a joiner that downloads before its first epoch: no loss of its own to count yet
            publisher.publish_activity("downloading_state", epoch=0, device="cpu", precision="fp32")
            record, peer, loss = poll(0.0)
            assert peer["state"] == "downloading" and peer["detail"] == "downloading the swarm's state"
            assert loss is None and record.mini_steps == 0
            publisher.add_work(64, 2.0)
            publisher.publish(epoch=3, loss=2.5, mini_steps=4, samples_per_second=32.0, averaged_with=1, wait=True)
            record, peer, loss = poll(record.time)
            assert peer["state"] == "averaging" and loss == 2.5
            # fallen behind later: its last epoch's figures stay, the state says what it does now
            publisher.publish_activity("downloading_state", epoch=3)
            record, peer, loss = poll(record.time)
            assert peer["state"] == "downloading" and loss == 2.5 and record.samples_accumulated == 64
    finally:
        dht.shutdown()


def test_the_charting_library_served_is_the_published_chart_js():
    from collab_kit.roles.live_page import ASSETS, CHART_JS_SHA256

    with open(os.path.join(ASSETS, "chart.umd.min.js"), "rb") as file:
        library = file.read()
    assert hashlib.sha256(library).hexdigest() == CHART_JS_SHA256
    assert library.startswith(b"/*!\n * Chart.js v4.6.2")
