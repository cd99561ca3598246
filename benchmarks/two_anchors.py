"""Two anchors beside one (the network lab): time per global epoch, and a late joiner's state download.

A network lab (tests/helpers/netlab.py): the run's monitor on a public host, and for the second measurement a second
public host running ``collab-kit anchor`` with the join line's options; every anchor's link capped (tc tbf, each
direction); volunteers each behind their own NAT router, their links uncapped, simulated as in the Internet links
benchmark (the `small` preset's real model and gradients, the kit's optimizer, the compute a sleep). Then, while the
volunteers train on, a late joiner behind NAT downloads the swarm's state: from the monitor's anchor alone, or in
parts from both anchors (collab_kit.swarm.direct_state), which relay the volunteers' parts since they only reduce.

``python -m benchmarks.two_anchors`` measures and updates RESULTS.md; ``--peer ...`` is the late joiner (what the
benchmark starts inside a home of the lab).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks import common, internet_links
from benchmarks.internet_links import small_preset_peer
from benchmarks.swarm_scaling import epoch_end_times, stop_peers

TARGET_EPOCH_RATIO = 0.6  # time per epoch, two anchors / one (ideal 0.5)
TARGET_DOWNLOAD_RATIO = 0.6  # a late joiner's download, two sources / one
TARGET_LINK_DISTANCE = 0.15  # each anchor's link bytes per epoch, two anchors / one, from one half
START_TIMEOUT = 180
DOWNLOAD_EPOCHS = 4  # epochs the volunteers train on after the measured ones, while the late joiner downloads


@dataclass
class Setting(internet_links.Setting):
    """The simulated swarm (the same with one anchor and with two): the Internet links benchmark's, with more
    volunteers, faster compute (so that the anchors' links, not the compute, decide the epoch) and capped anchors."""

    volunteers: int = 4
    compute_seconds: float = 0.2
    anchor_mbit: float = 20.0  # each anchor's link, each direction


FULL = Setting()
QUICK = Setting(warmup_epochs=1, measured_epochs=2)

TITLE = "Two anchors beside one (network lab): time per epoch, each anchor's link, and a late joiner's state download"
HOW = f"""
The network lab (`tests/helpers/netlab.py`): `collab-kit monitor --preset small` on a public host, and for the second
measurement `collab-kit anchor` with the join line's options on a second public host; every anchor's link capped
at {FULL.anchor_mbit:g} Mbit/s each way (tc tbf). {FULL.volunteers} volunteers, each behind its own NAT router with an
uncapped link, simulated as in the Internet links benchmark (`python -m benchmarks.internet_links --peer`: the
`small` preset's real model and gradients, the kit's optimizer; a micro-batch of {FULL.micro_batch} takes
{FULL.compute_seconds:g} s, so that the anchors' links, not the compute, decide the epoch). Time per epoch: the
median over volunteers of the wall time at which each reached each global epoch, after {FULL.warmup_epochs} warm-up
epochs the mean of the next {FULL.measured_epochs}. Target: two anchors / one <= {TARGET_EPOCH_RATIO} (ideal 0.5).

Then, while the volunteers train on, a late joiner behind NAT downloads the swarm's state (`python -m
benchmarks.two_anchors --peer`: `load_state_from_peers` of the kit's optimizer, timed): from the one anchor, or in parts
from both, each source's link capped as above. Two anchors only reduce (they hold no state of their own meanwhile):
each relays its part from a volunteer as it comes. Target: two sources / one <= {TARGET_DOWNLOAD_RATIO}.

Each anchor's link: the bytes over its interface, both directions, per epoch over the measured epochs. Target: with
two anchors, each within {TARGET_LINK_DISTANCE:.0%} of half of one anchor's alone.
"""


# ---------------------------------------------------------------------------------------------
# the late joiner, inside a home of the lab


def peer_main(args: argparse.Namespace) -> int:
    from collab_kit.roles.processes import emit_event

    with small_preset_peer(args) as (_, _, optimizer):
        started = time.perf_counter()
        optimizer.load_state_from_peers()
        emit_event("loaded", seconds=time.perf_counter() - started, epoch=optimizer.local_epoch)
    return 0


# ---------------------------------------------------------------------------------------------
# the lab, from the benchmark's process


def measure(anchors: int, setting: Setting, log_dir: str) -> dict:
    """One swarm in a fresh lab with ``anchors`` anchors, then a late joiner's download."""
    from tests.helpers.netlab import NetworkLab

    epochs = setting.warmup_epochs + setting.measured_epochs
    run_id = f"bench_anchors_{anchors}_{os.getpid()}"
    settings = [
        "--set",
        f"optimizer.target_batch_size={setting.target_batch_size}",
        "--set",
        f"optimizer.batch_size_per_step={setting.micro_batch}",
    ]
    pythonpath = os.pathsep.join(filter(None, [common.REPO_ROOT, os.environ.get("PYTHONPATH")]))
    started = []
    with NetworkLab() as lab:
        try:
            server = lab.public_host("server")
            server.limit(setting.anchor_mbit)
            monitor = server.start(
                "monitor",
                [
                    "monitor",
                    "--preset",
                    "small",
                    "--run-id",
                    run_id,
                    "--events",
                    "--db",
                    "",
                    "--checkpoint-every",
                    "0",
                    *settings,
                ],
                os.path.join(log_dir, f"{run_id}-monitor.log"),
            )
            started.append(monitor)
            addresses = monitor.wait_for(lambda e: e["type"] == "ready", timeout=START_TIMEOUT, what="its address")[
                "addresses"
            ]
            if anchors == 2:
                second = lab.public_host("second")
                second.limit(setting.anchor_mbit)
                anchor = second.start(
                    "anchor",
                    [
                        "anchor",
                        "--preset",
                        "small",
                        "--run-id",
                        run_id,
                        *settings,
                        "--initial-peers",
                        *addresses,
                        "--events",
                        "--keep-in",
                        os.path.join(log_dir, f"{run_id}-anchor"),
                    ],
                    os.path.join(log_dir, f"{run_id}-anchor.log"),
                )
                started.append(anchor)
                mine = anchor.wait_for(lambda e: e["type"] == "ready", timeout=START_TIMEOUT, what="its address")[
                    "addresses"
                ]
                addresses = monitor.wait_for(
                    lambda e: e["type"] == "join_line" and set(mine) <= set(e["addresses"]),
                    timeout=120,
                    what="a join line with both anchors",
                )["addresses"]
            homes = [lab.home(f"home{i}") for i in range(setting.volunteers)]
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
                        str(epochs + DOWNLOAD_EPOCHS),
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
            started.extend(peers)
            anchor_hosts = [server] + ([second] if anchors == 2 else [])

            def latest_epoch():
                return max((e["epoch"] for e in peers[0].events if e["type"] == "epoch"), default=-1)

            peers[0].wait_for(
                lambda e: e["type"] == "epoch" and e["epoch"] >= setting.warmup_epochs,
                timeout=START_TIMEOUT + 60 * epochs,
                what="the warm-up epochs",
            )
            links_before, epoch_before = [host.link_bytes() for host in anchor_hosts], latest_epoch()
            # the late joiner comes while the volunteers still train (the anchors that only reduce serve their state)
            for peer in peers:
                peer.wait_for(
                    lambda e: e["type"] == "epoch" and e["epoch"] >= epochs,
                    timeout=START_TIMEOUT + 60 * epochs,
                    what="the measured epochs",
                )
            links_after, epoch_after = [host.link_bytes() for host in anchor_hosts], latest_epoch()
            # interface counters, both directions, per epoch of the first volunteer over the same span
            link_bytes = [
                (a.sent + a.received - b.sent - b.received) / max(1, epoch_after - epoch_before)
                for a, b in zip(links_after, links_before)
            ]
            late_home = lab.home("late")
            late = late_home.start(
                "late",
                [
                    "--peer",
                    "--run-id",
                    run_id,
                    "--initial-peers",
                    *addresses,
                    "--target-batch-size",
                    str(setting.target_batch_size),
                    "--micro-batch",
                    str(setting.micro_batch),
                ],
                os.path.join(log_dir, f"{run_id}-late.log"),
                env=dict(PYTHONPATH=pythonpath),
                command=(sys.executable, "-m", "benchmarks.two_anchors"),
            )
            started.append(late)
            loaded = late.wait_for(lambda e: e["type"] == "loaded", timeout=600, what="the state")
        finally:
            stop_peers(started)
    ends = epoch_end_times([[e for e in peer.events if e["type"] == "epoch"] for peer in peers])
    seconds = (ends[epochs] - ends[setting.warmup_epochs]) / setting.measured_epochs
    with open(os.path.join(log_dir, f"{run_id}-late.log"), errors="replace") as f:
        # hivemind logs its own download of a whole state from one peer; the kit's download in parts is quiet
        in_parts = "Finished downloading state in" not in f.read()
    result = dict(
        anchors=anchors,
        seconds=seconds,
        download=loaded["seconds"],
        in_parts=in_parts,
        epoch=loaded["epoch"],
        link_bytes=link_bytes,
    )
    print(
        f"  {anchors} anchor(s): {seconds:.2f} s per epoch; each anchor's link "
        f"{', '.join(f'{b / 2**20:.2f}' for b in link_bytes)} MiB per epoch; the late joiner's download "
        f"{loaded['seconds']:.2f} s (epoch {loaded['epoch']}, in parts: {in_parts})",
        flush=True,
    )
    return result


def run(quick: bool = False) -> list[dict]:
    common.require_network_lab()
    setting = QUICK if quick else FULL
    log_dir = tempfile.mkdtemp(prefix="collab_kit_bench_anchors_")
    one, two = measure(1, setting, log_dir), measure(2, setting, log_dir)
    epoch_ratio = two["seconds"] / one["seconds"]
    download_ratio = two["download"] / one["download"]
    link_shares = [each / one["link_bytes"][0] for each in two["link_bytes"]]
    link_distance = max(abs(share / 0.5 - 1) for share in link_shares)
    return [
        common.make_row(
            __spec__.name,
            f"time per epoch, two anchors / one ({setting.volunteers} volunteers behind NAT, anchor "
            f"links {setting.anchor_mbit:g} Mbit/s)",
            epoch_ratio,
            f"<= {TARGET_EPOCH_RATIO}",
            f"{epoch_ratio:.2f}",
            f"{two['seconds']:.2f} s against {one['seconds']:.2f} s per epoch (compute {setting.compute_time:.2f} s "
            f"of it); logs in {log_dir}.",
        ),
        common.make_row(
            __spec__.name,
            "each anchor's link bytes per epoch, two anchors / one: distance from one half "
            "(interface counters, both directions)",
            link_distance,
            f"<= {TARGET_LINK_DISTANCE}",
            f"{link_distance:.2f}",
            f"each anchor's link carried {' and '.join(f'{share:.2f}' for share in link_shares)} of one anchor's alone "
            f"({', '.join(f'{b / 2**20:.2f}' for b in two['link_bytes'])} against "
            f"{one['link_bytes'][0] / 2**20:.2f} MiB per epoch); logs in {log_dir}.",
        ),
        common.make_row(
            __spec__.name,
            f"a late joiner's state download, two sources / one (each link {setting.anchor_mbit:g} Mbit/s)",
            download_ratio,
            f"<= {TARGET_DOWNLOAD_RATIO}",
            f"{download_ratio:.2f}",
            f"{two['download']:.2f} s from both anchors (in parts: {two['in_parts']}) against {one['download']:.2f} s "
            f"from one (in parts: {one['in_parts']}); logs in {log_dir}.",
        ),
    ]


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of the late joiner (``--peer``), started by the benchmark itself."""
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--target-batch-size", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, required=True)


def main(argv: Sequence[str] | None = None) -> None:
    common.main_or_peer(
        sys.modules[__name__], argv, "the late joiner of the two-anchors benchmark", add_peer_arguments, peer_main
    )


if __name__ == "__main__":
    main()
