"""A monitor database with a made-up run in it, written the way the monitor writes one.

Each poll is what the monitor would have read from the DHT: the alive peers' signed records
(collab_kit.swarm.metrics.PeerMetrics), summarized, then stored with RunHistory.record(). Used by the
dashboard's tests and the dashboard notebook's test.
"""

import math
from collections.abc import Sequence

from collab_kit.model.checkpoint import checkpoint_name
from collab_kit.roles.run_history import RunHistory
from collab_kit.swarm.metrics import PeerMetrics, summarize

START = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC
POLL_EVERY = 30.0
# names come from peers: the last two would break a page that does not escape them
NAMES = (
    "alice",
    "bob",
    "carol_the_volunteer",
    "<script>document.title='pwned'</script>",
    "<img src=x onerror=alert(1)>&amp;",
)


def write_example_history(path: str, polls: int = 24, names: Sequence[str] = NAMES, checkpoints: int = 2) -> dict:
    """Write ``polls`` polls of a run where peer i joins at poll 2*i and trains faster the lower its i.

    :returns: what a reader should find: the names, the last epoch and the polls' count
    """
    with RunHistory(path) as history:
        for poll in range(polls):
            now = START + poll * POLL_EVERY
            records = []
            for i, name in enumerate(names):
                joined = 2 * i
                if poll < joined:
                    continue
                polls_alive = poll - joined + 1
                speed = 40.0 / (i + 1)  # samples per second: alice does the most work
                record = PeerMetrics(
                    peer_id=f"12D3KooWPeer{i}",
                    username=name,
                    epoch=poll,
                    samples_per_second=speed,
                    samples_accumulated=int(speed * POLL_EVERY * polls_alive),
                    loss=6.0 * math.exp(-poll / 10) + 0.5 + 0.05 * i,
                    mini_steps=4 + i,
                    compute_seconds=POLL_EVERY * polls_alive * 0.9,
                    time=now - 1.0,
                    # alice brings a GPU, the others their CPUs
                    device="Tesla T4" if i == 0 else "cpu",
                    precision="fp16" if i == 0 else "fp32",
                )
                records.append((f"key-{i}".encode(), record, name))
            history.record(
                summarize([record for _, record, _ in records], now=now),
                [(key, record, name) for key, record, name in records],
            )
        for k in range(checkpoints):
            epoch = (k + 1) * polls // (checkpoints + 1)
            history.record_checkpoint(
                epoch,
                f"monitor/checkpoints/{checkpoint_name(epoch)}",
                START + epoch * POLL_EVERY,
                pushed_to="org/model" if k % 2 else None,
            )
    return dict(names=list(names), last_epoch=polls - 1, polls=polls)
