"""Volunteers behind NAT on capped links (the network lab): time per global epoch against the ideal, and bytes.

A network lab (tests/helpers/netlab.py) with the run's monitor on a public host (its anchor reduces every round)
and volunteers each behind their own NAT router, every volunteer's link capped at 100, 20 and 5 Mbit/s in
turn (tc tbf, each direction). Each volunteer is a simulated peer as in the swarm-scaling benchmark: the
`small` preset's real model, real gradients, the kit's real optimizer (hivemind.Optimizer, 8-bit
compression of large tensors, fp16 of small ones), client mode decided by the reachability probe; only
the compute is simulated (a real forward / backward of one sample of the micro-batch, then a sleep up to
``compute_seconds``, standing in for an accelerator so that 2 cores are not what limits the swarm).

``python -m benchmarks.internet_links`` measures and updates RESULTS.md; ``--peer ...`` is one simulated
volunteer (what the benchmark starts inside a home of the lab).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks import common
from benchmarks.swarm_scaling import epoch_end_times, step_on_simulated_accelerator, stop_peers

RATES = (100.0, 20.0, 5.0)  # Mbit/s, each volunteer's link, each direction
TARGET_RATE = 20.0  # the rate at which measured / ideal is the target
TARGET_RATIO = 1.3
BYTES_TOLERANCE = 0.10  # bytes counted on the links vs predicted from the compression
START_TIMEOUT = 180


@dataclass
class Setting:
    """The simulated swarm (the same at every link rate, so that only the rate changes)."""

    volunteers: int = 3
    target_batch_size: int = 1024
    micro_batch: int = 16
    compute_seconds: float = 0.4  # one micro-batch on the simulated accelerator
    warmup_epochs: int = 2
    measured_epochs: int = 4

    @property
    def compute_time(self) -> float:
        """Seconds of compute per epoch: the target batch over the volunteers' summed throughput."""
        return self.target_batch_size / (self.volunteers * self.micro_batch / self.compute_seconds)


FULL = Setting()
QUICK = Setting(target_batch_size=512, warmup_epochs=1, measured_epochs=2)

TITLE = "Volunteers behind NAT on capped links (network lab): time per epoch vs ideal, and bytes on the links"
HOW = f"""
The network lab (`tests/helpers/netlab.py`, Linux network namespaces): `collab-kit monitor --preset small` on a public
host (its anchor leads and reduces every gradient round, its link uncapped), and {FULL.volunteers} volunteers each
behind its own NAT router (iptables MASQUERADE), every volunteer's link capped with tc tbf at 100, 20 and 5 Mbit/s
each way in turn. Each volunteer is `python -m benchmarks.internet_links --peer ...` inside its home: the `small`
preset's model and the kit's optimizer (`collab_kit.swarm.optimizer.make_optimizer`), client mode
chosen by the reachability probe (the monitor cannot dial it back); only the compute is simulated, a micro-batch of
{FULL.micro_batch} taking {FULL.compute_seconds:g} s (a real forward / backward of one of its samples on the CPU, then
a sleep
up to that time: the gradients are real, their bytes depend on the shapes only). Target batch {FULL.target_batch_size}:
{FULL.compute_time:.1f} s of compute per epoch for the swarm.

Time per epoch: the median over volunteers of the wall time at which each reached each global epoch; after
{FULL.warmup_epochs} warm-up epochs, the mean of the next {FULL.measured_epochs}. Ideal: the compute time plus the
bytes a
volunteer must move per epoch over its link at the capped rate, sent and received one after the other (its
compressed gradients up to the anchor, their average back: twice what hivemind's
SizeAdaptiveCompression makes of the model's gradients, 8-bit for tensors of 2^16 elements or more, fp16 below).
Target at {TARGET_RATE:g} Mbit/s: measured / ideal <= {TARGET_RATIO}.
Bytes: what each volunteer's router counted on its link (interface counters: IP and TCP headers, libp2p framing,
DHT traffic included) over the measured epochs, per epoch, against that prediction (the rows give both): within
{BYTES_TOLERANCE:.0%}.
"""


# ---------------------------------------------------------------------------------------------
# one simulated volunteer, inside a home of the lab


@contextlib.contextmanager
def small_preset_peer(args: argparse.Namespace):
    """A peer of the simulated swarm, as a volunteer builds it: the `small` preset's model with the run's seed, the
    kit's optimizer, client mode where the reachability probe says so. Yields (config, model, optimizer); shut down
    after."""
    from collab_kit.config import get_preset

    config = get_preset(
        "small",
        swarm=dict(run_id=args.run_id, initial_peers=args.initial_peers, host="0.0.0.0"),
        optimizer=dict(target_batch_size=args.target_batch_size, batch_size_per_step=args.micro_batch),
    )
    with volunteer_peer(config) as (model, optimizer):
        yield config, model, optimizer


@contextlib.contextmanager
def volunteer_peer(config):
    """``config``'s model with the run's seed and the kit's optimizer, as a volunteer builds them (client mode where
    the reachability probe says so, its state served to anchors): yields (model, optimizer); shut down after."""
    import torch

    from collab_kit.model.transformer import TextToImageTransformer, model_seed
    from collab_kit.swarm.dht import resolve_reachability, start_dht
    from collab_kit.swarm.optimizer import make_optimizer

    torch.set_num_threads(1)
    swarm, _ = resolve_reachability(config.swarm)
    dht = start_dht(swarm)
    optimizer = None
    try:
        torch.manual_seed(model_seed(config.swarm.run_id))
        model = TextToImageTransformer(config.model)
        optimizer = make_optimizer(model, dht, config.swarm.run_id, config.optimizer, client_mode=swarm.client_mode)
        optimizer.serve_state_to_anchors(swarm)  # as a volunteer does: anchors that only reduce serve its state
        yield model, optimizer
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()


def peer_main(args: argparse.Namespace) -> int:
    import torch

    from collab_kit.roles.processes import emit_event

    with small_preset_peer(args) as (config, model, optimizer):
        generator = torch.Generator().manual_seed(args.seed)
        emit_event("training", client_mode=bool(optimizer.client_mode), time=time.time())
        overlapped = 0.0
        while optimizer.local_epoch < args.epochs:
            started = time.perf_counter()
            text = torch.randint(
                1, config.model.text_vocab_size, (args.micro_batch, config.model.text_length), generator=generator
            )
            codes = torch.randint(
                0, config.model.codebook_size, (args.micro_batch, config.model.image_length), generator=generator
            )
            # the gradients are the model's real ones, of one sample of the micro-batch: 2 cores shared by the whole lab
            # cannot run every volunteer's full micro-batch in compute_seconds, and the bytes depend on shapes only
            model(text[:1], codes[:1]).loss.backward()
            overlapped, new_epoch = step_on_simulated_accelerator(optimizer, started, args.compute_seconds, overlapped)
            if new_epoch:
                emit_event("epoch", epoch=optimizer.local_epoch, time=time.time(), group_size=optimizer.last_group_size)
        emit_event("done")
    return 0


# ---------------------------------------------------------------------------------------------
# the lab, from the benchmark's process


def gradient_bytes() -> int:
    """What the kit's gradient compression makes of one set of the `small` preset's gradients (bytes on the wire)."""
    import torch
    from hivemind.compression import CompressionInfo

    from collab_kit.config import get_preset
    from collab_kit.model.transformer import TextToImageTransformer
    from collab_kit.swarm.lamb import gradient_compression

    config = get_preset("small")
    compression = gradient_compression(config.optimizer.compression_threshold)
    model = TextToImageTransformer(config.model)
    total = 0
    for param in model.parameters():
        tensor = torch.randn_like(param)
        total += compression.compress(tensor, CompressionInfo.from_tensor(tensor)).ByteSize()
    return total


def parameter_count() -> int:
    from collab_kit.config import get_preset
    from collab_kit.model.transformer import TextToImageTransformer, count_parameters

    return count_parameters(TextToImageTransformer(get_preset("small").model))


def measure(rate: float, setting: Setting, log_dir: str) -> dict:
    """One swarm in a fresh lab with every volunteer's link at ``rate`` Mbit/s."""
    from tests.helpers.netlab import NetworkLab

    epochs = setting.warmup_epochs + setting.measured_epochs
    run_id = f"bench_links_{int(rate)}_{os.getpid()}"
    pythonpath = os.pathsep.join(filter(None, [common.REPO_ROOT, os.environ.get("PYTHONPATH")]))
    with NetworkLab() as lab:
        server = lab.public_host("server")
        monitor = server.start(
            "monitor",
            [
                "monitor",
                "--preset",
                "small",
                "--run-id",
                run_id,
                "--host",
                "0.0.0.0",
                "--events",
                "--db",
                "",
                "--checkpoint-every",
                "0",
                "--set",
                f"optimizer.target_batch_size={setting.target_batch_size}",
                "--set",
                f"optimizer.batch_size_per_step={setting.micro_batch}",
            ],
            os.path.join(log_dir, f"{run_id}-monitor.log"),
        )
        addresses = monitor.wait_for(lambda e: e["type"] == "ready", timeout=START_TIMEOUT, what="its address")[
            "addresses"
        ]
        homes = [lab.home(f"home{i}") for i in range(setting.volunteers)]
        for home in homes:
            home.limit(rate)
        peers = [
            home.start(
                home.name,
                [
                    "--peer",
                    "--run-id",
                    run_id,
                    "--initial-peers",
                    *addresses,
                    "--epochs",
                    str(epochs),
                    "--target-batch-size",
                    str(setting.target_batch_size),
                    "--micro-batch",
                    str(setting.micro_batch),
                    "--compute-seconds",
                    repr(setting.compute_seconds),
                    "--seed",
                    str(index),
                ],
                os.path.join(log_dir, f"{run_id}-{home.name}.log"),
                env=dict(PYTHONPATH=pythonpath),
                command=(sys.executable, "-m", "benchmarks.internet_links"),
            )
            for index, home in enumerate(homes)
        ]
        try:
            for peer in peers:
                started = peer.wait_for(lambda e: e["type"] == "training", timeout=START_TIMEOUT, what="training")
                if not started["client_mode"]:
                    raise RuntimeError(f"{peer.name} is behind NAT but the probe did not put it in client mode")
            # the bytes of the measured epochs: counters read when most volunteers reach the first and the last
            counted = {}
            for mark in (setting.warmup_epochs, epochs):
                for peer in peers:
                    peer.wait_for(
                        lambda e: e["type"] == "epoch" and e["epoch"] >= mark,
                        timeout=60 + 20 * epochs * (setting.compute_time + 30),
                        what=f"epoch {mark}",
                    )
                counted[mark] = [home.link_bytes() for home in homes]
            for peer in peers:
                peer.wait_for(lambda e: e["type"] == "done", timeout=120, what="the end")
        finally:
            stop_peers(peers)
    ends = epoch_end_times([[e for e in peer.events if e["type"] == "epoch"] for peer in peers])
    seconds = (ends[epochs] - ends[setting.warmup_epochs]) / setting.measured_epochs
    moved = [
        (after.sent - before.sent + after.received - before.received) / setting.measured_epochs
        for before, after in zip(counted[setting.warmup_epochs], counted[epochs])
    ]
    groups = [
        e["group_size"]
        for peer in peers
        for e in peer.events
        if e["type"] == "epoch" and e["epoch"] > setting.warmup_epochs
    ]
    result = dict(
        rate=rate,
        seconds=seconds,
        bytes_per_epoch=statistics.median(moved),
        moved=moved,
        mean_group=sum(groups) / max(1, len(groups)),
    )
    print(
        f"  {rate:g} Mbit/s: {seconds:.2f} s per epoch, {result['bytes_per_epoch'] / 2**20:.2f} MiB per volunteer "
        f"per epoch, mean group {result['mean_group']:.2f}",
        flush=True,
    )
    return result


def run(quick: bool = False) -> list[dict]:
    common.require_network_lab()
    setting = QUICK if quick else FULL
    predicted_bytes = gradient_bytes()
    log_dir = tempfile.mkdtemp(prefix="collab_kit_bench_links_")
    rates = RATES if not quick else (TARGET_RATE,)
    results = {rate: measure(rate, setting, log_dir) for rate in rates}
    rows = []
    for rate, result in results.items():
        moved_ideal = 2 * predicted_bytes * 8 / (rate * 1e6)
        ideal = setting.compute_time + moved_ideal
        ratio = result["seconds"] / ideal
        rows.append(
            common.make_row(
                __spec__.name,
                f"NAT volunteers on {rate:g} Mbit/s links: time per epoch / ideal",
                ratio,
                f"<= {TARGET_RATIO}",
                f"{ratio:.2f}x",
                f"{result['seconds']:.2f} s per epoch; ideal {ideal:.2f} s = compute {setting.compute_time:.2f} s + "
                f"2 x {predicted_bytes / 2**20:.2f} MiB ({parameter_count():,} parameters) at {rate:g} Mbit/s "
                f"({moved_ideal:.2f} s); mean group "
                f"{result['mean_group']:.2f} training peers; logs in {log_dir}.",
                note="" if rate == TARGET_RATE else f"the issue's target is at {TARGET_RATE:g} Mbit/s",
            )
        )
    for rate, result in results.items():
        relative = result["bytes_per_epoch"] / (2 * predicted_bytes)
        rows.append(
            common.make_row(
                __spec__.name,
                f"bytes per epoch on a {rate:g} Mbit/s volunteer's link: "
                "distance of counted / compression's prediction from 1",
                abs(relative - 1),
                f"<= {BYTES_TOLERANCE}",
                f"{abs(relative - 1):.3f}",
                f"{result['bytes_per_epoch'] / 2**20:.2f} MiB counted per volunteer per epoch (each: "
                f"{', '.join(f'{m / 2**20:.2f}' for m in result['moved'])} MiB), predicted 2 x "
                f"{predicted_bytes / 2**20:.2f} MiB (gradients up, their average down).",
                note=f"counted / predicted: {relative:.3f}",
            )
        )
    return rows


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of one peer (``--peer``), started by the benchmark itself."""
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--target-batch-size", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--compute-seconds", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)


def main(argv: Sequence[str] | None = None) -> None:
    common.main_or_peer(
        sys.modules[__name__],
        argv,
        "one simulated volunteer of the Internet links benchmark",
        add_peer_arguments,
        peer_main,
    )


if __name__ == "__main__":
    main()
