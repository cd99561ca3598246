"""Swarm scaling by simulation: time per global epoch with 2, 4 and 6 peers, and with one peer 4x slower.

Each simulated peer is its own process on 127.0.0.1 with the kit's real optimizer
(``collab_kit.swarm.optimizer.make_optimizer``: hivemind.Optimizer, 8-bit LAMB, compressed gradient averaging,
state averaging) over a small real model; only its compute is simulated: a micro-batch takes a fixed
``compute_seconds`` (a real tiny forward / backward, then a sleep up to that time), standing in for an
accelerator so that this machine's 2 cores are not what limits the swarm.

``python -m benchmarks.swarm_scaling`` measures and updates RESULTS.md;
``python -m benchmarks.swarm_scaling --peer ...`` is one simulated peer (what the former starts), printing
``@event {json}`` lines (collab_kit.roles.processes.emit_event): ``ready`` with its addresses, ``training``,
one ``epoch`` per global epoch with the wall time at which it ended there, and ``done``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks import common
from collab_kit.roles.processes import PeerFailed, PeerProcess


@dataclass
class Simulation:
    """One simulated swarm's settings (the same for every peer count, so that only the count changes).

    :param target_batch_size: samples the swarm accumulates per global epoch
    :param micro_batch: samples per local step of a peer (``batch_size_per_step``)
    :param compute_seconds: simulated time of one micro-batch on a peer of normal speed
    :param matchmaking_time: hivemind's matchmaking time (gradient and state averaging)
    :param progress_refresh_period: how often a peer reads the swarm's progress when it cannot estimate the epoch's
        end (``OptimizerConfig.progress_refresh_period``; it waits up to 10/3 of it between reads)
    :param warmup_epochs: global epochs left out of the measurement (start-up skew, throughput estimates)
    :param measured_epochs: global epochs timed after the warm-up
    :param width: hidden width of the model (about 2 * width**2 parameters)
    :param verbose: peers log every stage of hivemind's global steps (to see where an epoch's time goes)
    :param local_steps: the local-update mode's H (collab_kit.swarm.local_updates): a global epoch is then a round of
        H target batches; 0: synchronous
    """

    target_batch_size: int = 5120
    micro_batch: int = 32
    compute_seconds: float = 0.25
    matchmaking_time: float = 3.0
    progress_refresh_period: float = 1.0
    warmup_epochs: int = 1
    measured_epochs: int = 3
    width: int = 256
    verbose: bool = False
    local_steps: int = 0

    @property
    def peer_rate(self) -> float:
        """Samples per second of one peer of normal speed."""
        return self.micro_batch / self.compute_seconds

    def compute_time(self, speeds: Sequence[float]) -> float:
        """Seconds of compute the swarm needs per epoch: its samples (the target batch, or a round of local_steps of
        them) over the peers' summed throughput."""
        return self.target_batch_size * max(1, self.local_steps) / (self.peer_rate * sum(speeds))


FULL = Simulation()
QUICK = Simulation(
    target_batch_size=2048, matchmaking_time=2.0, progress_refresh_period=0.6, warmup_epochs=1, measured_epochs=2
)
PEER_COUNTS = (2, 4, 6)
QUICK_PEER_COUNTS = (2, 4)  # --quick leaves out the 6 peers (the longest start on 2 cores): it is a smoke test
SCALING_SLACK = 1.2  # target: time(most peers) / time(fewest) within 20% of the ideal fewest / most (0.40 for 6 / 2)
SLOW_FACTOR = 4.0  # the uneven swarm: 4 peers, one of which takes this many times longer per micro-batch
UNEVEN_PEERS = 4
START_TIMEOUT = 120  # seconds for a peer to start its DHT (several peers import torch at once on 2 cores)


def parameter_count(width: int) -> int:
    """Parameters of ``make_model(width)``."""
    narrow = width // 4
    return 2 * (narrow * width + width) + 2 * (width * width + width) - width + narrow


TITLE = "Swarm scaling (simulated compute): time per global epoch with 2, 4 and 6 peers, and one peer 4x slower"
HOW = """
Every peer is its own process on 127.0.0.1 (`python -m benchmarks.swarm_scaling --peer ...`) with the kit's
optimizer, `collab_kit.swarm.optimizer.make_optimizer` (hivemind.Optimizer around 8-bit LAMB, offloaded and delayed
step,
size-adaptive gradient compression, state averaging every epoch) at the kit's defaults, except: target batch
{target}, micro-batches of {micro} samples, matchmaking {matchmaking:g} s, progress refresh period {refresh:g} s. The
model is an MLP of {params:,} parameters: real gradients, averaged for real over loopback. Only the compute is
simulated: a micro-batch takes {compute:g} s (a real tiny forward / backward, then a sleep up to that time), {rate:g}
samples/s per peer, standing in for an accelerator so that the 2 cores of this machine are not the bottleneck.
The CPU bookkeeping of an ordinary `opt.step()` (accumulating gradients, reporting progress) counts within the next
micro-batch's time, as it overlaps an accelerator's asynchronous compute; a global step (averaging with the swarm)
adds to it.

Why these numbers: the target batch makes an epoch {t_low:.0f} s of compute with {low} peers and {t_high:.1f} s with
{high}, so that the fixed cost of an epoch (the all-reduce, the optimizer step, the few micro-batches computed past
the target before every peer has seen the epoch end) weighs a few percent with {low} peers and more with {high}, as it
would over the Internet with a large model, rather than vanishing in very long epochs or dominating very short ones.
Matchmaking is short because loopback needs no more, and it must fit in a {high}-peer epoch: hivemind pre-schedules it
{matchmaking:g} s before the estimated end of the epoch, and an epoch cannot end before its averaging group is formed.
The progress refresh period is shortened in the same proportion as the epochs (the kit's default, 3 s, suits epochs
of minutes): with it, a peer that starts before it can estimate the swarm's throughput reads the swarm's progress
again only after 10 s, longer than a {high}-peer epoch here, and falls behind at the start.

How it is measured: peers start together (`collab_kit.swarm.dht.wait_for_peers`); each prints the wall time at which it
reaches each global epoch, and an epoch's end is the median over peers. After {warmup} warm-up epoch(s) (the first
runs long while peers learn the swarm's throughput), the time per epoch is the mean of the next {measured}.
Scaling: time per epoch with {high} peers / with {low} peers, target <= {scaling_target:.2f} (ideal {ideal:.2f}).
Uneven speed: {uneven} peers, one taking {slow:g}x longer per micro-batch. hivemind ends an epoch when the swarm as a
whole has accumulated the target batch, so the epoch should take what the summed throughput predicts, not wait for
the slow peer (beyond the rest of its current micro-batch). Predicted: the compute time at the summed throughput
({fast_peers} + 1/{slow:g} peers' rate) plus the per-epoch overhead measured with {uneven} equal peers in the same run
(their time per epoch minus their compute time); target: measured / predicted <= 1.15. The details give what an
epoch would take if the swarm waited for the slow peer to process an equal share (as synchronous data-parallel
training does), and the slow peer's share of the samples. A full run takes 4 to 6 minutes, much of it starting
peers (importing torch on 2 cores); `--quick` ({quick_counts} peers, target batch {quick_target}, {quick_warmup} +
{quick_measured} epochs) is a smoke test. On a shared machine, expect a few percent of noise.
""".format(
    target=FULL.target_batch_size,
    micro=FULL.micro_batch,
    matchmaking=FULL.matchmaking_time,
    refresh=FULL.progress_refresh_period,
    params=parameter_count(FULL.width),
    compute=FULL.compute_seconds,
    rate=FULL.peer_rate,
    low=min(PEER_COUNTS),
    high=max(PEER_COUNTS),
    t_low=FULL.compute_time([1] * min(PEER_COUNTS)),
    t_high=FULL.compute_time([1] * max(PEER_COUNTS)),
    warmup=FULL.warmup_epochs,
    measured=FULL.measured_epochs,
    scaling_target=SCALING_SLACK * min(PEER_COUNTS) / max(PEER_COUNTS),
    ideal=min(PEER_COUNTS) / max(PEER_COUNTS),
    uneven=UNEVEN_PEERS,
    slow=SLOW_FACTOR,
    fast_peers=UNEVEN_PEERS - 1,
    quick_counts=" and ".join(map(str, QUICK_PEER_COUNTS)),
    quick_target=QUICK.target_batch_size,
    quick_warmup=QUICK.warmup_epochs,
    quick_measured=QUICK.measured_epochs,
)


# ---------------------------------------------------------------------------------------------
# one simulated peer, in its own process


def make_model(width: int):
    """A small MLP: real parameters to average (2 matrices of width x width, plus input and output layers)."""
    import torch

    narrow = width // 4
    return torch.nn.Sequential(
        torch.nn.Linear(narrow, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, narrow),
    )


def step_on_simulated_accelerator(
    optimizer, compute_started: float, compute_seconds: float, overlapped: float
) -> tuple[float, bool]:
    """End a micro-batch begun at ``compute_started`` as if an accelerator took ``compute_seconds`` for it, then step.

    The sleep IS the compute being simulated (however little this CPU needed), not a wait for an event. An ordinary
    step is bookkeeping on the CPU (queue the gradients' accumulation, report progress) that runs while an accelerator
    still computes the queued kernels, so it overlaps the next micro-batch; on 2 busy cores it can take tens of ms,
    which would otherwise count as compute. A global step waits for the swarm (averaging): the accelerator is idle
    then, nothing overlaps.

    :param overlapped: what the previous step returned (0.0 at first)
    :returns: the seconds of this step that the next micro-batch's compute hides, and whether a global epoch ended
    """
    time.sleep(max(0.0, compute_seconds - overlapped - (time.perf_counter() - compute_started)))
    epoch_before, step_started = optimizer.local_epoch, time.perf_counter()
    optimizer.step()  # accumulates; a global step (all-reduce with the swarm) once the target batch is in
    optimizer.zero_grad()
    new_epoch = optimizer.local_epoch != epoch_before
    return (0.0 if new_epoch else min(time.perf_counter() - step_started, compute_seconds)), new_epoch


def peer_main(args: argparse.Namespace) -> int:
    """Train as one peer of the simulated swarm until its global epoch reaches ``args.epochs``."""
    import torch

    from collab_kit.config import OptimizerConfig, SwarmConfig
    from collab_kit.roles.processes import emit_event
    from collab_kit.swarm.dht import join_addresses, start_dht, wait_for_peers
    from collab_kit.swarm.optimizer import make_optimizer

    torch.set_num_threads(1)  # the model is tiny; the cores are for the other peers' DHTs and averagers
    initial_peers = args.initial_peers
    if initial_peers == ["-"]:  # started before the first peer had an address: it comes on stdin
        initial_peers = sys.stdin.readline().split()
        if not initial_peers:
            print("no initial peers on stdin (the benchmark that started this peer is gone?)", file=sys.stderr)
            return 1
    dht = start_dht(SwarmConfig(run_id=args.run_id, initial_peers=initial_peers, host="127.0.0.1"))
    optimizer = None
    try:
        emit_event("ready", addresses=join_addresses(dht))
        torch.manual_seed(0)  # every peer starts from the same parameters, as after loading the swarm's state
        model = make_model(args.width)
        teacher = torch.nn.Linear(args.width // 4, args.width // 4)  # a fixed function to learn (seed 0 too)
        config = OptimizerConfig(
            target_batch_size=args.target_batch_size,
            batch_size_per_step=args.micro_batch,
            matchmaking_time=args.matchmaking_time,
            averaging_timeout=60.0,
            progress_refresh_period=args.progress_refresh_period,
            local_steps=args.local_steps,
        )
        optimizer = make_optimizer(model, dht, args.run_id, config, verbose=args.verbose)
        generator = torch.Generator().manual_seed(args.seed)
        wait_for_peers(dht, args.run_id, args.peers, timeout=START_TIMEOUT)
        emit_event("training", time=time.time())
        steps = 0
        overlapped = 0.0  # seconds of the last step's bookkeeping that the accelerator's compute would have hidden
        while optimizer.local_epoch < args.epochs:
            started = time.perf_counter()
            inputs = torch.randn(args.micro_batch, args.width // 4, generator=generator)
            with torch.no_grad():
                targets = teacher(inputs)
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            overlapped, new_epoch = step_on_simulated_accelerator(optimizer, started, args.compute_seconds, overlapped)
            steps += 1
            if new_epoch:
                emit_event(
                    "epoch",
                    epoch=optimizer.local_epoch,
                    time=time.time(),
                    samples=steps * args.micro_batch,
                    group_size=optimizer.last_group_size,
                    loss=loss.item(),
                )
                steps = 0
        emit_event("done")
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()
    return 0


# ---------------------------------------------------------------------------------------------
# the swarm, started from the benchmark's process


class SimulatedPeer(PeerProcess):
    """PeerProcess running ``python -m benchmarks.swarm_scaling --peer ARGS...`` (not ``collab-kit``).

    :param read_addresses: the peer reads its initial peers from stdin (``--initial-peers -``): call
        ``send_addresses`` once the first peer has reported them
    """

    def __init__(self, name: str, args: Sequence[str], log_path: str, read_addresses: bool = False):
        pythonpath = os.pathsep.join(filter(None, [common.REPO_ROOT, os.environ.get("PYTHONPATH")]))
        super().__init__(
            name,
            ["--peer", *args],
            log_path,
            env=dict(PYTHONPATH=pythonpath),
            command=(sys.executable, "-m", "benchmarks.swarm_scaling"),
            stdin=subprocess.PIPE if read_addresses else subprocess.DEVNULL,
            cwd=common.REPO_ROOT,
        )

    def send_addresses(self, addresses: Sequence[str]) -> None:
        """Give the peer the addresses of the first peer (one line on its stdin)."""
        try:
            self.process.stdin.write(" ".join(addresses) + "\n")
            self.process.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # the peer is gone: waiting for its next event says so, with its log


def run_swarm(
    speeds: Sequence[float], sim: Simulation, run_id: str, log_dir: str
) -> tuple[list[list[dict]], list[str]]:
    """Start one simulated peer per entry of ``speeds`` (1 = normal, 0.25 = 4x slower), train
    ``sim.warmup_epochs + sim.measured_epochs`` global epochs; returns each peer's ``epoch`` events and the
    names of the peers that had not finished when the others had (see ``wait_until_done``).

    :raises PeerFailed: if a peer exits early or most of the swarm is not done within a generous deadline
    """
    epochs = sim.warmup_epochs + sim.measured_epochs
    common_args = [
        "--run-id",
        run_id,
        "--peers",
        str(len(speeds)),
        "--epochs",
        str(epochs),
        "--target-batch-size",
        str(sim.target_batch_size),
        "--micro-batch",
        str(sim.micro_batch),
        "--matchmaking-time",
        str(sim.matchmaking_time),
        "--width",
        str(sim.width),
        "--progress-refresh-period",
        str(sim.progress_refresh_period),
        "--local-steps",
        str(sim.local_steps),
        *(["--verbose"] if sim.verbose else []),
    ]
    peers: list[SimulatedPeer] = []
    started = time.perf_counter()
    try:
        # all peers start at once: the others import torch and hivemind while the first starts the swarm,
        # then read its addresses on their stdin
        for index, speed in enumerate(speeds):
            args = [
                *common_args,
                "--compute-seconds",
                repr(sim.compute_seconds / speed),
                "--seed",
                str(index),
                *(["--initial-peers", "-"] if index > 0 else []),
            ]
            peers.append(
                SimulatedPeer(
                    f"peer-{index}", args, os.path.join(log_dir, f"{run_id}-peer-{index}.log"), read_addresses=index > 0
                )
            )
        ready = peers[0].wait_for(lambda e: e["type"] == "ready", timeout=START_TIMEOUT, what="its address")
        for peer in peers[1:]:
            peer.send_addresses(ready["addresses"])
        for peer in peers:
            peer.wait_for(lambda e: e["type"] == "training", timeout=2 * START_TIMEOUT, what="the start of training")
        print(f"  {len(peers)} peers training {time.perf_counter() - started:.0f} s after their start", flush=True)
        # three times the compute time, plus matchmaking and a minute: only a broken swarm takes longer
        deadline = time.monotonic() + 3 * epochs * (sim.compute_time(speeds) + sim.matchmaking_time) + 60
        stragglers = wait_until_done(peers, deadline, grace=2 * (sim.compute_time(speeds) + sim.matchmaking_time) + 10)
        return [[event for event in peer.events if event["type"] == "epoch"] for peer in peers], stragglers
    finally:
        stop_peers(peers)


def wait_until_done(peers: Sequence[PeerProcess], deadline: float, grace: float) -> list[str]:
    """Wait until every peer has reported ``done``, or until ``grace`` seconds after more than half have:
    a peer that fell out of sync (it then loads the swarm's state and may lag behind by epochs) must not hold
    up the measurement, which takes the median over peers. Returns the names of the peers left behind.

    :raises PeerFailed: if a peer exits without ``done``, or half of them are not done by ``deadline``
    """
    pending = list(peers)
    finish_by = deadline
    while pending:
        for peer in list(pending):
            peer.new_events(timeout=0.1)
            if any(event["type"] == "done" for event in peer.events):
                pending.remove(peer)
            elif peer.process.poll() is not None:
                raise PeerFailed(
                    f"{peer.name} exited with code {peer.process.returncode} before the end; "
                    f"last lines of {peer.log_path}:\n{peer.log_tail()}"
                )
        if 2 * (len(peers) - len(pending)) > len(peers):
            finish_by = min(finish_by, time.monotonic() + grace)
        if pending and time.monotonic() > finish_by:
            if 2 * len(pending) >= len(peers):
                raise PeerFailed(
                    f"{len(pending)} of {len(peers)} peers were not done in time; last lines of "
                    f"{pending[0].log_path}:\n{pending[0].log_tail()}"
                )
            break
    return [peer.name for peer in pending]


def stop_peers(peers: Sequence[PeerProcess]) -> None:
    """Kill every peer with its process group: all are told at once (their shutdowns overlap), then each is
    waited for and killed for good by PeerProcess.kill."""
    for peer in peers:
        if peer.process.poll() is None:
            try:
                os.killpg(peer.process.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
    for peer in peers:
        peer.kill()


def epoch_end_times(epochs_by_peer: Sequence[Sequence[dict]]) -> dict[int, float]:
    """Wall time at which the swarm reached each global epoch: the median over the peers that reported it."""
    times: dict[int, list[float]] = {}
    for events in epochs_by_peer:
        for event in events:
            times.setdefault(event["epoch"], []).append(event["time"])
    # an epoch that most peers skipped (loading the swarm's state instead) has no reliable end time
    return {
        epoch: statistics.median(values) for epoch, values in times.items() if 2 * len(values) > len(epochs_by_peer)
    }


def seconds_per_epoch(epochs_by_peer: Sequence[Sequence[dict]], warmup_epochs: int, measured_epochs: int) -> float:
    """Mean time per global epoch, from the end of epoch ``warmup_epochs`` to the end of
    ``warmup_epochs + measured_epochs``.

    :raises ValueError: if either end was reported by fewer than half of the peers
    """
    ends = epoch_end_times(epochs_by_peer)
    first, last = warmup_epochs, warmup_epochs + measured_epochs
    missing = [epoch for epoch in (first, last) if epoch not in ends]
    if missing:
        raise ValueError(f"fewer than half of the peers reported epoch(s) {missing}; epochs seen: {sorted(ends)}")
    return (ends[last] - ends[first]) / measured_epochs


def measure(speeds: Sequence[float], sim: Simulation, run_id: str, log_dir: str) -> dict:
    """Run one swarm; its time per epoch, group sizes and each peer's share of the measured epochs' samples."""
    started = time.perf_counter()
    epochs_by_peer, stragglers = run_swarm(speeds, sim, run_id, log_dir)
    seconds = seconds_per_epoch(epochs_by_peer, sim.warmup_epochs, sim.measured_epochs)
    measured = [[e for e in events if e["epoch"] > sim.warmup_epochs] for events in epochs_by_peer]
    samples = [sum(e["samples"] for e in events) for events in measured]
    groups = [e["group_size"] for events in measured for e in events]
    result = dict(
        speeds=list(speeds),
        seconds=seconds,
        compute=sim.compute_time(speeds),
        samples=samples,
        mean_group=sum(groups) / max(1, len(groups)),
        stragglers=stragglers,
        wall=time.perf_counter() - started,
    )
    print(
        f"  {len(speeds)} peers (speeds {', '.join(f'{s:g}' for s in speeds)}): {seconds:.2f} s per epoch "
        f"(compute {result['compute']:.2f} s), mean group {result['mean_group']:.2f}, "
        f"samples per peer {samples}, {result['wall']:.0f} s"
        + (f"; left behind: {', '.join(stragglers)}" if stragglers else ""),
        flush=True,
    )
    return result


def left_behind(result: dict) -> str:
    """Words for the details when peers fell behind the swarm (the figure is then the others' median)."""
    count = len(result["stragglers"])
    return f", {count} peer{'s' if count > 1 else ''} fell behind and did not finish with the others" if count else ""


def run(quick: bool = False) -> list[dict]:
    sim, counts = (QUICK, QUICK_PEER_COUNTS) if quick else (FULL, PEER_COUNTS)
    slow = 1.0 / SLOW_FACTOR
    log_dir = tempfile.mkdtemp(prefix="collab_kit_bench_scaling_")
    try:
        tag = f"{os.getpid()}_{int(time.time())}"  # a fresh run id per swarm: no stale progress records
        even = {n: measure([1.0] * n, sim, f"bench_scaling_{n}_{tag}", log_dir) for n in counts}
        uneven = measure([1.0] * (UNEVEN_PEERS - 1) + [slow], sim, f"bench_scaling_uneven_{tag}", log_dir)
    except BaseException:
        print(f"  the peers' logs are kept in {log_dir}", flush=True)
        raise
    shutil.rmtree(log_dir, ignore_errors=True)

    low, high = min(counts), max(counts)
    ratio = even[high]["seconds"] / even[low]["seconds"]
    ideal = low / high
    scaling_details = "; ".join(
        f"{n} peers {r['seconds']:.2f} s per epoch (compute {r['compute']:.2f} s, "
        f"overhead {r['seconds'] - r['compute']:+.2f} s, mean group {r['mean_group']:.1f}"
        f"{left_behind(r)})"
        for n, r in even.items()
    )
    rows = [
        common.make_row(
            __spec__.name,
            f"swarm scaling (simulated compute): time per epoch, {high} peers / {low} peers",
            ratio,
            f"<= {SCALING_SLACK * ideal:.2f}",
            f"{ratio:.2f}x",
            f"target batch {sim.target_batch_size}, {sim.peer_rate:g} samples/s per peer, "
            f"{sim.measured_epochs} epochs after {sim.warmup_epochs}: {scaling_details}.",
            note=f"ideal {ideal:.2f}",
        )
    ]

    # the per-epoch cost beyond compute, measured with as many equal peers (UNEVEN_PEERS is in both peer counts),
    # added to the compute time of the summed throughput
    equal = even[UNEVEN_PEERS]
    overhead = equal["seconds"] - equal["compute"]
    predicted = uneven["compute"] + overhead
    uneven_ratio = uneven["seconds"] / predicted
    # a swarm that waited for the slow peer to process an equal share of the target batch
    synchronous = sim.target_batch_size / UNEVEN_PEERS / (sim.peer_rate * slow) + overhead
    share = uneven["samples"][-1] / max(1, sum(uneven["samples"]))
    rows.append(
        common.make_row(
            __spec__.name,
            f"uneven speed (simulated compute): time per epoch with 1 of {UNEVEN_PEERS} peers "
            f"{SLOW_FACTOR:g}x slower / predicted by summed throughput",
            uneven_ratio,
            "<= 1.15",
            f"{uneven_ratio:.2f}x",
            f"{uneven['seconds']:.2f} s per epoch; predicted {predicted:.2f} s = compute {uneven['compute']:.2f} s "
            f"({UNEVEN_PEERS - 1} + 1/{SLOW_FACTOR:g} peers) + overhead {overhead:.2f} s measured with {UNEVEN_PEERS} "
            f"equal peers ({equal['seconds']:.2f} s per epoch); waiting for the slow peer's equal share would take "
            f"{synchronous:.1f} s; the slow peer contributed {100 * share:.1f}% of the samples (its throughput share: "
            f"{100 * slow / (UNEVEN_PEERS - 1 + slow):.1f}%), "
            f"mean group {uneven['mean_group']:.1f}{left_behind(uneven)}.",
            note=f"waiting for it: {synchronous / predicted:.1f}x",
        )
    )
    return rows


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of one peer (``--peer``), started by the benchmark itself."""
    parser.add_argument("--run-id", required=True)
    parser.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        help="addresses of a peer in the swarm; '-': read them from the first line of stdin",
    )
    parser.add_argument("--peers", type=int, required=True, help="wait until this many peers are ready")
    parser.add_argument("--epochs", type=int, required=True, help="stop at this global epoch")
    parser.add_argument("--target-batch-size", type=int, default=FULL.target_batch_size)
    parser.add_argument("--micro-batch", type=int, default=FULL.micro_batch)
    parser.add_argument("--compute-seconds", type=float, default=FULL.compute_seconds)
    parser.add_argument("--matchmaking-time", type=float, default=FULL.matchmaking_time)
    parser.add_argument("--progress-refresh-period", type=float, default=FULL.progress_refresh_period)
    parser.add_argument("--width", type=int, default=FULL.width)
    parser.add_argument("--seed", type=int, default=0, help="seed of this peer's data")
    parser.add_argument("--local-steps", type=int, default=0, help="the local-update mode's H (0: synchronous)")
    parser.add_argument("--verbose", action="store_true", help="log every stage of hivemind's global steps")


def main(argv: Sequence[str] | None = None) -> None:
    common.main_or_peer(
        sys.modules[__name__], argv, "one simulated peer of the swarm scaling benchmark", add_peer_arguments, peer_main
    )


if __name__ == "__main__":
    main()
