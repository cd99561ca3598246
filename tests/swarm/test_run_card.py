"""The run's card on real DHTs (127.0.0.1): published signed by the run's first peer, read and compared by a peer that
joins, out of reach of anyone else's pen; and which data a peer trains on."""

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from collab_kit.config import SwarmConfig, get_preset
from collab_kit.data.synthetic import SYNTHETIC
from collab_kit.swarm.dht import join_addresses, start_dht
from collab_kit.swarm.run_card import (
    KEY_PREFIX,
    RUNS_KEY,
    DataMismatch,
    RunCard,
    RunCardKeeper,
    RunCardSchema,
    RunMismatch,
    check_fits_run,
    choose_data,
    find_run_card,
    read_run_cards,
    run_card_validators,
)

ELSEWHERE = "/ip4/10.77.0.10/tcp/31337/p2p/12D3KooWBmwXN3rsVfnLsZKbXeBrSLfczHxZHwVjPrbKwpLfYm3t"


@pytest.fixture
def swarm():
    """The run's first peer and a peer that joined it, each DHT with the card's validators."""
    first = start_dht(SwarmConfig(host="127.0.0.1"), record_validators=run_card_validators())
    joined = start_dht(SwarmConfig(initial_peers=join_addresses(first)), record_validators=run_card_validators())
    yield first, joined
    joined.shutdown()
    first.shutdown()


def test_a_joining_peer_reads_the_runs_card_and_nobody_else_can_rewrite_it(swarm):
    first, joined = swarm
    addresses = join_addresses(first)
    config = get_preset("tiny", swarm=dict(run_id="card_run"), optimizer=dict(target_batch_size=8192))
    keeper = RunCardKeeper(first, RunCard.of(config, "someone/codes", author=first.peer_id.to_base58()))
    try:
        card = find_run_card(joined, "card_run", addresses)
        assert (card.run_id, card.preset, card.data, card.author) == (
            "card_run",
            "tiny",
            "someone/codes",
            first.peer_id.to_base58(),
        )
        assert card.run_config().optimizer.target_batch_size == 8192
        assert "--set optimizer.target_batch_size=8192 --data someone/codes" in " ".join(card.join_options())
        check_fits_run(config, card, addresses)  # the run's own settings fit
        with pytest.raises(RunMismatch, match="optimizer.target_batch_size=2048 where the run has 8192"):
            check_fits_run(get_preset("tiny", swarm=dict(run_id="card_run")), card, addresses)
        with pytest.raises(RunMismatch, match="trains run 'card_run', not 'other_run'"):
            find_run_card(joined, "other_run", addresses, timeout=1)

        # another key cannot write under the author's: an unsigned (or wrongly signed) record is refused by every
        # DHT node that holds the validators
        pen = RSASignatureValidator(RSAPrivateKey())  # the intruder's own key (its DHT's process gets a copy)
        intruder = hivemind.DHT(
            initial_peers=addresses,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            start=True,
            record_validators=[SchemaValidator(RunCardSchema, prefix=KEY_PREFIX), pen],
        )
        try:
            forged = RunCard.of(get_preset("tiny", swarm=dict(run_id="card_run")), "evil/codes", author="me")
            author_key = RSASignatureValidator().local_public_key  # this process's key: the first peer's
            assert not intruder.store(
                RUNS_KEY, subkey=author_key, value=forged.to_record(), expiration_time=get_dht_time() + 60
            )
            # its own card of the run is signed and stored, and is newer; a peer that joined through the first
            # peer still takes the first peer's
            own_key = pen.local_public_key
            assert intruder.store(
                RUNS_KEY, subkey=own_key, value=forged.to_record(), expiration_time=get_dht_time() + 60
            )
            # a value that is not a card is refused by the schema, even under its own key
            assert not intruder.store(
                RUNS_KEY, subkey=own_key, value=dict(run_id="card_run"), expiration_time=get_dht_time() + 60
            )
        finally:
            intruder.shutdown()
        cards = read_run_cards(joined)
        assert sorted(c.data for c in cards) == ["evil/codes", "someone/codes"], cards
        assert find_run_card(joined, "card_run", addresses).data == "someone/codes"
    finally:
        keeper.stop()


def test_a_swarm_with_no_card_is_said_and_waited_for_no_longer_than_asked(swarm):
    first, joined = swarm
    assert find_run_card(joined, "no_card_run", join_addresses(first), timeout=1.5) is None


def test_a_peer_trains_on_its_own_data_else_the_runs_and_on_synthetic_data_only_where_it_may():
    here = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWBmwXN3rsVfnLsZKbXeBrSLfczHxZHwVjPrbKwpLfYm3t"
    joining = get_preset("tiny", swarm=dict(run_id="r", initial_peers=[ELSEWHERE]))
    local = get_preset("tiny", swarm=dict(run_id="r", initial_peers=[here]))
    first = get_preset("tiny", swarm=dict(run_id="r"))
    named = RunCard.of(first, "someone/codes", author="a")
    unnamed = RunCard.of(first, None, author="a")
    assert choose_data("mine", named, joining) == "mine"
    assert choose_data(None, named, joining, synthetic_fallback=True) == "someone/codes"
    # synthetic data for a swarm of one's own or one on this machine, never for a run elsewhere that did not choose it
    assert choose_data(None, None, first, synthetic_fallback=True) == SYNTHETIC
    assert choose_data(None, unnamed, local, synthetic_fallback=True) == SYNTHETIC
    with pytest.raises(DataMismatch, match="run 'r' names no data .* pass DATA_SHARDS"):
        choose_data(None, unnamed, joining, setting="DATA_SHARDS", synthetic_fallback=True)
    with pytest.raises(DataMismatch, match="publishes no data for run 'r'"):
        choose_data(None, None, joining, synthetic_fallback=True)
    with pytest.raises(DataMismatch, match="a new swarm needs data: pass --data"):
        choose_data(None, None, first)
    # a run that chose synthetic data says so: every peer makes its own
    assert choose_data(None, RunCard.of(first, SYNTHETIC, author="a"), joining) == SYNTHETIC
