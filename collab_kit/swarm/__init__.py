"""The swarm: peers that find each other in a DHT and train as one, through hivemind.

- ``dht``: starting a peer's DHT, the addresses it gives others (join lines), reachability found out on joining,
  presence.
- ``watchdog``: staying in the swarm: the watchdog tells a cut link and its return, and dials again when a peer has
  lost every neighbour.
- ``reachability``: can the swarm's peers dial this one back? (the probe and the answering service).
- ``p2p_fixes``: fixes of hivemind's processes (an answer to a call already given up on no longer stops every later
  answer; a DHT request whose sender is gone no longer ends the DHT's process), installed before any daemon starts.
- ``keys``: the run's DHT keys, in one place.
- ``optimizer``: ``CollaborativeOptimizer`` (hivemind.Optimizer with the kit's rounds, schedule and state downloads)
  and ``make_optimizer``; ``lamb``: 8-bit LAMB, its schedule, and gradient compression; ``local_updates``: the
  local-update mode (DiLoCo), in which peers take their own steps and average pseudo-gradients once a round;
  ``four_bit``: pseudo-gradients in 4 bits (a scale per block of 64), with error feedback; ``fragments``: the
  parameters averaged in fragments, one a round, in turn.
- ``progress``: the swarm's progress as a peer reads it (hivemind's tracker, telling anchors from training peers, and
  publishing this peer's record once per period within an epoch rather than at every step).
- ``averagers``: how hivemind averagers are composed (one RPC naming rule) and the mixins the kit puts in front;
  ``runners``: each round's all-reduce runner, and each member's mode in it (an auxiliary anchor only reduces; a
  4-bit part's average comes back the same to every member).
- ``kept_tasks``: the calls hivemind runs as tasks nobody holds (down an averager's pipe, in the DHT's process), held
  until they end, so that no garbage collection destroys one half-way.
- ``direct_state``: states passed between the peers a trainer names: volunteers behind NAT give theirs to the anchors.
- ``streams``: the streams of rounds and matchmaking end with the caller's close once it has every message.
- ``robust``: CenteredClip, the aggregation that outweighs a peer sending bad gradients.
- ``anchor``: the peer that accepts connections and holds averaging groups open for volunteers behind NAT (beside
  another anchor it only reduces); ``anchor_records``: each anchor's signed addresses in the DHT.
- ``membership``: joining a run the same way for every peer (token, client mode, DHT, the run's card, binding), and
  leaving it.
- ``run_card``: the run's shared settings and data, published signed by its first peer; what a joining peer compares
  its own with, and the data it streams when it names none.
- ``bindings``: peer ids bound to access tokens in the DHT, and the gate the averagers ask in an authorized run.
- ``metrics``: each peer's signed metrics record, and what the monitor reads of them; ``liveness``: which peers answer
  now (connected, or dialled at once).
"""

from typing import TYPE_CHECKING

from collab_kit.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "dht": [
            "start_dht",
            "join_addresses",
            "join_command",
            "join_instructions",
            "resolve_reachability",
            "wait_for_peers",
            "SwarmConnectionError",
        ],
        "watchdog": ["SwarmWatchdog"],
        "reachability": ["probe_reachability", "ReachabilityVerdict"],
        "p2p_fixes": ["install_p2p_fixes"],
        "optimizer": ["make_optimizer", "CollaborativeOptimizer"],
        "progress": ["SwarmProgressTracker", "is_anchor_record"],
        "lamb": ["make_lamb8bit", "LAMB8bit", "gradient_compression", "parameter_groups"],
        "local_updates": ["OuterNesterovSGD", "with_local_updates", "mode_averager_class"],
        "averagers": ["compose_averager"],
        "robust": ["centered_clip", "grad_averager_factory", "with_centered_clip", "AGGREGATIONS"],
        "anchor": ["Anchor", "AnchorError"],
        "membership": ["SwarmMembership", "authorize"],
        "run_card": ["RunCard", "RunMismatch", "DataMismatch", "find_run_card", "check_fits_run", "choose_data"],
        "bindings": ["PeerGate", "BindingKeeper", "publish_peer_binding", "authorized_averager_class"],
        "metrics": ["MetricsPublisher", "PeerMetrics", "SwarmSnapshot", "read_metrics", "summarize"],
    },
)

if TYPE_CHECKING:  # editors and type checkers follow these; at run time each loads on first use
    from collab_kit.swarm.anchor import Anchor as Anchor
    from collab_kit.swarm.anchor import AnchorError as AnchorError
    from collab_kit.swarm.averagers import compose_averager as compose_averager
    from collab_kit.swarm.bindings import BindingKeeper as BindingKeeper
    from collab_kit.swarm.bindings import PeerGate as PeerGate
    from collab_kit.swarm.bindings import authorized_averager_class as authorized_averager_class
    from collab_kit.swarm.bindings import publish_peer_binding as publish_peer_binding
    from collab_kit.swarm.dht import SwarmConnectionError as SwarmConnectionError
    from collab_kit.swarm.dht import join_addresses as join_addresses
    from collab_kit.swarm.dht import join_command as join_command
    from collab_kit.swarm.dht import join_instructions as join_instructions
    from collab_kit.swarm.dht import resolve_reachability as resolve_reachability
    from collab_kit.swarm.dht import start_dht as start_dht
    from collab_kit.swarm.dht import wait_for_peers as wait_for_peers
    from collab_kit.swarm.lamb import LAMB8bit as LAMB8bit
    from collab_kit.swarm.lamb import gradient_compression as gradient_compression
    from collab_kit.swarm.lamb import make_lamb8bit as make_lamb8bit
    from collab_kit.swarm.lamb import parameter_groups as parameter_groups
    from collab_kit.swarm.local_updates import OuterNesterovSGD as OuterNesterovSGD
    from collab_kit.swarm.local_updates import mode_averager_class as mode_averager_class
    from collab_kit.swarm.local_updates import with_local_updates as with_local_updates
    from collab_kit.swarm.membership import SwarmMembership as SwarmMembership
    from collab_kit.swarm.membership import authorize as authorize
    from collab_kit.swarm.metrics import MetricsPublisher as MetricsPublisher
    from collab_kit.swarm.metrics import PeerMetrics as PeerMetrics
    from collab_kit.swarm.metrics import SwarmSnapshot as SwarmSnapshot
    from collab_kit.swarm.metrics import read_metrics as read_metrics
    from collab_kit.swarm.metrics import summarize as summarize
    from collab_kit.swarm.optimizer import CollaborativeOptimizer as CollaborativeOptimizer
    from collab_kit.swarm.optimizer import make_optimizer as make_optimizer
    from collab_kit.swarm.p2p_fixes import install_p2p_fixes as install_p2p_fixes
    from collab_kit.swarm.progress import SwarmProgressTracker as SwarmProgressTracker
    from collab_kit.swarm.progress import is_anchor_record as is_anchor_record
    from collab_kit.swarm.reachability import ReachabilityVerdict as ReachabilityVerdict
    from collab_kit.swarm.reachability import probe_reachability as probe_reachability
    from collab_kit.swarm.robust import AGGREGATIONS as AGGREGATIONS
    from collab_kit.swarm.robust import centered_clip as centered_clip
    from collab_kit.swarm.robust import grad_averager_factory as grad_averager_factory
    from collab_kit.swarm.robust import with_centered_clip as with_centered_clip
    from collab_kit.swarm.run_card import DataMismatch as DataMismatch
    from collab_kit.swarm.run_card import RunCard as RunCard
    from collab_kit.swarm.run_card import RunMismatch as RunMismatch
    from collab_kit.swarm.run_card import check_fits_run as check_fits_run
    from collab_kit.swarm.run_card import choose_data as choose_data
    from collab_kit.swarm.run_card import find_run_card as find_run_card
    from collab_kit.swarm.watchdog import SwarmWatchdog as SwarmWatchdog
