"""A run's DHT keys, in one place: the peers that write them and the monitor that reads them must agree.

Every key starts with the run id. Three are hivemind 1.1.12's own, spelled here for the monitor, which has no
Optimizer (tests/swarm/test_keys_and_averagers.py::test_the_keys_the_monitor_reads_are_those_hivemind_writes).
"""


def progress_key(run_id: str) -> str:
    """Each peer's training progress (hivemind's ProgressTracker: samples, epoch, throughput)."""
    return f"{run_id}_progress"


def grad_averager_prefix(run_id: str) -> str:
    """The gradient averagers' matchmaking and RPC prefix (hivemind's Optimizer)."""
    return f"{run_id}_grad_averager"


def state_averager_prefix(run_id: str) -> str:
    """The state averagers' prefix: state downloads and parameter averaging (hivemind's Optimizer)."""
    return f"{run_id}_state_averager"


def metrics_key(run_id: str) -> str:
    """Each peer's signed metrics record (collab_kit.swarm.metrics)."""
    return f"{run_id}_metrics"


def presence_key(run_id: str) -> str:
    """Peers announce themselves here before their first step (collab_kit.swarm.dht.announce_presence)."""
    return f"{run_id}_present"


def peer_tokens_key(run_id: str) -> str:
    """Each peer's access token bound to its peer id, in an authorized run (collab_kit.swarm.bindings)."""
    return f"{run_id}_peer_tokens"


def anchors_key(run_id: str) -> str:
    """Each anchor's join addresses, under its public key (collab_kit.swarm.anchor_records.publish_anchor): every
    join line a monitor prints lists them all."""
    return f"{run_id}_anchors"
