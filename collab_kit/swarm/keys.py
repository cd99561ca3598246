"""A run's DHT keys, in one place: the peers that write them and the monitor that reads them must agree.

Every key starts with the run id, so runs that share a DHT never read each other's records. Three of them are
hivemind's own (1.1.12, pinned): its ProgressTracker publishes under ``<run_id>_progress`` and its Optimizer names
its averagers ``<run_id>_grad_averager`` and ``<run_id>_state_averager``. They are spelled here too because the
monitor reads the progress and downloads the state with no Optimizer of its own; a rename in one place only would
leave it waiting for records nobody writes.
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
    """Each anchor's join addresses, under its public key (collab_kit.swarm.anchor_records.publish_anchor): every join line a
    monitor prints lists them all."""
    return f"{run_id}_anchors"
