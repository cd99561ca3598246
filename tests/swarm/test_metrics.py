"""Per-peer metrics records in a real DHT on 127.0.0.1: published, read, and forged ones refused."""

import math
import re

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from collab_kit.swarm.keys import metrics_key
from collab_kit.swarm.metrics import MetricsPublisher, PeerMetrics, metrics_validators, read_metrics, summarize


@pytest.fixture(scope="module")
def dht_pair():
    """Two DHT peers on 127.0.0.1, shared by the tests of this file (each test uses a run id of its own)."""
    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = hivemind.DHT(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(a) for a in first.get_visible_maddrs()], start=True
    )
    try:
        yield first, second
    finally:
        second.shutdown()
        first.shutdown()


@pytest.fixture
def two_dhts(dht_pair):
    return dht_pair


@pytest.fixture
def run_id(request) -> str:
    """A run id of this test's own: no record of another test is under its key in the shared DHT."""
    return "test_metrics_" + re.sub(r"\W", "_", request.node.name)


def honest_record(dht, **changes) -> dict:
    fields = dict(
        peer_id=dht.peer_id.to_base58(),
        username=None,
        epoch=3,
        samples_per_second=12.5,
        samples_accumulated=640,
        loss=2.5,
        mini_steps=10,
        compute_seconds=30.0,
        time=get_dht_time(),
        averaged_with=None,
        lone_epochs=None,
        lone_reason=None,
        device=None,
        precision=None,
        activity=None,
    )
    fields.update(changes)
    return fields


def test_a_published_record_is_read_by_another_peer_and_summarized(two_dhts, run_id):
    first, second = two_dhts
    second.add_validators(metrics_validators(run_id))
    publisher = MetricsPublisher(first, run_id)
    publisher.add_work(samples=64, seconds=2.0)
    publisher.add_work(samples=64, seconds=2.0)
    assert publisher.publish(epoch=5, loss=3.25, mini_steps=8, samples_per_second=32.0)
    records = read_metrics(second, run_id)
    assert len(records) == 1
    subkey, record = records[0]
    assert subkey == publisher.public_key_subkey
    assert (record.epoch, record.samples_accumulated, record.compute_seconds, record.loss) == (5, 128, 4.0, 3.25)
    assert record.peer_id == first.peer_id.to_base58() and record.username is None
    snapshot = summarize([record, PeerMetrics(**honest_record(second, epoch=4, loss=2.0, mini_steps=24))])
    assert snapshot.epoch == 5 and snapshot.alive_peers == 2
    assert math.isclose(snapshot.loss, (8 * 3.25 + 24 * 2.0) / 32)
    assert math.isclose(snapshot.samples_per_second, 32.0 + 12.5)
    assert not publisher.publish(epoch=6, loss=float("nan"), mini_steps=8, samples_per_second=1.0)


def test_a_record_under_another_peers_key_is_refused(two_dhts, run_id):
    victim_dht, reader = two_dhts
    reader.add_validators(metrics_validators(run_id))
    victim = MetricsPublisher(victim_dht, run_id)
    assert victim.publish(epoch=2, loss=3.0, mini_steps=4, samples_per_second=8.0)

    # the forger: a third peer with a key of its own, writing under the victim's public key
    forger = hivemind.DHT(
        initial_peers=[str(a) for a in reader.get_visible_maddrs()], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True
    )
    try:
        forger.add_validators(metrics_validators(run_id, RSASignatureValidator(RSAPrivateKey())))
        forged = honest_record(forger, samples_accumulated=10**9, time=get_dht_time() + 1)
        stored = forger.store(
            metrics_key(run_id), subkey=victim.public_key_subkey, value=forged, expiration_time=get_dht_time() + 60
        )
        assert not stored
        # a forger whose DHT has no validators at all sends it unsigned: the others refuse it
        forger_without_validators = hivemind.DHT(
            initial_peers=[str(a) for a in reader.get_visible_maddrs()],
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            start=True,
        )
        try:
            forger_without_validators.store(
                metrics_key(run_id), subkey=victim.public_key_subkey, value=forged, expiration_time=get_dht_time() + 60
            )
        finally:
            forger_without_validators.shutdown()
    finally:
        forger.shutdown()
    records = dict(read_metrics(reader, run_id))
    assert set(records) == {victim.public_key_subkey}
    assert records[victim.public_key_subkey].samples_accumulated == 0  # the victim's own record, untouched
    assert records[victim.public_key_subkey].peer_id == victim_dht.peer_id.to_base58()


@pytest.mark.parametrize(
    "change",
    [
        dict(loss="2.5"),
        dict(samples_accumulated=-1),
        dict(loss=float("inf")),
        dict(epoch=1.5),
        dict(extra_field="x"),
        dict(peer_id=""),
    ],
    ids=["loss-as-text", "negative-samples", "infinite-loss", "fractional-epoch", "unknown-field", "empty-peer-id"],
)
def test_a_record_with_a_bad_schema_is_refused(two_dhts, run_id, change):
    writer, reader = two_dhts
    reader.add_validators(metrics_validators(run_id))
    publisher = MetricsPublisher(writer, run_id)
    bad = honest_record(writer, **change)
    stored = writer.store(
        metrics_key(run_id), subkey=publisher.public_key_subkey, value=bad, expiration_time=get_dht_time() + 60
    )
    assert not stored
    assert read_metrics(reader, run_id) == []
    # and the same peer's well-formed record goes through
    assert writer.store(
        metrics_key(run_id),
        subkey=publisher.public_key_subkey,
        value=honest_record(writer),
        expiration_time=get_dht_time() + 60,
    )
    assert len(read_metrics(reader, run_id)) == 1


def test_a_record_under_a_subkey_without_a_public_key_is_refused(two_dhts, run_id):
    writer, reader = two_dhts
    reader.add_validators(metrics_validators(run_id))
    MetricsPublisher(writer, run_id)
    assert not writer.store(
        metrics_key(run_id), subkey=b"anyone", value=honest_record(writer), expiration_time=get_dht_time() + 60
    )
    assert read_metrics(reader, run_id) == []
