"""A malicious volunteer for the robust-aggregation tests and benchmark: it poisons the gradients it averages.

Run as ``python tests/helpers/byzantine_peer.py --scale -1000 join --preset tiny ...``: the same peer as
``collab-kit join ...`` (same options, same ``--events``), except that before each averaging round it
multiplies the gradients it sends by ``--scale``. It still reduces its span of the all-reduce
honestly and steps with what the swarm returns, so the attack is on what it sends, nothing else;
it serves no state to peers that fall behind (its own copy of the model drifts, see below).

Why -1000 rather than 1000 by default: LAMB (and Adam) hardly care about the scale of a gradient,
and the averaged gradients are clipped to ``max_grad_norm`` anyway, so a peer that sends its honest
gradients times 1000 only makes the swarm train on that one peer's batch: the loss still falls.
Times -1000 turns the plain mean into gradient ascent.

``start_byzantine_peer`` starts it as a subprocess with the same handling as any test peer
(collab_kit.roles.processes.PeerProcess: events, deadlines, kill of the whole process group);
``run_poisoned_swarm`` runs it beside 3 honest peers (tests/swarm/test_robust.py, benchmarks/robust_aggregation.py).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence

from collab_kit.roles.processes import PeerFailed, PeerProcess

SCRIPT = os.path.abspath(__file__)


class ScriptPeerProcess(PeerProcess):
    """PeerProcess running ``python SCRIPT ARGS...`` instead of ``python -m collab_kit.cli ARGS...``."""

    def __init__(self, name: str, script: str, args: Sequence[str], log_path: str, env: dict[str, str] | None = None):
        super().__init__(name, args, log_path, env=env, command=(sys.executable, script))


def start_byzantine_peer(name: str, scale: float, args: Sequence[str], log_path: str) -> PeerProcess:
    """Start the malicious peer: ``args`` are those of ``collab-kit`` (e.g. ``["join", "--preset", "tiny", ...]``)."""
    return ScriptPeerProcess(name, SCRIPT, ["--scale", repr(float(scale)), *args], log_path)


# A short global epoch (1024 samples) with a longer matchmaking (3 s) so that the 4 peers mostly average in
# one group. State averaging (plain mean of parameters) is off: this test is about the gradients; a
# malicious peer could poison the parameters through state averaging, which CenteredClip does not cover.
SWARM_SETTINGS = (
    "optimizer.target_batch_size=1024",
    "optimizer.matchmaking_time=3.0",
    "optimizer.compression_threshold=1024",
    "optimizer.average_state_every=1000",
)


def run_poisoned_swarm(
    aggregation: str,
    scale: float,
    epochs: int,
    shards: str,
    log_dir: str,
    run_id: str,
    extra_settings: Sequence[str] = (),
):
    """4 peers of the tiny preset, one of which sends its gradients times ``scale``: the honest peers' epoch losses.

    :param extra_settings: more ``--set`` values for every peer (``optimizer.local_steps=H``: the local-update mode,
      where the attacker sends its pseudo-gradients times ``scale``)
    """
    settings = [
        arg
        for setting in (*SWARM_SETTINGS, f"optimizer.aggregation='{aggregation}'", *extra_settings)
        for arg in ("--set", setting)
    ]
    common = [
        "join",
        "--preset",
        "tiny",
        "--run-id",
        run_id,
        "--host",
        "127.0.0.1",
        "--data",
        shards,
        "--threads",
        "1",
        "--events",
        "--no-progress",
        "--wait-for-peers",
        "4",
        "--max-epochs",
        str(epochs),
        *settings,
    ]
    peers = []
    try:
        attacker = start_byzantine_peer("byzantine", scale, common, f"{log_dir}/byzantine-{aggregation}{scale:g}.log")
        peers.append(attacker)
        addresses = attacker.wait_for(lambda e: e["type"] == "ready", timeout=60, what="its address")["addresses"]
        honest = [
            PeerProcess(
                f"honest-{i}",
                common + ["--initial-peers", *addresses],
                f"{log_dir}/honest-{i}-{aggregation}{scale:g}.log",
            )
            for i in range(3)
        ]
        peers += honest
        for peer in honest:
            code = peer.wait_exit(timeout=240)
            if code != 0:
                raise PeerFailed(f"{peer.name} exited with code {code}:\n{peer.log_tail()}")
        return [
            [(e["epoch"], e["loss"], e["group_size"]) for e in peer.events if e["type"] == "epoch"] for peer in honest
        ]
    finally:
        for peer in peers:
            peer.kill()


def loss_ratio(epochs_by_peer, window: int = 3) -> float:
    """Mean loss of the honest peers' last ``window`` epochs over that of their first ``window``."""
    first = [loss for epochs in epochs_by_peer for _, loss, _ in epochs[:window]]
    last = [loss for epochs in epochs_by_peer for _, loss, _ in epochs[-window:]]
    return (sum(last) / len(last)) / (sum(first) / len(first))


def main(argv: list[str]) -> int:
    import torch
    from hivemind.optim.grad_averager import GradientAverager

    from collab_kit.cli import join
    from collab_kit.cli import main as collab_kit_main
    from collab_kit.roles.volunteer import Volunteer
    from collab_kit.swarm import robust
    from collab_kit.swarm.averagers import TRAINER_ROLE, compose_averager, round_report_averager_class
    from collab_kit.swarm.local_updates import mode_averager_class
    from collab_kit.swarm.optimizer import make_optimizer

    if len(argv) < 2 or argv[0] != "--scale":
        print("usage: byzantine_peer.py --scale FACTOR join OPTIONS...", file=sys.stderr)
        return 2
    scale, argv = float(argv[1]), argv[2:]

    class PoisonedGradientsMixin:
        """Sends its gradients times ``scale``. It sets no rpc_name_prefix: composed, it keeps the honest class's RPC
        name, so honest peers take it for one of theirs."""

        @torch.no_grad()
        def load_accumulators_into_averager_(self):  # where local gradients become what is averaged
            super().load_accumulators_into_averager_()
            with self.get_tensors() as averaged_grads:
                for grad in averaged_grads:
                    grad.mul_(scale)

    def poisoned(averager_class):
        return compose_averager(averager_class, PoisonedGradientsMixin)

    def poisoned_make_optimizer(model, dht, run_id, config, **kwargs):
        # the averager the swarm's honest peers build, the kit's fixes of hivemind's streams included (this peer
        # reduces its own span with it, honestly); in local-update mode, what it sends is its pseudo-gradient
        # (collab_kit.swarm.local_updates)
        mode_class = mode_averager_class(round_report_averager_class(GradientAverager, TRAINER_ROLE), config)
        honest_class = mode_class if config.aggregation == "mean" else robust.with_centered_clip(mode_class)
        kwargs["grad_averager_factory"] = robust.grad_averager_factory(
            config.aggregation,
            config.clip_tau,
            config.clip_iterations,
            poisoned(honest_class),
            request_timeout=min(3.0, config.matchmaking_time / 2),
        )
        optimizer = make_optimizer(model, dht, run_id, config, **kwargs)
        # It serves no state to peers that fall behind. Its own copy of the model drifts: what it gets back from
        # each round is the difference from its x1000 gradients, sent in 8 bits. An honest peer that downloaded
        # that copy would train on from a worse model, and without state averaging would stay there: poisoned
        # state is another attack, which CenteredClip does not cover. (In one CI run two honest peers' losses rose
        # from epoch 4 on, as the attacker's own does, while the third's fell: the ratio came out 1.027.)
        optimizer.state_averager.allow_state_sharing = False
        return optimizer

    # `collab-kit join`, with a volunteer whose optimizer is built by poisoned_make_optimizer (its seam)
    make_volunteer = functools.partial(Volunteer.from_config, optimizer_factory=poisoned_make_optimizer)
    print(f"byzantine peer: sending gradients x {scale}", flush=True)
    return collab_kit_main(argv, handlers={"join": functools.partial(join.run, make_volunteer=make_volunteer)})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
