"""Joining a run, the same way for every peer: the access token, client mode, the DHT, the run's card, the binding.

A volunteer and the monitor both join a swarm in these steps, and leave it in the reverse order:

1. in a run with an authentication server, log in to Hugging Face and get a signed access token (``authorize``);
2. find out whether others can dial this peer, unless the settings say (collab_kit.swarm.dht.resolve_reachability);
3. start the DHT, with the token on every message;
4. a peer that joins through initial peers reads the run's card and checks that its settings fit the run
   (collab_kit.swarm.run_card: a run id, preset or shared setting of another run stops here, in one sentence);
   the run's first peer publishes the card once it knows the run's data (``announce_run``);
5. publish the binding of this peer's id to its token, and build the gate its averagers ask
   (collab_kit.swarm.bindings).

    with SwarmMembership(config) as membership:
        optimizer = make_optimizer(model, membership.dht, ..., peer_gate=membership.peer_gate)
"""

from __future__ import annotations

import dataclasses
import logging

from collab_kit.auth.client import AuthorizationError, HubAuthorizer, login
from collab_kit.config import RunConfig, SwarmConfig
from collab_kit.swarm.bindings import BindingKeeper, PeerGate
from collab_kit.swarm.dht import resolve_reachability, start_dht
from collab_kit.swarm.run_card import RunCard, RunCardKeeper, check_fits_run, find_run_card, run_card_validators

logger = logging.getLogger(__name__)


def authorize(swarm_config: SwarmConfig) -> HubAuthorizer | None:
    """A HubAuthorizer holding this peer's first token when the run has an authentication server, else None.

    :raises AuthorizationError: no Hugging Face token, or the server refused (its message says why)
    """
    if not swarm_config.auth_server:
        return None
    token = login()
    if token is None:
        raise AuthorizationError("log in to Hugging Face first (the form above), then run this again")
    authorizer = HubAuthorizer(swarm_config.auth_server, token)
    answer = authorizer.join()
    logger.info(f"joined run {swarm_config.run_id} as {answer.username}")
    return authorizer


class SwarmMembership:
    """This peer's membership of a run: built in the steps above, closed in the reverse order (also on a failure
    half-way, so nothing is left running).

    :param config: the run's configuration; ``self.config`` is it with client mode found out
    :param authorizer: a HubAuthorizer that has joined already (default: ``authorize(config.swarm)``)
    :param dht_kwargs: more arguments of hivemind.DHT (the monitor's ``record_validators``)
    :raises AuthorizationError: an authorized run refused this peer
    :raises collab_kit.swarm.dht.SwarmConnectionError: no initial peer could be reached
    :raises collab_kit.swarm.run_card.RunMismatch: the swarm trains another run, or this one with other settings
    """

    def __init__(self, config: RunConfig, authorizer: HubAuthorizer | None = None, **dht_kwargs):
        self.authorizer = authorizer if authorizer is not None else authorize(config.swarm)
        swarm_config, self.reachability = resolve_reachability(config.swarm)
        self.config = dataclasses.replace(config, swarm=swarm_config)
        if self.authorizer is not None:
            dht_kwargs["authorizer"] = self.authorizer
        dht_kwargs["record_validators"] = [*dht_kwargs.get("record_validators", ()), *run_card_validators()]
        self.dht = start_dht(swarm_config, **dht_kwargs)
        self.binding_keeper: BindingKeeper | None = None
        self.peer_gate: PeerGate | None = None
        # the run's card: read from the swarm by a peer that joins, made by the first peer (announce_run)
        self.run_card: RunCard | None = None
        self._card_keeper: RunCardKeeper | None = None
        self._closed = False
        try:
            if swarm_config.initial_peers:
                self.run_card = find_run_card(self.dht, swarm_config.run_id, swarm_config.initial_peers)
                if self.run_card is None:
                    logger.warning(
                        f"the swarm publishes no settings for run {swarm_config.run_id!r} (peers of an "
                        f"older collab_kit?): this peer cannot check that its own fit the run"
                    )
                else:
                    check_fits_run(self.config, self.run_card, swarm_config.initial_peers)
            if self.authorizer is not None:
                self.binding_keeper = BindingKeeper(self.dht, self.authorizer, swarm_config.run_id)
                self.peer_gate = PeerGate(self.dht, swarm_config.run_id, self.authorizer.server_public_key.to_bytes())
        except BaseException:
            self.close()
            raise

    @property
    def is_first_peer(self) -> bool:
        """Whether this peer started the swarm (it joined through no initial peer)."""
        return not self.config.swarm.initial_peers

    def announce_run(self, data: str | None) -> RunCard:
        """Publish this run's card with ``data`` (the run's data as peers elsewhere name it) and keep it in the DHT
        until ``close``: what the run's first peer and its monitor do."""
        if self._card_keeper is not None:
            self._card_keeper.stop()
        self.run_card = RunCard.of(self.config, data, author=self.dht.peer_id.to_base58())
        self._card_keeper = RunCardKeeper(self.dht, self.run_card)
        return self.run_card

    @property
    def username(self) -> str | None:
        """The Hugging Face user this peer trains for, in an authorized run (None in an open one)."""
        return self.authorizer.username if self.authorizer is not None else None

    def close(self) -> None:
        """Stop publishing the binding, then leave the DHT (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._card_keeper is not None:
                self._card_keeper.stop()
            if self.binding_keeper is not None:
                self.binding_keeper.stop()
        finally:
            self.dht.shutdown()

    def __enter__(self) -> SwarmMembership:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
