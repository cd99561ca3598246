"""Two anchors beside one (the network lab): time per global epoch, and a late joiner's state download.

A network lab (collab_kit.netlab): the run's monitor on a public host, and for the second measurement a second
public host running ``collab-kit anchor`` with the join line's options; every anchor's link capped (tc tbf, each
direction); volunteers each behind their own NAT router, their links uncapped, simulated as in the Internet links
benchmark (the `small` preset's real model and gradients, the kit's optimizer, the compute a sleep). Then, once the
volunteers are done, a late joiner behind NAT downloads the swarm's state: from the monitor's anchor alone, or in
parts from both anchors (collab_kit.swarm.direct_state).

``python -m benchmarks.two_anchors`` measures and updates RESULTS.md; ``--peer ...`` is the late joiner (what the
benchmark starts inside a home of the lab).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

from benchmarks import common, internet_links
from benchmarks.internet_links import small_preset_peer
from benchmarks.swarm_scaling import epoch_end_times, stop_peers

TARGET_EPOCH_RATIO = 0.6  # time per epoch, two anchors / one (ideal 0.5)
TARGET_DOWNLOAD_RATIO = 0.6  # a late joiner's download, two sources / one
START_TIMEOUT = 180


@dataclass
class Setting(internet_links.Setting):
    """The simulated swarm (the same with one anchor and with two): the Internet links benchmark's, with more
    volunteers, faster compute (so that the anchors' links, not the compute, decide the epoch) and capped anchors."""

    volunteers: int = 4
    compute_seconds: float = 0.2
    anchor_mbit: float = 20.0  # each anchor's link, each direction


FULL = Setting()
QUICK = Setting(warmup_epochs=1, measured_epochs=2)

TITLE = "Two anchors beside one (network lab): time per epoch, and a late joiner's state download"
HOW = f"""
The network lab (`collab_kit.netlab`): `collab-kit monitor --preset small` on a public host, and for the second
measurement `collab-kit anchor` with the join line's options on a second public host; every anchor's link capped
at {FULL.anchor_mbit:g} Mbit/s each way (tc tbf). {FULL.volunteers} volunteers, each behind its own NAT router with an
uncapped link, simulated as in the Internet links benchmark (`python -m benchmarks.internet_links --peer`: the
`small` preset's real model and gradients, the kit's optimizer; a micro-batch of {FULL.micro_batch} takes
{FULL.compute_seconds:g} s, so that the anchors' links, not the compute, decide the epoch). Time per epoch: the
median over volunteers of the wall time at which each reached each global epoch, after {FULL.warmup_epochs} warm-up
epochs the mean of the next {FULL.measured_epochs}. Target: two anchors / one <= {TARGET_EPOCH_RATIO} (ideal 0.5).

Then, the volunteers gone, a late joiner behind NAT downloads the swarm's state (`python -m benchmarks.two_anchors
--peer`: `load_state_from_peers` of the kit's optimizer, timed): from the one anchor, or in parts from both, each
source's link capped as above. Target: two sources / one <= {TARGET_DOWNLOAD_RATIO}.

An anchor keeps the whole state: besides its half of each round it takes the other half's average, so its link
carries (volunteers + 1) / (2 x volunteers) of what one anchor's carried alone, {(FULL.volunteers + 1) /
(2 * FULL.volunteers):.3f} for {FULL.volunteers} volunteers, and the epoch with two anchors cannot fall below that
share of the link's time.
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
    from collab_kit.netlab import NetworkLab

    epochs = setting.warmup_epochs + setting.measured_epochs
    run_id = f"bench_anchors_{anchors}_{os.getpid()}"
    settings = ["--set", f"optimizer.target_batch_size={setting.target_batch_size}",
                "--set", f"optimizer.batch_size_per_step={setting.micro_batch}"]
    pythonpath = os.pathsep.join(filter(None, [common.REPO_ROOT, os.environ.get("PYTHONPATH")]))
    started = []
    with NetworkLab() as lab:
        try:
            server = lab.public_host("server")
            server.limit(setting.anchor_mbit)
            monitor = server.start("monitor", ["monitor", "--preset", "small", "--run-id", run_id, "--events",
                                               "--db", "", "--checkpoint-every", "0", *settings],
                                   os.path.join(log_dir, f"{run_id}-monitor.log"))
            started.append(monitor)
            addresses = monitor.wait_for(lambda e: e["type"] == "ready", timeout=START_TIMEOUT,
                                         what="its address")["addresses"]
            if anchors == 2:
                second = lab.public_host("second")
                second.limit(setting.anchor_mbit)
                anchor = second.start("anchor", ["anchor", "--preset", "small", "--run-id", run_id, *settings,
                                                 "--initial-peers", *addresses, "--events",
                                                 "--keep-in", os.path.join(log_dir, f"{run_id}-anchor")],
                                      os.path.join(log_dir, f"{run_id}-anchor.log"))
                started.append(anchor)
                mine = anchor.wait_for(lambda e: e["type"] == "ready", timeout=START_TIMEOUT,
                                       what="its address")["addresses"]
                addresses = monitor.wait_for(lambda e: e["type"] == "join_line" and set(mine) <= set(e["addresses"]),
                                             timeout=120, what="a join line with both anchors")["addresses"]
            homes = [lab.home(f"home{i}") for i in range(setting.volunteers)]
            peers = [home.start(home.name, ["--peer", "--run-id", run_id, "--initial-peers", *addresses, "--epochs",
                                            str(epochs), "--target-batch-size", str(setting.target_batch_size),
                                            "--micro-batch", str(setting.micro_batch), "--compute-seconds",
                                            repr(setting.compute_seconds), "--seed", str(index)],
                                os.path.join(log_dir, f"{run_id}-{home.name}.log"), env=dict(PYTHONPATH=pythonpath),
                                command=(sys.executable, "-m", "benchmarks.internet_links"))
                     for index, home in enumerate(homes)]
            started.extend(peers)
            for peer in peers:
                peer.wait_for(lambda e: e["type"] == "done", timeout=START_TIMEOUT + 60 * epochs, what="the end")
            late_home = lab.home("late")
            late = late_home.start("late", ["--peer", "--run-id", run_id, "--initial-peers", *addresses,
                                            "--target-batch-size", str(setting.target_batch_size),
                                            "--micro-batch", str(setting.micro_batch)],
                                   os.path.join(log_dir, f"{run_id}-late.log"), env=dict(PYTHONPATH=pythonpath),
                                   command=(sys.executable, "-m", "benchmarks.two_anchors"))
            started.append(late)
            loaded = late.wait_for(lambda e: e["type"] == "loaded", timeout=600, what="the state")
        finally:
            stop_peers(started)
    ends = epoch_end_times([[e for e in peer.events if e["type"] == "epoch"] for peer in peers])
    seconds = (ends[epochs] - ends[setting.warmup_epochs]) / setting.measured_epochs
    with open(os.path.join(log_dir, f"{run_id}-late.log"), errors="replace") as f:
        # hivemind logs its own download of a whole state from one peer; the kit's download in parts is quiet
        in_parts = "Finished downloading state in" not in f.read()
    result = dict(anchors=anchors, seconds=seconds, download=loaded["seconds"], in_parts=in_parts,
                  epoch=loaded["epoch"])
    print(f"  {anchors} anchor(s): {seconds:.2f} s per epoch; the late joiner's download {loaded['seconds']:.2f} s "
          f"(epoch {loaded['epoch']}, in parts: {in_parts})", flush=True)
    return result


def run(quick: bool = False) -> List[dict]:
    common.require_network_lab()
    setting = QUICK if quick else FULL
    log_dir = tempfile.mkdtemp(prefix="collab_kit_bench_anchors_")
    one, two = measure(1, setting, log_dir), measure(2, setting, log_dir)
    floor = (setting.volunteers + 1) / (2 * setting.volunteers)
    epoch_ratio = two["seconds"] / one["seconds"]
    download_ratio = two["download"] / one["download"]
    return [
        common.make_row(
            __spec__.name, f"time per epoch, two anchors / one ({setting.volunteers} volunteers behind NAT, anchor "
            f"links {setting.anchor_mbit:g} Mbit/s)", epoch_ratio, f"<= {TARGET_EPOCH_RATIO}", f"{epoch_ratio:.2f}",
            f"{two['seconds']:.2f} s against {one['seconds']:.2f} s per epoch (compute {setting.compute_time:.2f} s "
            f"of it); with whole states an anchor's link carries at best {floor:.3f} of one's alone; logs in "
            f"{log_dir}.", note=f"floor {floor:.3f}: each anchor takes the other half's average too"),
        common.make_row(
            __spec__.name, f"a late joiner's state download, two sources / one (each link {setting.anchor_mbit:g} "
            "Mbit/s)", download_ratio, f"<= {TARGET_DOWNLOAD_RATIO}", f"{download_ratio:.2f}",
            f"{two['download']:.2f} s from both anchors (in parts: {two['in_parts']}) against {one['download']:.2f} s "
            f"from one (in parts: {one['in_parts']}); logs in {log_dir}."),
    ]


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of the late joiner (``--peer``), started by the benchmark itself."""
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--target-batch-size", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, required=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
    common.main_or_peer(sys.modules[__name__], argv, "the late joiner of the two-anchors benchmark",
                        add_peer_arguments, peer_main)


if __name__ == "__main__":
    main()
