"""Compute utilization in the network lab: overlapped fragment rounds against today's local-update rounds.

Figure: the share of the wall time a volunteer's accelerator computes, for two volunteers behind NAT on 10 Mbit/s
links with the paper preset's pseudo-gradients, in the local-update mode with ``optimizer.overlap_rounds`` and
``optimizer.fragments=4`` against the same mode without them, in the same run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks import common
from benchmarks.internet_links import volunteer_peer
from benchmarks.swarm_scaling import step_on_simulated_accelerator, stop_peers

# One micro-batch of the paper's model on a T4: the FLOPs benchmarks.gpu_check counted per sample (reversible layers
# included, RESULTS.md), at 40% of the T4's 65 TFLOP/s of fp16 tensor cores (gpu_check's utilization target; the kit
# reaches 16% on an H200 today, and a slower step would only make the rounds easier to hide).
PAPER_TFLOP_PER_SAMPLE = 8.86
T4_FP16_TFLOPS = 65.0
ASSUMED_MFU = 0.40


@dataclass
class Setting:
    """The simulated run, the same for both schedules but the settings that differ."""

    preset: str = "paper"
    micro_batch: int = 4  # the paper preset's batch_size_per_step
    local_steps: int = 128  # H: a global batch is one micro-batch of each volunteer, so H inner steps each per round
    fragments: int = 4
    link_mbit: float = 10.0
    averaging_timeout: float = 900.0  # a whole round of the paper's pseudo-gradients over 10 Mbit/s takes minutes
    warmup_rounds: int = 1  # whole rounds (H global batches) before the measured ones
    measured_rounds: int = 1
    volunteers: int = 2

    @property
    def step_seconds(self) -> float:
        return self.micro_batch * PAPER_TFLOP_PER_SAMPLE / (T4_FP16_TFLOPS * ASSUMED_MFU)

    def settings(self, overlapped: bool) -> list[str]:
        base = [
            f"optimizer.local_steps={self.local_steps}",
            f"optimizer.batch_size_per_step={self.micro_batch}",
            f"optimizer.target_batch_size={self.micro_batch * self.volunteers}",
            f"optimizer.averaging_timeout={self.averaging_timeout}",
            "optimizer.average_state_every=100000",
        ]  # no state averaging: the rounds alone
        if overlapped:
            base += ["optimizer.overlap_rounds=true", f"optimizer.fragments={self.fragments}"]
        return base


FULL = Setting()
# a smoke test: the small preset's shapes on a faster link, a few short rounds
QUICK = Setting(preset="small", local_steps=8, fragments=2, link_mbit=100.0, averaging_timeout=120.0)
START_TIMEOUT = 600  # the paper preset's model and optimizer take minutes to build on 2 busy cores

TITLE = "Compute utilization in the network lab: overlapped fragment rounds against today's local-update rounds"
HOW = f"""
`tests/helpers/netlab.py`: `collab-kit monitor --preset {FULL.preset}` on a public host (its anchor reduces every
round, its
link uncapped) and {FULL.volunteers} volunteers each behind its own NAT router with its link capped at
{FULL.link_mbit:g} Mbit/s each way (tc tbf). Each volunteer is `python -m benchmarks.utilization --peer ...` in its
home: the {FULL.preset} preset's model (125 M stored parameters: the paper's pseudo-gradient sizes) and the kit's
optimizer in the local-update mode, client mode chosen by the reachability probe; only the compute is simulated. A
micro-batch of {FULL.micro_batch} takes {FULL.step_seconds:.2f} s, the paper model's step on a T4
({PAPER_TFLOP_PER_SAMPLE} TFLOP per sample as `benchmarks.gpu_check` counted it, at {ASSUMED_MFU:.0%} of the T4's
{T4_FP16_TFLOPS:g} TFLOP/s of fp16), a sleep that tops up what the CPU spent; the inner step moves every parameter
by a fixed random direction, so that each round's pseudo-gradient is a real, non-zero one of the model's shapes.
H = {FULL.local_steps}: a global batch is one micro-batch of each volunteer
(`optimizer.target_batch_size={FULL.micro_batch * FULL.volunteers}`), so a round is {FULL.local_steps} inner steps
of each, {FULL.local_steps * FULL.step_seconds:.0f} s of compute; 8-bit pseudo-gradients,
`optimizer.averaging_timeout={FULL.averaging_timeout:g}`, no state averaging. Once as today (each
round's average awaited before the next inner step) and once with `optimizer.overlap_rounds=true` and
`optimizer.fragments={FULL.fragments}` (a round of a quarter of the model every {FULL.local_steps // FULL.fragments}
global batches, averaged while the next inner steps go on).

Utilization: inner steps x {FULL.step_seconds:.2f} s / wall time, for each volunteer from the end of its first
{FULL.warmup_rounds} round(s) to the end of the next {FULL.measured_rounds} (the same global batches in both
schedules), the lower of the two volunteers'. Target with overlap and fragments: >= 0.95 (INTELLECT-1: 0.83 across
continents, 0.96 within one). The details give today's figure and how many of the measured rounds averaged both
volunteers (a round that failed would hide its time). `--quick`: the small preset's shapes, H = {QUICK.local_steps}, F =
{QUICK.fragments}, {QUICK.link_mbit:g} Mbit/s: a smoke test.
"""


# ---------------------------------------------------------------------------------------------
# one simulated volunteer, inside a home of the lab


def peer_main(args: argparse.Namespace) -> int:
    import torch

    from collab_kit.config import get_preset, parse_overrides
    from collab_kit.roles.processes import emit_event
    from collab_kit.swarm.dht import wait_for_peers

    config = get_preset(
        args.preset,
        swarm=dict(run_id=args.run_id, initial_peers=args.initial_peers, host="0.0.0.0"),
        **parse_overrides(args.set),
    )
    with volunteer_peer(config) as (model, optimizer):
        parameters = [param for param in model.parameters() if param.requires_grad]
        generator = torch.Generator().manual_seed(args.seed)
        directions = [torch.randn(param.shape, generator=generator) * 1e-4 for param in parameters]

        @torch.no_grad()
        def simulated_inner_step(*_, **__):  # the accelerator's step: its time is the sleep, its result a real change
            for param, direction in zip(parameters, directions):
                param.add_(direction)

        optimizer.inner_optimizer.step = simulated_inner_step
        wait_for_peers(optimizer.dht, args.run_id, args.volunteers, timeout=START_TIMEOUT)
        emit_event("training", client_mode=bool(optimizer.client_mode), time=time.time())
        overlapped, steps = 0.0, 0
        while optimizer.local_epoch < args.epochs:
            started = time.perf_counter()
            overlapped, new_epoch = step_on_simulated_accelerator(optimizer, started, args.compute_seconds, overlapped)
            steps += 1
            if new_epoch:
                emit_event(
                    "epoch",
                    epoch=optimizer.local_epoch,
                    time=time.time(),
                    steps=steps,
                    group_size=optimizer.last_group_size,
                    problem=optimizer.last_round_problem,
                )
            report_applied(optimizer)
        optimizer.finish_round_in_flight()  # the last measured round's outcome too
        report_applied(optimizer)
        emit_event("done", steps=steps)
    return 0


def report_applied(optimizer) -> None:
    """An event for the outcome of each round that averaged in the background since the last call."""
    from collab_kit.roles.processes import emit_event

    for epoch in sorted(optimizer.applied_in_background):
        applied = optimizer.applied_in_background.pop(epoch)
        emit_event("applied", epoch=epoch, group_size=applied.group_size, problem=applied.problem)


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of one volunteer (``--peer``), started by the benchmark itself."""
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--preset", required=True)
    parser.add_argument("--set", action="append", default=[], help="SECTION.FIELD=VALUE, as collab-kit takes it")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--volunteers", type=int, required=True)
    parser.add_argument("--compute-seconds", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)


# ---------------------------------------------------------------------------------------------
# the lab, from the benchmark's process


def measure(setting: Setting, overlapped: bool, log_dir: str) -> dict[str, object]:
    """One run in a fresh lab: each volunteer's utilization over the measured rounds, and their rounds' outcomes."""
    from tests.helpers.netlab import NetworkLab

    epochs_per_round = setting.fragments if overlapped else 1
    first, last = (
        setting.warmup_rounds * epochs_per_round,
        (setting.warmup_rounds + setting.measured_rounds) * epochs_per_round,
    )
    run_id = f"bench_utilization_{'overlap' if overlapped else 'today'}_{os.getpid()}"
    options = [arg for value in setting.settings(overlapped) for arg in ("--set", value)]
    pythonpath = os.pathsep.join(filter(None, [common.REPO_ROOT, os.environ.get("PYTHONPATH")]))
    round_seconds = setting.local_steps * setting.step_seconds / epochs_per_round
    with NetworkLab() as lab:
        server = lab.public_host("server")
        monitor = server.start(
            "monitor",
            [
                "monitor",
                "--preset",
                setting.preset,
                "--run-id",
                run_id,
                "--host",
                "0.0.0.0",
                "--events",
                "--db",
                "",
                "--checkpoint-every",
                "0",
                *options,
            ],
            os.path.join(log_dir, f"{run_id}-monitor.log"),
        )
        peers = []
        try:
            addresses = monitor.wait_for(lambda e: e["type"] == "ready", timeout=START_TIMEOUT, what="its address")[
                "addresses"
            ]
            homes = [lab.home(f"home{i}") for i in range(setting.volunteers)]
            for index, home in enumerate(homes):
                home.limit(setting.link_mbit)
                peers.append(
                    home.start(
                        home.name,
                        [
                            "--peer",
                            "--run-id",
                            run_id,
                            "--initial-peers",
                            *addresses,
                            "--preset",
                            setting.preset,
                            *options,
                            "--epochs",
                            str(last),
                            "--volunteers",
                            str(setting.volunteers),
                            "--compute-seconds",
                            repr(setting.step_seconds),
                            "--seed",
                            str(index),
                        ],
                        os.path.join(log_dir, f"{run_id}-{home.name}.log"),
                        env=dict(PYTHONPATH=pythonpath),
                        command=(sys.executable, "-m", "benchmarks.utilization"),
                    )
                )
            for peer in peers:
                started = peer.wait_for(lambda e: e["type"] == "training", timeout=START_TIMEOUT, what="training")
                if not started["client_mode"]:
                    raise RuntimeError(f"{peer.name} is behind NAT but the probe did not put it in client mode")
            for peer in peers:
                peer.wait_for(
                    lambda e: e["type"] == "done",
                    timeout=START_TIMEOUT + (last + 2) * (round_seconds + 2 * setting.averaging_timeout),
                    what="the end",
                )
        finally:
            stop_peers(peers + [monitor])
    utilization, averaged = [], []
    for peer in peers:
        marks = {e["epoch"]: e for e in peer.events if e["type"] == "epoch"}
        if first not in marks or last not in marks:
            raise RuntimeError(f"{peer.name} skipped epoch {first} or {last} (a state download?): {sorted(marks)}")
        steps = marks[last]["steps"] - marks[first]["steps"]
        utilization.append(steps * setting.step_seconds / (marks[last]["time"] - marks[first]["time"]))
        # the measured rounds: those that ended epochs first+1..last, or with overlap those of epochs first..last-1
        if overlapped:
            outcomes = [e for e in peer.events if e["type"] == "applied" and first <= e["epoch"] < last]
        else:
            outcomes = [marks[epoch] for epoch in range(first + 1, last + 1) if epoch in marks]
        averaged.append(sum(e["group_size"] >= setting.volunteers and not e["problem"] for e in outcomes))
    result = dict(utilization=utilization, averaged=averaged, rounds=last - first)
    print(
        f"  {'overlap + fragments' if overlapped else 'today'}: utilization "
        f"{', '.join(f'{u:.3f}' for u in utilization)}, rounds averaged by both {averaged} of {last - first}",
        flush=True,
    )
    return result


def run(quick: bool = False) -> list[dict]:
    common.require_network_lab()
    setting = QUICK if quick else FULL
    folder = tempfile.mkdtemp(prefix="collab_kit_bench_utilization_")
    try:
        today = measure(setting, False, folder)
        overlapped = measure(setting, True, folder)
    except BaseException:
        print(f"  the logs are kept in {folder}", flush=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    value = min(overlapped["utilization"])

    def describe(result: dict) -> str:
        rounds = result["rounds"]
        return (
            f"utilization {', '.join(f'{u:.3f}' for u in result['utilization'])} (volunteers), measured rounds "
            f"averaged by both: {', '.join(f'{a} of {rounds}' for a in result['averaged'])}"
        )

    details = (
        f"today (H = {setting.local_steps}, rounds awaited): {describe(today)}; with overlap and F = "
        f"{setting.fragments}: {describe(overlapped)}; a micro-batch of {setting.micro_batch} "
        f"{setting.step_seconds:.2f} s, {setting.preset} preset, {setting.link_mbit:g} Mbit/s links."
    )
    return [
        common.make_row(
            __spec__.name,
            f"network lab, {setting.volunteers} NAT volunteers on "
            f"{setting.link_mbit:g} Mbit/s links, {setting.preset} preset's pseudo-gradients, T4 step "
            f"time: compute utilization with overlap and {setting.fragments} fragments",
            value,
            ">= 0.95",
            f"{value:.3f}",
            details,
            note=f"today's mode: {min(today['utilization']):.3f}",
        )
    ]


def main(argv: Sequence[str] | None = None) -> None:
    common.main_or_peer(
        sys.modules[__name__],
        argv,
        "one simulated volunteer of the utilization benchmark",
        add_peer_arguments,
        peer_main,
    )


if __name__ == "__main__":
    main()
