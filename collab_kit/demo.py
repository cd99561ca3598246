"""``make demo``: a whole collaborative run on this machine.

A first peer (the coordinator) and N volunteers start as separate processes on 127.0.0.1; the
volunteers train the ``small`` preset together for E global epochs on a dataset made on the spot.
The demo shows each global epoch as it ends and finishes with one summary line:

    demo: peers=2 epochs=5 loss_first=5.61 loss_last=3.20 averaged_rounds=5
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections import defaultdict
from typing import Dict, List, Optional

from collab_kit.config import get_preset
from collab_kit.data import make_synthetic_images
from collab_kit.local_swarm import PeerFailed, PeerProcess

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class DemoResult:
    peers: int
    epochs: int
    loss_first: float  # mean loss of the volunteers' local steps in the first global epoch
    loss_last: float  # ... in the last one
    averaged_rounds: int  # global steps every volunteer averaged with others (the minimum over volunteers)
    seconds: float

    def summary_line(self) -> str:
        return (f"demo: peers={self.peers} epochs={self.epochs} loss_first={self.loss_first:.4f} "
                f"loss_last={self.loss_last:.4f} averaged_rounds={self.averaged_rounds}")


def prepare_demo_data(workdir: str, num_samples: int, config) -> str:
    """The demo's data, made as a real run's is: pictures -> ``preprocess`` (VQGAN codes) -> shards.

    The pictures are synthetic ("a red cross on blue") and the VQGAN is untrained (nothing can be
    downloaded here), but the path is the one of a real dataset; returns the shards' folder.
    """
    from collab_kit.preprocess import preprocess
    from collab_kit.vqgan import untrained_vqgan

    started = time.monotonic()
    vqgan = untrained_vqgan(config.model.image_side, config.model.codebook_size)
    images = make_synthetic_images(os.path.join(workdir, "pictures"), num_samples, size=vqgan.image_size)
    report = preprocess(images, os.path.join(workdir, "shards"), vqgan, rows_per_shard=max(1, num_samples // 8),
                        batch_size=256, progress=False)
    print(f"demo: {report.kept} synthetic pictures -> VQGAN codes in {len(report.shards)} shards "
          f"({report.bytes_total / 1024:.0f} KiB, {time.monotonic() - started:.0f} s)", flush=True)
    return report.output


class DemoFailed(RuntimeError):
    """The demo could not show a collaborative run; the message says which part failed."""


def run_demo(num_volunteers: int = 2, epochs: int = 5, preset: str = "small", workdir: Optional[str] = None,
             timeout: float = 270.0, num_samples: int = 4096, keep_workdir: bool = False) -> DemoResult:
    """Start a coordinator and ``num_volunteers`` volunteers on 127.0.0.1 and train for ``epochs`` global epochs.

    :param num_volunteers: training peers (each its own process)
    :param epochs: global epochs to train
    :param preset: the configuration preset
    :param workdir: where the dataset and the peers' logs go (default: a temporary folder, removed on success)
    :param timeout: seconds the whole run may take before the demo gives up
    :param num_samples: synthetic pictures in the dataset
    :param keep_workdir: keep the logs even after a successful run
    :raises DemoFailed: with what went wrong and where the logs are
    """
    if num_volunteers < 1 or epochs < 1:
        raise ValueError(f"the demo needs at least one volunteer and one epoch (got peers={num_volunteers}, "
                         f"epochs={epochs})")
    started = time.monotonic()
    deadline = started + timeout
    own_workdir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="collab_kit_demo_")
    os.makedirs(workdir, exist_ok=True)
    config = get_preset(preset)
    shards = prepare_demo_data(workdir, num_samples, config)
    run_id = f"demo_{os.getpid()}"
    address_file = os.path.join(workdir, "first_peer.addr")
    threads = max(1, (os.cpu_count() or 2) // num_volunteers)

    peers: List[PeerProcess] = []
    succeeded = False
    try:
        print(f"demo: starting the first peer and {num_volunteers} volunteers on 127.0.0.1 "
              f"(preset {preset}, logs in {workdir})", flush=True)
        first = PeerProcess("first peer", ["monitor", "--preset", preset, "--run-id", run_id, "--host", "127.0.0.1",
                                           "--address-file", address_file, "--events"],
                            os.path.join(workdir, "first_peer.log"))
        peers.append(first)
        try:
            ready = first.wait_for(lambda e: e["type"] == "ready", timeout=60, what="its address")
        except PeerFailed as e:
            raise DemoFailed(f"the first peer did not start: {e}") from None
        addresses = ready["addresses"]

        volunteers = []
        for index in range(num_volunteers):
            volunteers.append(PeerProcess(
                f"volunteer {index + 1}",
                ["join", "--preset", preset, "--run-id", run_id, "--host", "127.0.0.1", "--initial-peers",
                 *addresses, "--data", shards, "--max-epochs", str(epochs), "--threads", str(threads),
                 "--wait-for-peers", str(num_volunteers),
                 "--events", "--no-progress"],
                os.path.join(workdir, f"volunteer_{index + 1}.log")))
        peers.extend(volunteers)
        for volunteer in volunteers:
            try:
                volunteer.wait_for(lambda e: e["type"] == "ready", timeout=max(1.0, deadline - time.monotonic()),
                                   what="that it joined the swarm")
            except PeerFailed as e:
                raise DemoFailed(f"a volunteer could not join the first peer: {e}") from None
        print(f"demo: {num_volunteers} volunteers joined; training {epochs} global epochs", flush=True)

        losses: Dict[int, Dict[str, float]] = defaultdict(dict)
        finished: Dict[str, dict] = {}
        while len(finished) < len(volunteers):
            if time.monotonic() > deadline:
                raise DemoFailed(f"the run did not finish within {timeout:.0f} s; logs in {workdir}")
            for volunteer in volunteers:
                exited = volunteer.process.poll() is not None  # before reading, so no last event is missed
                for event in volunteer.new_events(timeout=0.2):
                    if event["type"] == "done":
                        finished[volunteer.name] = event
                    elif event["type"] == "epoch":
                        _show_epoch(losses, event, volunteer.name, len(volunteers), epochs)
                if exited and volunteer.name not in finished:
                    raise DemoFailed(f"{volunteer.name} stopped before the end (exit code "
                                     f"{volunteer.process.returncode}); last lines of {volunteer.log_path}:\n"
                                     f"{volunteer.log_tail()}")
        for volunteer in volunteers:
            code = volunteer.wait_exit(timeout=max(5.0, deadline - time.monotonic()))
            if code != 0:
                raise DemoFailed(f"{volunteer.name} exited with code {code}; see {volunteer.log_path}")

        complete = [epoch for epoch in sorted(losses) if len(losses[epoch]) == len(volunteers)]
        if not complete:
            raise DemoFailed(f"no global epoch was completed by every volunteer; logs in {workdir}")
        averaged_rounds = min(event["averaged_rounds"] for event in finished.values())
        first_epoch, last_epoch = complete[0], complete[-1]
        result = DemoResult(
            peers=num_volunteers, epochs=max(event["final_epoch"] for event in finished.values()),
            loss_first=sum(losses[first_epoch].values()) / len(volunteers),
            loss_last=sum(losses[last_epoch].values()) / len(volunteers),
            averaged_rounds=averaged_rounds, seconds=time.monotonic() - started)
        if num_volunteers > 1 and averaged_rounds == 0:
            raise DemoFailed(f"the volunteers trained but never averaged gradients with each other: they did not "
                             f"meet in the swarm. Logs in {workdir}")
        succeeded = True
        return result
    finally:
        for peer in reversed(peers):
            peer.kill()
        if succeeded and own_workdir and not keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _show_epoch(losses: Dict[int, Dict[str, float]], event: dict, name: str, num_volunteers: int, epochs: int):
    """Record one volunteer's epoch; once every volunteer has reported it, print the epoch's line."""
    epoch = event["epoch"]
    losses[epoch][name] = event["loss"]
    if len(losses[epoch]) < num_volunteers:
        return
    mean = sum(losses[epoch].values()) / num_volunteers
    per_peer = ", ".join(f"{peer}: {loss:.3f}" for peer, loss in sorted(losses[epoch].items()))
    together = f"averaged across {event['group_size']} peers" if event["averaged"] else "not averaged"
    print(f"demo: epoch {epoch + 1}/{epochs} loss {mean:.4f} ({per_peer}); {together}", flush=True)
