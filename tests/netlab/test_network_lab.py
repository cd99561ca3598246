"""The swarm where volunteers are: behind NAT, on capped and cut links, in Linux network namespaces.

Every test builds its own lab (collab_kit.netlab: an "Internet" bridge at 10.77.0.0/16, public hosts, homes
behind NAT routers at 192.168.N.0/24) and runs the real ``collab-kit`` commands inside it; the lab and every
process in it are removed at the end, whatever happens. Where namespaces cannot be made (no root, no iproute2
or iptables), the tests skip with the reason.
"""

import math
import os
import re
import shlex
import subprocess
import sys
import threading
import time

import pytest
from netlab import NetworkLab, lab_unavailable, list_namespaces
from waiting import wait_until

from collab_kit.roles.run_history import RunHistory, peer_id_of

REASON = lab_unavailable()
needs_lab = pytest.mark.skipif(REASON is not None, reason=f"no network lab on this machine: {REASON}")

# tiny steps take milliseconds: each volunteer computes a quarter of its time (--max-load 0.25, as a machine four times
# slower would, or one its owner keeps using), so that a global epoch of the tiny preset's 2048 samples lasts a few
# seconds, long against matchmaking and the peers' progress readings, as epochs of the real presets are (minutes
# against 15 s): as long as 8192 samples at full speed, for a quarter of the computing
VOLUNTEER_LOAD = 0.25
EPOCH_SETTINGS = []  # the run's settings: the tiny preset's own
# the late joiner's link in the NAT scenario, each way: the tiny model's state (~0.3 MB) then takes longer than an epoch
LATE_JOINER_MBIT = 0.25
# what each peer's log says about matchmaking and the link, for a failure to be read from the logs alone
DEBUG_LOGS = [
    "--debug-logger",
    "hivemind.averaging.matchmaking",
    "--debug-logger",
    "collab_kit.swarm.dht",
    "--debug-logger",
    "collab_kit.swarm.watchdog",
    "--debug-logger",
    "collab_kit.swarm.optimizer",
    "--debug-logger",
    "collab_kit.roles.volunteer",
]


@pytest.fixture
def lab(tmp_path):
    created = NetworkLab()
    try:
        yield created
    finally:
        report = created.network_report()  # retransmissions and drops: shown with a failure, kept beside the logs
        print(report)
        for log in sorted(tmp_path.glob("*.log")):  # what each process said last about the swarm (CI keeps no files)
            lines = [line for line in log.read_text(errors="replace").splitlines() if not line.startswith("@event")]
            print(f"--- the last lines of {log.name}:", *(line[:300] for line in lines[-12:]), sep="\n  ")
        (tmp_path / "network.txt").write_text(report + "\n")
        created.close()
        left = [name for name in list_namespaces() if name.startswith(created.tag)]
        assert not left, f"the lab left namespaces behind: {left}"


def start_monitor(
    lab,
    tmp_path,
    run_id,
    *extra,
    preset="tiny",
    data=None,
    settings=EPOCH_SETTINGS,
    command=None,
    poll_every=("--poll-every", "1"),
):
    """The run's monitor on a public host of the lab, as its organizer starts it (listening where it is told, or on
    every interface by default); returns (the host, the monitor, the join line it printed, as its words)."""
    server = lab.public_host("server")
    if command is None:
        command = ["monitor", "--preset", preset, "--run-id", run_id, *(["--data", data] if data else []), *settings]
    monitor = server.start(
        "monitor",
        [*DEBUG_LOGS, *command, "--events", *poll_every, "--db", str(tmp_path / "monitor.sqlite"), *extra],
        str(tmp_path / "monitor.log"),
    )
    addresses = monitor.wait_for(lambda e: e["type"] == "ready", timeout=90, what="its address")["addresses"]
    assert addresses and all("/ip4/10.77.0." in address for address in addresses), addresses  # no 127.0.0.1
    return server, monitor, printed_join_line(monitor)


def printed_join_line(peer):
    """The words of the last "To join this swarm: collab-kit join ..." line ``peer`` printed: what its user shares."""
    lines = [line for line in log_of(peer).splitlines() if "To join this swarm: " in line]
    assert lines, f"{peer.name} printed no join line"
    words = shlex.split(lines[-1].split("To join this swarm: ", 1)[1])
    assert words[:2] == ["collab-kit", "join"], words
    return words


def start_volunteer(host, tmp_path, line, *extra, load=VOLUNTEER_LOAD):
    """``line`` (a printed join line's words) run in ``host`` as its volunteer would paste it; only what the test
    observes, how long it stays (``extra``: --max-epochs, --wait-for-peers) and its share of this machine's two cores
    (a volunteer's own machine is its own: torch's default threads there; ``load``: the share of its time it computes)
    are added."""
    return host.start(
        host.name,
        [*DEBUG_LOGS, *line[1:], "--events", "--no-progress", "--threads", "1", "--max-load", str(load), *extra],
        str(tmp_path / f"{host.name}.log"),
    )


def assert_prints_no_loopback_address(peer):
    printed = [line for line in log_of(peer).splitlines() if "To join this swarm: " in line]
    assert printed and not any("/ip4/127." in line for line in printed), printed


def epochs_of(peer):
    return [event for event in peer.events if event["type"] == "epoch"]


def log_of(peer) -> str:
    with open(peer.log_path) as f:
        return f.read()


# -- the lab itself ------------------------------------------------------------------------------------------


def _serve_once(host, port, ready: threading.Event, outcome: list):
    """Accept one connection inside ``host`` (a small Python server in its namespace) and read it to its end."""
    code = (
        "import socket,sys;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
        f"s.bind(('0.0.0.0',{port}));s.listen();print('listening',flush=True);s.settimeout(8)\n"
        "try:\n c,a=s.accept();print('accepted',flush=True)\n while c.recv(1<<16): pass\n"
        "except Exception as e:\n print('none',flush=True)"
    )
    process = subprocess.Popen(host.command(sys.executable, "-c", code), stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "listening"
    ready.set()
    outcome.append(process.stdout.readline().strip())
    process.wait(10)


def _connect(host, address, port, payload: int = 0, timeout: float = 2.0) -> bool:
    code = (
        f"import socket;s=socket.create_connection(('{address}',{port}),timeout={timeout});"
        f"s.sendall(b'x'*{payload});s.close()"
    )
    return host.run(sys.executable, "-c", code, check=False).returncode == 0


@needs_lab
def test_the_lab_puts_homes_behind_nat_caps_and_cuts_links_and_leaves_nothing_behind():
    with NetworkLab() as lab:
        server, alice = lab.public_host("server"), lab.home("alice")
        assert alice.address.startswith("192.168.") and alice.public_address.startswith("10.77.1.")
        # out of the home: allowed, and the server sees the router's address
        ready, outcome = threading.Event(), []
        thread = threading.Thread(target=_serve_once, args=(server, 5001, ready, outcome))
        thread.start()
        ready.wait(10)
        before = alice.link_bytes()
        assert _connect(alice, server.address, 5001, payload=200_000)
        thread.join(15)
        assert outcome == ["accepted"]
        after = alice.link_bytes()
        assert after.sent - before.sent >= 200_000  # the link's counters see the payload (and its headers)
        # into the home: nobody outside can dial it, neither at its own address nor at its router's
        ready, outcome = threading.Event(), []
        thread = threading.Thread(target=_serve_once, args=(alice, 5002, ready, outcome))
        thread.start()
        ready.wait(10)
        assert not _connect(server, alice.address, 5002)
        assert not _connect(server, alice.public_address, 5002)
        thread.join(15)
        assert outcome == ["none"]
        # a capped link: a token bucket on each direction, in the router
        alice.limit(20)
        for namespace, device in (alice.uplink, alice.downlink):
            shown = subprocess.run(
                ["ip", "netns", "exec", namespace, "tc", "qdisc", "show", "dev", device], capture_output=True, text=True
            ).stdout
            assert "tbf" in shown and "20Mbit" in shown, shown
        # the report a failed lab test leaves: each host's TCP counters, the home router's drops, the rate caps
        report = lab.network_report().splitlines()
        assert [line.split(":")[0] for line in report if not line.startswith(" ")] == ["server", "alice"], report
        assert all("TcpRetransSegs=" in line and "=?" not in line for line in report if not line.startswith(" "))
        assert "  alice's router dropped 0 packet(s) from outside" in report, report
        assert sum("rate cap on" in line and "20Mbit" in line for line in report) == 2, report
        # a cut link drops everything, silently; restored, it works again
        ready, outcome = threading.Event(), []
        thread = threading.Thread(target=_serve_once, args=(server, 5003, ready, outcome))
        thread.start()
        ready.wait(10)
        alice.cut()
        started = time.monotonic()
        assert not _connect(alice, server.address, 5003, timeout=1.5)
        assert time.monotonic() - started >= 1.0  # a timeout, not a refusal: the packets vanished
        alice.restore()
        assert _connect(alice, server.address, 5003)
        thread.join(15)
        assert outcome == ["accepted"]
        tag = lab.tag
    assert not [name for name in list_namespaces() if name.startswith(tag)]


# -- reachability by probe -----------------------------------------------------------------------------------


@needs_lab
@pytest.mark.slow
def test_the_probe_tells_nat_and_firewalls_from_public_and_forwarded_hosts(lab, tmp_path):
    server, monitor, line = start_monitor(lab, tmp_path, "probe", "--checkpoint-every", "0")
    addresses = line[line.index("--initial-peers") + 1 :]
    hosts = [
        (lab.home("home"), None, False, None),
        (lab.public_host("firewalled", drop_inbound=True), None, False, None),
        (lab.public_host("public"), None, True, "10.77.0."),
        (lab.home("vm", forward_port=31337), 31337, True, "10.77.1."),
    ]
    for host, port, reachable, seen_at in hosts:
        args = ["reachability", "--initial-peers", *addresses, "--events", "--timeout", "5"]
        checker = host.start(
            f"check-{host.name}",
            args + (["--port", str(port)] if port else []),
            str(tmp_path / f"check-{host.name}.log"),
        )
        verdict = checker.wait_for(lambda e: e["type"] == "reachability", timeout=60, what="its verdict")
        assert verdict["reachable"] is reachable, (host, verdict)
        if reachable:
            # the address others must dial: the host's own, or its router's for a forwarded port
            assert verdict["public_addresses"] == [host.public_address], verdict
            assert verdict["public_addresses"][0].startswith(seen_at)
        else:
            assert verdict["public_addresses"] == []
            outcomes = {result for answer in verdict["answers"] for result in answer["results"].values()}
            # a home router refuses or drops; a firewall that drops makes the dial time out
            assert outcomes <= {"refused", "timeout"}, verdict
        assert checker.wait_exit(30) == 0


# -- the paper's scenario -----------------------------------------------------------------------------------


@needs_lab
@pytest.mark.slow
def test_volunteers_behind_nat_average_every_round_through_the_monitor_and_a_late_one_gets_the_state(
    lab, tmp_path, tiny_shards
):
    run_id, last_epoch = "nat_run", 12
    # the organizer names the run's data once; each volunteer runs the monitor's printed line as it is (no --host,
    # --data or mode flag added: the line carries the run's settings and data, and the peer finds out where to listen)
    server, monitor, line = start_monitor(
        lab,
        tmp_path,
        run_id,
        "--checkpoint-every",
        "4",
        "--checkpoints",
        str(tmp_path / "checkpoints"),
        data=tiny_shards,
    )
    assert "--host" not in line and "--data" in line, line
    addresses = line[line.index("--initial-peers") + 1 :]
    homes = [lab.home(f"home{i}") for i in range(3)]
    volunteers = [
        start_volunteer(home, tmp_path, line, "--max-epochs", str(last_epoch), "--wait-for-peers", "3")
        for home in homes
    ]
    for volunteer in volunteers:  # no flag: each asked the monitor, which could not dial it back
        ready = volunteer.wait_for(lambda e: e["type"] == "ready", timeout=120, what="its start")
        assert ready["addresses"] == []  # nobody can join through a peer behind NAT
        assert "accepts no connections" in log_of(volunteer) and "--initial-peers " + addresses[0] in log_of(volunteer)
        assert_prints_no_loopback_address(volunteer)
    # a fourth volunteer joins late, behind its own NAT on a thin link: downloading the swarm's state (about 6 bytes a
    # parameter) takes it longer than an epoch, as a large model's does on a home link; it starts at the swarm's epoch
    # with that state and goes on from the swarm's epoch of then, rather than downloading again and again
    volunteers[0].wait_for(lambda e: e["type"] == "epoch" and e["epoch"] >= 4, timeout=400, what="epoch 4")
    swarm_epoch = max(event["epoch"] for peer in volunteers for event in epochs_of(peer))
    late_home = lab.home("late")
    late_home.limit(LATE_JOINER_MBIT)
    late = start_volunteer(late_home, tmp_path, line, "--max-epochs", str(last_epoch))
    restore = late.wait_for(
        lambda e: e["type"] == "restore" and e["loaded"], timeout=180, what="loading the swarm's state"
    )
    assert restore["reason"] == "behind_swarm" and restore["loaded"], restore
    assert restore["epoch_after"] >= swarm_epoch, (restore, swarm_epoch)
    for peer in volunteers + [late]:
        done = peer.wait_for(lambda e: e["type"] == "done", timeout=600, what="the end of training")
        assert done["final_epoch"] >= last_epoch and not done["interrupted"], done
    for peer in volunteers:
        epochs = [event for event in epochs_of(peer) if event["epoch"] >= 1]  # after the first epoch
        together = [event for event in epochs if event["averaged"] and event["group_size"] >= 2]
        assert len(epochs) >= 8, epochs
        assert len(together) >= 0.9 * len(epochs), (
            peer.name,
            [(e["epoch"], e["group_size"], e["problem"]) for e in epochs],
        )
        losses = [event["loss"] for event in epochs_of(peer)]
        assert all(math.isfinite(loss) for loss in losses)
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses  # the loss falls
    late_epochs = epochs_of(late)
    # it trained only from the swarm's state. A download waits up to 30 s for each 64 KiB part (on its thin link a
    # part behind a full router queue and TCP's retransmission back-off took longer than the tiny preset's 6 s per
    # averaging chunk: five downloads in a row were given up that way), and a try that got nothing is followed by a
    # longer wait each time, not by a try at every batch (1197 tries in 49 s before): few tries fail. Should the first
    # fail (the swarm's DHT records do not reach it, say), the volunteer starts from its own state, as it says, and its
    # first step finds it behind and loads again: that step, reported at its own epoch, is the only one allowed before
    # the swarm's
    failed_tries = [event for event in late.events if event["type"] == "restore" and not event["loaded"]]
    assert len(failed_tries) <= 3, failed_tries
    early = [event for event in late_epochs if event["epoch"] < swarm_epoch]
    assert all(event["problem"] == "this peer was behind the swarm" and not event["averaged"] for event in early), early
    assert not early or "no peer gave its state: starting from this peer's own" in log_of(late)
    assert any(event["epoch"] >= swarm_epoch for event in late_epochs), late_epochs
    assert any(event["averaged"] for event in late_epochs), late_epochs
    # a download (11-14 s on its link) often outlasts an epoch: it goes on from the swarm's epoch of then rather than
    # downloading again and again. Whether the swarm moves during a given download depends on where it falls in an
    # epoch (an anchor holds its group open for a peer it expects, so epochs stretch while one loads), so what is
    # checked is that it did not spend its epochs downloading; and its thin link, full for seconds, was never taken
    # for a cut one, nor its only DHT neighbour for a lost one (a DHT answer waits behind a download on the same
    # connection: with hivemind's 3 s per request it lost the monitor in every download, and with it the next round's
    # group and state loads, so that in one run none of its rounds averaged)
    downloads = [event for event in late.events if event["type"] == "restore" and event["loaded"]]
    assert len(downloads) <= len(late_epochs) / 2 + 1, (downloads, late_epochs)
    # nor does it download again right after a download, against the swarm's progress read before it ("the swarm
    # was at epoch 13, this peer at 14": a second 11 s download for nothing newer)
    compared = [
        re.fullmatch(r"the swarm was at epoch (\d+), this peer at (\d+)", event["problem"]) for event in downloads
    ]
    assert not [match[0] for match in compared if match and int(match[2]) > int(match[1])], downloads
    assert late.wait_for(lambda e: e["type"] == "done", timeout=5, what="its summary")["link_outages"] == 0
    # A DHT request sent while a download fills its 0.25 Mbit/s link can wait past the 20 s a peer in client mode
    # waits for an answer (seen: a request sent during its second 11 s download timed out 20 s later), and hivemind
    # drops the neighbour; what the kit promises is that the watchdog has it back at once, every time (1.3 s then)
    late_log = log_of(late)
    rejoins = [float(seconds) for seconds in re.findall(r"back in the swarm's DHT after ([\d.]+) s", late_log)]
    assert late_log.count("lost every neighbour") == len(rejoins) and all(seconds <= 20 for seconds in rejoins), rejoins
    # the monitor's anchor reduced the rounds, and its checkpoints hold the swarm's state
    checkpoint = monitor.wait_for(lambda e: e["type"] == "checkpoint", timeout=60, what="a checkpoint")
    assert checkpoint["epoch"] >= 4
    monitor.wait_for(
        lambda e: e["type"] == "anchor_round" and e["epoch"] >= last_epoch - 1, timeout=60, what="the last round"
    )
    rounds = [e for e in monitor.events if e["type"] == "anchor_round"]
    assert sum(e["training_peers"] >= 2 for e in rounds) >= 0.9 * (last_epoch - 1), rounds


README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "README.md")


def readme_command(start: str, section: str) -> list:
    """The words of the first command in the README's ``section`` (a "## " heading) that begins with ``start``."""
    text = open(README).read()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(re.escape(start) + r"[^`\n]*", body)
    assert found, f"the README's {section!r} section shows no {start!r} command"
    return shlex.split(found.group(0))


@needs_lab
@pytest.mark.slow
def test_the_readmes_commands_and_the_printed_line_train_a_small_run_together_behind_nat(lab, tmp_path, small_shards):
    """The organizer's command and the volunteer's example of the README, as they stand (the data the organizer
    names is this test's folder, the example's address the monitor's), beside two volunteers that paste the line the
    monitor printed: the small preset behind NAT, averaged through the monitor's anchor."""
    organizer = readme_command("collab-kit monitor", "Start your own run")
    assert "--host" not in organizer and "--data" in organizer, organizer
    organizer[organizer.index("--data") + 1] = small_shards
    example = readme_command("collab-kit join", "Join a run as a volunteer")
    assert "--host" not in example and "--data" not in example, example
    server, monitor, line = start_monitor(lab, tmp_path, None, "--checkpoint-every", "0", command=organizer[1:])
    addresses = line[line.index("--initial-peers") + 1 :]
    example = example[: example.index("--initial-peers") + 1] + addresses
    last_epoch = 8
    homes = [lab.home(f"home{i}") for i in range(3)]
    volunteers = [
        start_volunteer(
            home, tmp_path, words, "--max-epochs", str(last_epoch), "--wait-for-peers", "3", load=1.0
        )  # the small preset's steps are long enough at full load
        for home, words in zip(homes, [line, line, example])
    ]
    for peer in volunteers:
        done = peer.wait_for(lambda e: e["type"] == "done", timeout=400, what="the end of training")
        assert done["final_epoch"] >= last_epoch and not done["interrupted"], done
    for peer in volunteers:
        assert "accepts no connections" in log_of(peer)  # probed: behind NAT, so client mode through the anchor
        assert_prints_no_loopback_address(peer)
        epochs = [event for event in epochs_of(peer) if event["epoch"] >= 1]  # after the first epoch
        together = [event for event in epochs if event["averaged"] and event["group_size"] >= 2]
        assert len(epochs) >= last_epoch - 2, epochs
        assert len(together) >= 0.9 * len(epochs), (
            peer.name,
            [(e["epoch"], e["group_size"], e["problem"]) for e in epochs],
        )
        assert all(math.isfinite(event["loss"]) for event in epochs_of(peer))
    # the README's volunteer named no data: it streamed the run's, the folder the organizer named
    assert f"data: training on the run's data {small_shards!r}" in log_of(volunteers[2])
    assert f"data: training on --data {small_shards!r}" in log_of(volunteers[0])  # the printed line carries it


@needs_lab
@pytest.mark.slow
@pytest.mark.parametrize("overlapped", [False, True], ids=["rounds-awaited", "overlap-fragments"])
def test_volunteers_behind_nat_average_their_local_update_rounds_through_the_monitor(
    lab, tmp_path, tiny_shards, overlapped
):
    """The local-update mode (DiLoCo) behind NAT: the monitor's anchor leads and reduces the rounds of pseudo-gradients
    as it does gradients, and the volunteers end each round together; also with the run in fragments and each
    volunteer overlapping its rounds with its training (the README's settings for a thin link)."""
    run_id, last_epoch = "nat_local_run", 6
    # a round of 2 global batches of 1024: as many samples as a synchronous epoch of this lab
    local = ["--set", "optimizer.target_batch_size=1024", "--set", "optimizer.local_steps=2"]
    if overlapped:
        local += ["--set", "optimizer.fragments=2"]
    server, monitor, line = start_monitor(
        lab, tmp_path, run_id, "--checkpoint-every", "0", data=tiny_shards, settings=local
    )
    assert "--set optimizer.local_steps=2" in " ".join(line), line  # the printed line carries the mode
    own_choice = ["--set", "optimizer.overlap_rounds=true"] if overlapped else []
    homes = [lab.home(f"home{i}") for i in range(2)]
    volunteers = [
        start_volunteer(home, tmp_path, line, "--max-epochs", str(last_epoch), "--wait-for-peers", "2", *own_choice)
        for home in homes
    ]
    for volunteer in volunteers:
        volunteer.wait_for(lambda e: e["type"] == "ready", timeout=120, what="its start")
        assert "accepts no connections" in log_of(volunteer)
        assert "local-update mode: this peer takes its own steps" in log_of(volunteer)
    for peer in volunteers:
        done = peer.wait_for(lambda e: e["type"] == "done", timeout=400, what="the end of training")
        assert done["final_epoch"] >= last_epoch and not done["interrupted"], done
        assert done["bytes_sent"] > 0, done
        assert (done["overlapped_steps"] > 0) == overlapped, done  # inner steps went on while rounds averaged
    for peer in volunteers:
        epochs = [event for event in epochs_of(peer) if event["epoch"] >= 1]
        together = [event for event in epochs if event["averaged"] and event["group_size"] >= 2]
        assert len(together) >= len(epochs) - 1 and len(epochs) >= last_epoch - 2, (
            peer.name,
            [(e["epoch"], e["group_size"], e["problem"]) for e in epochs],
        )
        losses = [event["loss"] for event in epochs_of(peer)]
        assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses
    rounds = [e for e in monitor.events if e["type"] == "anchor_round"]
    assert sum(e["training_peers"] >= 2 for e in rounds) >= last_epoch - 2, rounds


# -- training alone is said ---------------------------------------------------------------------------------


@needs_lab
@pytest.mark.slow
def test_volunteers_behind_nat_with_no_anchor_are_told_they_train_alone(lab, tmp_path, tiny_shards):
    run_id = "lone_run"
    server, monitor, line = start_monitor(
        lab, tmp_path, run_id, "--checkpoint-every", "0", "--no-anchor", data=tiny_shards
    )
    volunteers = [
        start_volunteer(lab.home(f"home{i}"), tmp_path, line, "--max-epochs", "5", "--wait-for-peers", "2")
        for i in range(2)
    ]
    for volunteer in volunteers:
        lone = volunteer.wait_for(lambda e: e["type"] == "lone", timeout=300, what="the lone-training warning")
        assert lone["epochs"] >= 3 and lone["training_peers"] == 2
        assert "client mode" in lone["reason"] and "collab-kit monitor" in lone["advice"], lone

    # the monitor's history says, per peer, that it trains alone and why: read while both train, since a peer whose
    # partner has ended trains alone with nobody to average with, and its next record rightly says it is not stuck
    def alone_in_history():  # each alone for the 3 epochs of its warning (an earlier record may be read first)
        with RunHistory(str(tmp_path / "monitor.sqlite"), read_only=True) as history:
            return [peer for peer in history.peer_averaging() if peer.alone and peer.lone_epochs >= 3]

    deadline = time.monotonic() + 60
    training = lambda: all(volunteer.process.poll() is None for volunteer in volunteers)  # noqa: E731
    while len(alone_in_history()) < 2 and time.monotonic() < deadline and training():
        time.sleep(1)
    peers = alone_in_history()
    assert len(peers) == 2, peers
    assert all("client mode" in peer.lone_reason for peer in peers), peers
    assert all(peer.describe().startswith("alone for") for peer in peers), [peer.describe() for peer in peers]
    for volunteer in volunteers:
        volunteer.wait_for(lambda e: e["type"] == "done", timeout=300, what="the end of training")
        log = log_of(volunteer)
        assert "training alone: the last 3 global steps were not averaged" in log  # the CLI's warning line
        assert "Traceback" not in log  # failed rounds are one line each, not tracebacks


# -- a cut link ----------------------------------------------------------------------------------------------


@needs_lab
@pytest.mark.slow
def test_a_link_cut_for_30_s_while_averaging_heals_by_itself(lab, tmp_path, tiny_shards):
    run_id = "cut_run"
    server, monitor, line = start_monitor(lab, tmp_path, run_id, "--checkpoint-every", "0", data=tiny_shards)
    homes = [lab.home(f"home{i}") for i in range(3)]
    volunteers = [
        start_volunteer(home, tmp_path, line, "--max-epochs", "40", "--wait-for-peers", "3") for home in homes
    ]
    cut_peer, others = volunteers[0], volunteers[1:]
    cut_peer.wait_for(lambda e: e["type"] == "averaging" and e["epoch"] >= 3, timeout=400, what="averaging")
    epoch_at_cut = max(event["epoch"] for peer in volunteers for event in epochs_of(peer))
    homes[0].cut()
    cut_at = time.monotonic()
    try:
        for peer in others:  # the others go on without it
            peer.wait_for(
                lambda e: e["type"] == "epoch" and e["epoch"] >= epoch_at_cut + 3,
                timeout=120,
                what="3 more epochs while the link is cut",
            )
        assert cut_peer.process.poll() is None
        # it noticed the cut before the link came back (training waited for the link instead of stepping alone)
        cut_peer.wait_for(
            lambda e: e["type"] == "link" and e["state"] == "down",
            timeout=max(1.0, 30.0 - (time.monotonic() - cut_at)),
            what="the cut",
        )
        threading.Event().wait(max(0.0, 30.0 - (time.monotonic() - cut_at)))  # the cut lasts 30 s in all
    finally:
        homes[0].restore()
    restored_at = max(event["epoch"] for peer in others for event in epochs_of(peer))
    # and noticed the link's return, then took the swarm's state (the swarm went on meanwhile)
    back = cut_peer.wait_for(
        lambda e: e["type"] == "link" and e["state"] == "back", timeout=60, what="the link's return"
    )
    reload = cut_peer.wait_for(
        lambda e: e["type"] == "restore" and e["loaded"] and e["at"] >= back["at"],
        timeout=120,
        what="the swarm's state after the link's return",
    )
    assert reload["reason"] == "behind_swarm" and reload["epoch_after"] >= restored_at, (reload, restored_at)
    # back by itself: within 3 epochs of the link's return it averages with the others again, no restart
    together = cut_peer.wait_for(
        lambda e: e["type"] == "epoch" and e["averaged"] and e["group_size"] >= 2 and e["epoch"] > epoch_at_cut + 1,
        timeout=300,
        what="averaging again",
    )
    assert cut_peer.process.poll() is None  # the same process
    assert together["epoch"] <= restored_at + 3, (together, restored_at)
    for peer in volunteers:
        assert all(math.isfinite(event["loss"]) for event in epochs_of(peer))
    for peer in volunteers:
        peer.interrupt()


# -- the organizer's machine crashes -------------------------------------------------------------------------


@needs_lab
@pytest.mark.slow
def test_a_monitor_killed_and_started_again_with_the_same_command_loses_nothing(lab, tmp_path, tiny_shards):
    """The organizer's machine dies (SIGKILL of the monitor and everything it started) in the middle of the run, and
    20 s later the organizer types the same command again: the line shared before stays valid, the volunteers come
    back by themselves, and the swarm goes on from its newest state (the volunteers', ahead of any checkpoint)."""
    run_id, last_epoch = "restart_run", 12
    organizer = [
        "monitor",
        "--preset",
        "tiny",
        "--run-id",
        run_id,
        "--data",
        tiny_shards,
        "--port",
        "31337",
        "--checkpoints",
        str(tmp_path / "checkpoints"),
        "--checkpoint-every",
        "4",
    ]
    server, monitor, line = start_monitor(lab, tmp_path, run_id, command=organizer)
    addresses = line[line.index("--initial-peers") + 1 :]
    homes = [lab.home(f"home{i}") for i in range(3)]
    volunteers = [
        start_volunteer(home, tmp_path, line, "--max-epochs", str(last_epoch), "--wait-for-peers", "3")
        for home in homes
    ]
    # killed once a checkpoint is written and the swarm has gone on past it, two epochs before the next: the
    # volunteers' state is the newest
    checkpoint = monitor.wait_for(lambda e: e["type"] == "checkpoint", timeout=400, what="a checkpoint")
    volunteers[0].wait_for(
        lambda e: e["type"] == "epoch" and e["epoch"] >= checkpoint["epoch"] + 1,
        timeout=200,
        what="an epoch past the checkpoint",
    )
    monitor.crash()
    assert [e["epoch"] for e in monitor.events if e["type"] == "checkpoint"] == [checkpoint["epoch"]]
    killed_at = max(event["epoch"] for peer in volunteers for event in epochs_of(peer))
    loss_before = [next(e["loss"] for e in reversed(epochs_of(peer))) for peer in volunteers]
    threading.Event().wait(20)  # the organizer's 20 s
    again = server.start("monitor-again", monitor.args, str(tmp_path / "monitor-again.log"))
    ready = again.wait_for(lambda e: e["type"] == "ready", timeout=90, what="its address")
    assert printed_join_line(again) == line and sorted(ready["addresses"]) == sorted(addresses), (ready, line)
    returned_at = time.time()
    back_epoch = max(event["epoch"] for peer in volunteers for event in epochs_of(peer))
    for peer in volunteers:  # each one back by itself, the same process, averaging within 3 epochs of the return
        together = peer.wait_for(
            lambda e: e["type"] == "epoch" and e["averaged"] and e["group_size"] >= 2 and e["at"] > returned_at,
            timeout=240,
            what="averaging again after the monitor's return",
        )
        assert together["epoch"] <= back_epoch + 3, (peer.name, together, back_epoch)
        assert peer.process.poll() is None
    for peer in volunteers:
        done = peer.wait_for(lambda e: e["type"] == "done", timeout=400, what="the end of training")
        assert done["final_epoch"] >= last_epoch and not done["interrupted"], done
        epochs = [event["epoch"] for event in epochs_of(peer)]
        assert epochs == sorted(epochs), (peer.name, epochs)  # never back
    # the swarm went on from its newest state: the first losses after the return are those of before the kill, not of
    # the checkpoint's epoch or the start
    first_loss = [next(e["loss"] for e in epochs_of(peer) if e["epoch"] > killed_at) for peer in volunteers]
    start_loss = [epochs_of(peer)[0]["loss"] for peer in volunteers]
    assert max(first_loss) < min(start_loss) and sum(first_loss) / 3 <= 1.1 * sum(loss_before) / 3, (
        start_loss,
        loss_before,
        first_loss,
    )
    # the anchor went on from its checkpoint, then from the volunteers' newer state, and averaged nothing older
    resumed = [(e["source"], e["epoch"]) for e in again.events if e["type"] == "anchor_resumed"]
    assert resumed[0] == ("checkpoint", checkpoint["epoch"]) and resumed[1][0] == "swarm", resumed
    assert resumed[1][1] >= killed_at, (resumed, killed_at)
    rounds = [e for e in again.events if e["type"] == "anchor_round" and e["training_peers"]]
    assert rounds and min(e["epoch"] for e in rounds) >= killed_at, rounds
    saved = again.wait_for(lambda e: e["type"] == "checkpoint", timeout=60, what="a checkpoint after the return")
    assert saved["epoch"] > killed_at, saved
    with RunHistory(str(tmp_path / "monitor.sqlite"), read_only=True) as history:
        epochs = [point.epoch for point in history.series()]
    assert epochs == sorted(epochs), epochs  # the run's history never goes back either


# a model whose gradients outweigh the DHT's and matchmaking's messages on an anchor's link (about 0.5 MB a vector, the
# tiny preset's 86 KB is less than they are), and epochs of 4096 samples: long against a dead peer's detection
TWO_ANCHOR_SETTINGS = ["--set", "model.hidden_size=128", "--set", "optimizer.target_batch_size=4096"]


@needs_lab
@pytest.mark.slow
@pytest.mark.timeout(1500)  # about 15 epochs of 11 s alone, up to 67 s beside the rest of `make test` (two workers)
def test_two_anchors_share_each_round_and_the_run_goes_on_through_one_when_the_other_dies(lab, tmp_path, tiny_shards):
    """A second public machine joins as an anchor only: the monitor's join line lists both, each round's parts are split
    between them, and when the organizer's machine (the monitor and its anchor) dies in the middle of a round, each
    volunteer loses that round at most and averages through the second anchor, which none of them was started with."""
    # the volunteers train until the test ends (the lab kills them): it watches the epochs it needs, however many
    # epochs the anchor's arrival took on a busy machine
    run_id, count, after_kill = "two_anchor_run", 3, 4
    server, monitor, line = start_monitor(
        lab, tmp_path, run_id, "--checkpoint-every", "0", data=tiny_shards, settings=TWO_ANCHOR_SETTINGS, poll_every=()
    )
    volunteers = [
        start_volunteer(lab.home(f"home{i}"), tmp_path, line, "--wait-for-peers", str(count)) for i in range(count)
    ]

    def epoch_now():
        return max([event["epoch"] for peer in volunteers for event in epochs_of(peer)] or [0])

    def rounds_of(anchor_process, first, last):
        return [e for e in anchor_process.events if e["type"] == "anchor_round" and first <= e["epoch"] <= last]

    def round_bytes_per_peer(anchor_process, first, last):
        """What the anchor's averagers sent in its rounds of epochs ``first``..``last``, per training peer in a round:
        the states it served meanwhile (a volunteer that fell behind on a busy machine) and the peers a round missed
        are the load's, not the split's."""
        before = rounds_of(anchor_process, 0, first - 1)[-1]
        rounds = rounds_of(anchor_process, first, last)
        sent = rounds[-1]["averagers_sent"] - before["averagers_sent"]
        served = rounds[-1]["averagers_served"] - before["averagers_served"]
        return (sent - served) / sum(e["training_peers"] for e in rounds)

    def bytes_per_epoch(hosts, anchor_processes, epochs=3):
        """Over the next ``epochs``: the bytes over each host's link per epoch, and those each anchor's rounds sent per
        training peer, and the anchors' rounds themselves."""
        start_epoch, before = epoch_now(), [host.link_bytes() for host in hosts]
        volunteers[0].wait_for(
            lambda e: e["type"] == "epoch" and e["epoch"] >= start_epoch + epochs,
            timeout=600,
            what=f"{epochs} more epochs",
        )
        after, done = [host.link_bytes() for host in hosts], epoch_now() - start_epoch
        for process in anchor_processes:
            process.wait_for(
                lambda e: e["type"] == "anchor_round" and e["epoch"] >= start_epoch + epochs,
                timeout=120,
                what="the anchor's round",
            )
        links = [(a.sent + a.received - b.sent - b.received) / done for a, b in zip(after, before)]
        sent = [round_bytes_per_peer(process, start_epoch + 1, start_epoch + epochs) for process in anchor_processes]
        rounds = [rounds_of(process, start_epoch + 1, start_epoch + epochs) for process in anchor_processes]
        return links, sent, rounds

    volunteers[0].wait_for(lambda e: e["type"] == "epoch" and e["epoch"] >= 2, timeout=300, what="epoch 2")
    [alone], [alone_sent], _ = bytes_per_epoch([server], [monitor])
    # a second public machine joins the running swarm with the join line's own options
    second = lab.public_host("second")
    anchor = second.start(
        "anchor",
        [*DEBUG_LOGS, "anchor", *line[2:], "--events", "--keep-in", str(tmp_path / "anchor")],
        str(tmp_path / "anchor.log"),
    )
    anchor_addresses = anchor.wait_for(lambda e: e["type"] == "ready", timeout=90, what="its address")["addresses"]
    assert anchor_addresses and all("/ip4/10.77.0." in address for address in anchor_addresses), anchor_addresses
    listed = monitor.wait_for(
        lambda e: e["type"] == "join_line" and set(anchor_addresses) <= set(e["addresses"]),
        timeout=60,
        what="a join line that lists both anchors",
    )
    words = printed_join_line(monitor)
    assert sorted(words[words.index("--initial-peers") + 1 :]) == sorted(listed["addresses"]), (words, listed)
    # it takes the swarm's state from the peers that share it, then both anchors are in each round
    resumed = anchor.wait_for(lambda e: e["type"] == "anchor_resumed", timeout=60, what="the swarm's state")
    assert resumed["source"] == "swarm" and resumed["epoch"] >= 2, resumed
    volunteers[0].wait_for(
        lambda e: e["type"] == "epoch" and e["anchors"] == 2 and e["averaged"],
        timeout=240,
        what="a round with both anchors",
    )
    shared, shared_sent, shared_rounds = bytes_per_epoch([server, second], [monitor, anchor])
    # both anchors were in each of those rounds, the one that led waiting for the other (test_optim.py::test_an_anchor_
    # that_leads_waits_for_the_runs_other_anchor_before_it_starts_the_group), and each only reduced: half of the vector
    # in, its averages out to the volunteers, and no state held meanwhile
    for process, rounds in zip((monitor, anchor), shared_rounds):
        assert rounds and all(
            e["other_anchors"] == 1 and e["reduced_only"] and e["holds_state"] is False for e in rounds
        ), (process.name, rounds)
    print(
        f"per epoch, one anchor alone: link {alone:.0f} B; two anchors: links {shared[0]:.0f} and {shared[1]:.0f} B "
        f"({shared[0] / alone:.2f} and {shared[1] / alone:.2f} of alone); per training peer in a round, the "
        f"averagers sent {alone_sent:.0f} B alone, {shared_sent[0]:.0f} and {shared_sent[1]:.0f} B beside another "
        f"({shared_sent[0] / alone_sent:.2f} and {shared_sent[1] / alone_sent:.2f})"
    )
    assert all(0.4 <= each / alone_sent <= 0.6 for each in shared_sent), (alone_sent, shared_sent, shared_rounds)
    # the links (printed) carry the DHT's and matchmaking's messages besides, which each public peer serves in full:
    # with the tiny preset's gradients (0.7 MB a volunteer) that is a third of a link; benchmarks/two_anchors.py
    # measures the links with the small preset's
    # the organizer's machine dies while a round's parts are on its link (capped, so that its share takes a second or
    # two); the volunteers were started with its addresses alone
    server.limit(8)

    def rounds_begun():  # hivemind's matchmaking logs each group the anchor joins or leads, then its all-reduce starts
        return len(re.findall(r"assembled group", log_of(monitor)))

    begun = rounds_begun()
    wait_until(lambda: rounds_begun() > begun, timeout=150, what="the monitor's next round", every=0.05)
    monitor.crash()
    killed_at = epoch_now()
    for peer in volunteers:
        peer.wait_for(
            lambda e: e["type"] == "epoch" and e["epoch"] >= killed_at + after_kill,
            timeout=600,
            what=f"{after_kill} epochs after the kill",
        )
        assert peer.process.poll() is None, peer.name
        # every epoch after the kill counts, those a volunteer skipped by loading the state too
        after = range(killed_at + 1, killed_at + 1 + after_kill)
        together = {e["epoch"] for e in epochs_of(peer) if e["averaged"] and e["group_size"] >= 2}
        missed = [epoch for epoch in after if epoch not in together]
        assert len(missed) <= 1, (
            peer.name,
            killed_at,
            missed,
            [
                (e["epoch"], e["group_size"], e["anchors"], e["problem"])
                for e in epochs_of(peer)
                if e["epoch"] > killed_at
            ],
        )
    rounds = [e for e in anchor.events if e["type"] == "anchor_round" and e["epoch"] > killed_at + 1]
    assert rounds and all(e["training_peers"] == count for e in rounds), rounds
    # the dashboard's history holds each anchor the monitor read while it lived
    with RunHistory(str(tmp_path / "monitor.sqlite"), read_only=True) as history:
        recorded = {anchor.peer_id: anchor.addresses for anchor in history.anchors()}
    assert recorded.get(peer_id_of(anchor_addresses)) == anchor_addresses, recorded
    assert peer_id_of(line[line.index("--initial-peers") + 1 :]) in recorded, recorded


@needs_lab
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_volunteer_gone_while_two_anchors_only_reduce_the_run_goes_on_from_the_newest_checkpoint(
    lab, tmp_path, tiny_shards
):
    """Beside a second anchor the monitor's anchor only reduces and holds no state: its checkpoints are the volunteers'
    state, and when every volunteer leaves at once, the run goes on from the newest of them, not from its start."""
    run_id = "gone_run"
    organizer = [
        "monitor",
        "--preset",
        "tiny",
        "--run-id",
        run_id,
        "--data",
        tiny_shards,
        "--checkpoints",
        str(tmp_path / "checkpoints"),
        "--checkpoint-every",
        "2",
    ]
    server, monitor, line = start_monitor(lab, tmp_path, run_id, command=organizer)
    second = lab.public_host("second")
    anchor = second.start(
        "anchor",
        [*DEBUG_LOGS, "anchor", *line[2:], "--events", "--keep-in", str(tmp_path / "anchor")],
        str(tmp_path / "anchor.log"),
    )
    anchor.wait_for(lambda e: e["type"] == "ready", timeout=90, what="its address")
    volunteers = [start_volunteer(lab.home(f"home{i}"), tmp_path, line, "--wait-for-peers", "2") for i in range(2)]
    # both anchors only reduce; a checkpoint after that is a volunteer's state, relayed
    reducing = monitor.wait_for(
        lambda e: e["type"] == "anchor_round" and e["holds_state"] is False,
        timeout=400,
        what="a round the monitor's anchor only reduced",
    )
    checkpoint = monitor.wait_for(
        lambda e: e["type"] == "checkpoint" and e["epoch"] > reducing["epoch"],
        timeout=300,
        what="a checkpoint of the volunteers' state",
    )
    loss_before = [next(e["loss"] for e in reversed(epochs_of(peer))) for peer in volunteers]
    start_loss = epochs_of(volunteers[0])[0]["loss"]
    for peer in volunteers:
        peer.crash()
    resumed = monitor.wait_for(
        lambda e: e["type"] == "anchor_resumed" and e["source"] == "checkpoint",
        timeout=120,
        what="the run's newest checkpoint",
    )
    newest = max(e["epoch"] for e in monitor.events if e["type"] == "checkpoint")
    assert resumed["epoch"] >= newest >= checkpoint["epoch"], (resumed, newest)
    # a volunteer who comes later trains on from there
    late = start_volunteer(lab.home("late"), tmp_path, line, "--max-epochs", str(resumed["epoch"] + 30))
    loaded = late.wait_for(lambda e: e["type"] == "restore", timeout=300, what="its download of the state")
    assert loaded["loaded"] and loaded["epoch_after"] >= newest, loaded
    first = late.wait_for(
        lambda e: e["type"] == "epoch" and e["epoch"] >= loaded["epoch_after"],
        timeout=300,
        what="its first epoch on the state it loaded",
    )
    print(
        f"loss at the start {start_loss:.3f}, before the volunteers left {loss_before}, the late one's first "
        f"{first['loss']:.3f}"
    )
    assert first["loss"] < start_loss and first["loss"] <= 1.1 * max(loss_before), (start_loss, loss_before, first)


# -- the link watch ------------------------------------------------------------------------------------------


@needs_lab
def test_a_cut_link_is_told_while_the_dht_still_holds_its_neighbour_and_its_return_too(lab, tmp_path):
    # an idle peer's DHT makes no request of its own, so hivemind never empties its routing table during a cut: the
    # watchdog probes the link itself (TCP to the initial peers, pings to a few neighbours)
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "helpers", "link_watch_peer.py")
    server, home = lab.public_host("server"), lab.home("home")
    serving = server.start("serve", [script, "serve"], str(tmp_path / "serve.log"), command=[sys.executable])
    addresses = serving.wait_for(lambda e: e["type"] == "ready", timeout=60, what="its address")["addresses"]
    watching = home.start("watch", [script, "watch", *addresses], str(tmp_path / "watch.log"), command=[sys.executable])
    assert watching.wait_for(lambda e: e["type"] == "ready", timeout=60, what="its start")["neighbours"] == 1
    home.cut()
    cut_at = time.time()
    try:
        # told before a cut of 30 s ends (probes every 5 s, each waiting up to 4 s; down after 8 s unanswered) ...
        down = watching.wait_for(lambda e: e["type"] == "link" and e["state"] == "down", timeout=30, what="the cut")
        assert down["at"] - cut_at >= 8  # ... and not at the first probe that timed out
    finally:
        home.restore()
    back = watching.wait_for(
        lambda e: e["type"] == "link" and e["state"] == "back", timeout=30, what="the link's return"
    )
    # the neighbour is in the routing table again (the peer reads the swarm's progress and finds groups as before)
    watching.wait_for(
        lambda e: e["type"] == "table" and e["neighbours"] == 1 and e["at"] > back["at"],
        timeout=15,
        what="its neighbour back in the table",
    )
    assert [event["state"] for event in watching.events if event["type"] == "link"] == ["down", "back"]
