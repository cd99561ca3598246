"""Joining a run, the same way for every peer: the access token, client mode, the DHT, the token's binding.

A volunteer and the monitor both join a swarm in these steps, and leave it in the reverse order:

1. in a run with an authentication server, log in to Hugging Face and get a signed access token (``authorize``);
2. find out whether others can dial this peer, unless the settings say (collab_kit.swarm.dht.resolve_reachability);
3. start the DHT, with the token on every message;
4. publish the binding of this peer's id to its token, and build the gate its averagers ask
   (collab_kit.swarm.bindings).

    with SwarmMembership(config) as membership:
        optimizer = make_optimizer(model, membership.dht, ..., peer_gate=membership.peer_gate)
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from collab_kit.auth.client import AuthorizationError, HubAuthorizer, login
from collab_kit.config import RunConfig, SwarmConfig
from collab_kit.swarm.bindings import BindingKeeper, PeerGate
from collab_kit.swarm.dht import resolve_reachability, start_dht

logger = logging.getLogger(__name__)


def authorize(swarm_config: SwarmConfig) -> Optional[HubAuthorizer]:
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
    """

    def __init__(self, config: RunConfig, authorizer: Optional[HubAuthorizer] = None, **dht_kwargs):
        self.authorizer = authorizer if authorizer is not None else authorize(config.swarm)
        swarm_config, self.reachability = resolve_reachability(config.swarm)
        self.config = dataclasses.replace(config, swarm=swarm_config)
        if self.authorizer is not None:
            dht_kwargs["authorizer"] = self.authorizer
        self.dht = start_dht(swarm_config, **dht_kwargs)
        self.binding_keeper: Optional[BindingKeeper] = None
        self.peer_gate: Optional[PeerGate] = None
        self._closed = False
        try:
            if self.authorizer is not None:
                self.binding_keeper = BindingKeeper(self.dht, self.authorizer, swarm_config.run_id)
                self.peer_gate = PeerGate(self.dht, swarm_config.run_id,
                                          self.authorizer.server_public_key.to_bytes())
        except BaseException:
            self.close()
            raise

    @property
    def username(self) -> Optional[str]:
        """The Hugging Face user this peer trains for, in an authorized run (None in an open one)."""
        return self.authorizer.username if self.authorizer is not None else None

    def close(self) -> None:
        """Stop publishing the binding, then leave the DHT (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.binding_keeper is not None:
                self.binding_keeper.stop()
        finally:
            self.dht.shutdown()

    def __enter__(self) -> "SwarmMembership":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
