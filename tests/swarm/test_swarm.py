"""Real DHTs on 127.0.0.1: addresses, joining, presence, and clear errors for bad addresses."""

import pytest

from collab_kit.addresses import parse_initial_peers
from collab_kit.config import SwarmConfig, get_preset
from collab_kit.swarm.dht import (
    CLIENT_DHT_REQUEST_TIMEOUT,
    SwarmConnectionError,
    count_present_peers,
    join_addresses,
    join_instructions,
    start_dht,
    wait_for_peers,
)

GOOD = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWBmwXN3rsVfnLsZKbXeBrSLfczHxZHwVjPrbKwpLfYm3t"


def test_parse_initial_peers_accepts_lists_and_strings():
    assert parse_initial_peers(None) == []
    assert parse_initial_peers([GOOD]) == [GOOD]
    assert parse_initial_peers(f"{GOOD}, {GOOD.replace('31337', '31338')}") == [GOOD, GOOD.replace("31337", "31338")]


@pytest.mark.parametrize(
    "address, message",
    [
        ("127.0.0.1:31337", "not a valid multiaddr"),
        ("/ip4/999.0.0.1/tcp/31337/p2p/12D3KooWBmwXN3rsVfnLsZKbXeBrSLfczHxZHwVjPrbKwpLfYm3t", "not a valid multiaddr"),
        ("/ip4/127.0.0.1/tcp/31337", "no /p2p/"),
    ],
)
def test_malformed_addresses_explain_what_a_good_one_looks_like(address, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_initial_peers([address])
    assert "/ip4/203.0.113.5/tcp/31337/p2p/" in str(error.value)


def test_a_second_peer_joins_the_first_and_they_see_each_other():
    first = start_dht(SwarmConfig(host="127.0.0.1"))
    try:
        addresses = join_addresses(first)
        assert addresses and all(a.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in a for a in addresses)
        line = join_instructions(
            first, get_preset("tiny", swarm=dict(run_id="run1"), optimizer=dict(target_batch_size=512))
        )
        # the line carries what the joining peer must share: preset, run id, every setting changed from the preset
        assert line == (
            f"To join this swarm: collab-kit join --preset tiny --run-id run1 "
            f"--set optimizer.target_batch_size=512 --initial-peers {' '.join(addresses)}"
        )
        # the run's other anchors follow this peer's own addresses, each once
        other = "/ip4/10.77.0.11/tcp/4000/p2p/12D3KooWBmwXN3rsVfnLsZKbXeBrSLfczHxZHwVjPrbKwpLfYm3t"
        both = join_instructions(
            first, get_preset("tiny", swarm=dict(run_id="run1")), other_anchors=[other, addresses[0]]
        )
        assert both.endswith(f"--initial-peers {' '.join(addresses)} {other}"), both
        second = start_dht(SwarmConfig(host="127.0.0.1", initial_peers=addresses))
        try:
            second.store("greeting", "hello", expiration_time=10**10)
            assert first.get("greeting", latest=True).value == "hello"
            # the presence barrier counts both peers once each has announced itself
            assert count_present_peers(first, "run1") == 0
            with pytest.raises(SwarmConnectionError, match="only 1 of 2 peers"):
                wait_for_peers(second, "run1", count=2, timeout=1.0)
            assert wait_for_peers(first, "run1", count=2, timeout=10.0) == 2
        finally:
            second.shutdown()
    finally:
        first.shutdown()


def test_an_unreachable_initial_peer_is_a_clear_error():
    # a well-formed address where nobody listens
    with pytest.raises(SwarmConnectionError, match="could not reach any initial peer"):
        start_dht(SwarmConfig(host="127.0.0.1", initial_peers=[GOOD.replace("31337", "9")]))


def test_a_second_peer_with_the_identity_of_a_live_one_is_a_clear_error(tmp_path):
    key = str(tmp_path / "run.key")  # a monitor's key beside its database, started twice
    first = start_dht(SwarmConfig(host="127.0.0.1", identity_path=key))
    try:
        with pytest.raises(SwarmConnectionError, match="runs with this peer's identity .* already running"):
            start_dht(SwarmConfig(host="127.0.0.1", identity_path=key, initial_peers=join_addresses(first)))
    finally:
        first.shutdown()


async def _request_timeout(_dht, node) -> float:
    """In a DHT's process: seconds it waits for a neighbour's answer before dropping it."""
    return node.protocol.wait_timeout


def test_client_mode_peer_trains_without_listening():
    first = start_dht(SwarmConfig(host="127.0.0.1"))
    try:
        client = start_dht(SwarmConfig(host="127.0.0.1", client_mode=True, initial_peers=join_addresses(first)))
        try:
            assert client.client_mode
            client.store("from-client", 1, expiration_time=10**10)
            assert first.get("from-client", latest=True).value == 1
            # a peer behind NAT knows one or two neighbours and is often on a home link that its downloads fill: it
            # waits longer for their answers before hivemind drops them (test_network_lab's late joiner kept its
            # neighbour through every download); a peer that accepts connections keeps hivemind's 3 s
            assert client.run_coroutine(_request_timeout) == CLIENT_DHT_REQUEST_TIMEOUT > 3.0
            assert first.run_coroutine(_request_timeout) == 3.0
        finally:
            client.shutdown()
    finally:
        first.shutdown()


def test_a_peer_nobody_can_dial_gives_the_addresses_it_joined_through():
    first = start_dht(SwarmConfig(host="127.0.0.1"))
    try:
        addresses = join_addresses(first)
        client = start_dht(SwarmConfig(host="127.0.0.1", client_mode=True, initial_peers=addresses))
        try:
            assert join_addresses(client) == []
            line = join_instructions(client, get_preset("small", swarm=dict(run_id="run1", initial_peers=addresses)))
            assert "accepts no connections" in line and "nobody can join through it" in line
            assert line.endswith(f"collab-kit join --preset small --run-id run1 --initial-peers {' '.join(addresses)}")
        finally:
            client.shutdown()
    finally:
        first.shutdown()


def test_where_a_peer_listens_and_whether_it_is_asked_to_be_dialled_back(monkeypatch):
    from collab_kit.swarm import dht as swarm
    from collab_kit.swarm.reachability import HelperAnswer, ReachabilityVerdict

    asked = []

    def probe(initial_peers, host, port, **kwargs):  # the kit's probe (tested against real peers in the lab)
        asked.append(host)
        return ReachabilityVerdict(False, 4242, [HelperAnswer("helper", "10.1.2.3", {4242: "refused"})])

    monkeypatch.setattr(swarm, "probe_reachability", probe)
    elsewhere, here = [GOOD.replace("127.0.0.1", "10.77.0.10")], [GOOD]
    resolve = swarm.resolve_reachability
    # set by the user, the swarm's first peer, a run on this machine: nothing to ask
    assert resolve(SwarmConfig(client_mode=True, initial_peers=elsewhere))[0].client_mode is True
    first = resolve(SwarmConfig())[0]
    assert (first.host, first.client_mode) == ("0.0.0.0", False)  # a first peer listens where others can reach it
    local = resolve(SwarmConfig(initial_peers=here))[0]
    assert (local.host, local.client_mode) == ("127.0.0.1", False)  # a swarm on this machine stays on loopback
    assert asked == []
    # made to listen on loopback while the swarm is elsewhere: nobody there can dial it, so client mode, no probe
    forced = resolve(SwarmConfig(host="127.0.0.1", initial_peers=elsewhere))[0]
    assert (forced.host, forced.client_mode, forced.announce_maddrs) == ("127.0.0.1", True, ())
    assert asked == []
    # whatever the preset, a peer whose initial peers are elsewhere listens on every interface and is probed
    for preset in ("tiny", "small", "toy", "paper"):
        swarm_config = get_preset(preset, swarm=dict(initial_peers=elsewhere)).swarm
        resolved = resolve(swarm_config)[0]
        assert (resolved.host, resolved.client_mode, resolved.port) == ("0.0.0.0", True, 4242), preset
    assert asked == ["0.0.0.0"] * 4


def test_a_failed_averaging_round_is_one_log_line(caplog):
    import logging

    from hivemind.averaging.partition import AllreduceException

    from collab_kit.swarm.dht import install_log_filters

    install_log_filters()
    logger = logging.getLogger("hivemind.averaging.averager")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        try:
            raise AllreduceException("Averaging step failed: could not find a group")
        except AllreduceException as e:
            logger.exception(e)
    finally:
        logger.removeHandler(handler)
    [record] = records
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert record.getMessage() == "averaging round failed: Averaging step failed: could not find a group"


def test_the_dht_hard_stop_is_not_shown_unless_debug_logs_are_asked_for():
    import logging

    from collab_kit.swarm.dht import install_log_filters

    install_log_filters()
    logger = logging.getLogger("hivemind.dht.dht")
    records, level = [], logger.level
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        logger.setLevel(logging.INFO)
        logger.warning("DHT did not shut down within the grace period; terminating it the hard way")
        assert records == []  # harmless: not a warning in a notebook's red box
        logger.setLevel(logging.DEBUG)
        logger.warning("DHT did not shut down within the grace period; terminating it the hard way")
        assert [record.levelno for record in records] == [logging.DEBUG]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_a_helper_that_drops_a_reachability_check_is_asked_once_more():
    """A helper busy with a round may close a check's stream without an answer: the peer asks it again rather than
    join in client mode, which would stop an anchor from starting (collab_kit.swarm.reachability._probe)."""
    import asyncio
    import threading

    from hivemind.p2p import P2P

    from collab_kit.swarm import reachability

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True, name="helper-loop").start()
    checks = []

    async def drop_the_first_check(stream_info, reader, writer):
        checks.append(stream_info.peer_id)
        if len(checks) == 1:
            writer.close()
            return
        await reachability._handle_check(stream_info, reader, writer)

    async def start_helper():
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        await p2p.add_binary_stream_handler(reachability.PROTOCOL, drop_the_first_check)
        return p2p, [str(address) for address in await p2p.get_visible_maddrs()]

    helper, addresses = asyncio.run_coroutine_threadsafe(start_helper(), loop).result(60)
    try:
        verdict = reachability.probe_reachability(addresses, host="127.0.0.1")
        assert verdict.reachable is True and len(checks) == 2, verdict.explain()
        [answer] = verdict.answers
        assert answer.observed_address == "127.0.0.1" and answer.problem is None, answer
    finally:
        asyncio.run_coroutine_threadsafe(helper.shutdown(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
