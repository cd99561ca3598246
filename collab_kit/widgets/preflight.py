"""Before a volunteer joins: what this machine has, what the run needs, and what to do about each gap.

    report = run_preflight(config)      # GPU, its memory, RAM, disk, bitsandbytes, reachability
    print(report)                       # one line per check, with what to do for each problem
    config = report.apply(config)       # micro-batch, checkpointing and client mode chosen for this machine

Each check is a function of facts, so every case can be forced: ``gather_facts`` reads the real machine
(torch.cuda, psutil, the disk), the ``check_*`` functions judge them. The join notebook runs the whole
preflight before it builds anything heavy, so a volunteer learns in seconds, not after a download,
that the GPU is missing or the swarm's address was pasted wrong.

Reachability has two sides. *Out*: can this machine open a connection to the swarm's initial peers?
(A TCP connection to each address, with a short deadline.) *In*: can others open connections to it?
That is asked of the swarm (collab_kit.swarm.reachability: the initial peers try to dial this machine back),
since an address class says little: a cloud VM with a private interface may have its port forwarded,
and a public address may sit behind a firewall. A peer they cannot reach joins in client mode: it
connects out, trains and averages through the run's anchor, and is never asked to accept a
connection. Without the check (``check_peers=False``, or peers that cannot answer it) the address class
decides: only an address routable on the Internet counts as reachable.
"""

from __future__ import annotations

import dataclasses
import html
import ipaddress
import logging
import os
import shutil
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import psutil
import torch

from collab_kit import memory
from collab_kit.addresses import all_on_this_machine
from collab_kit.config import RunConfig, SwarmConfig
from collab_kit.model.device import DeviceFacts, DevicePlan, DeviceProblem, GpuFacts, choose_device
from collab_kit.quiet import import_bitsandbytes
from collab_kit.swarm.dht import resolve_reachability
from collab_kit.swarm.reachability import ReachabilityVerdict
from collab_kit.units import GiB, format_bytes

logger = logging.getLogger(__name__)

OK, NOTE, PROBLEM = "ok", "note", "problem"

# presets whose model only trains at a useful speed on a GPU (the others run on a laptop's CPU)
GPU_PRESETS = ("paper",)


@dataclass
class Finding:
    """The outcome of one check.

    :param check: what was checked: "gpu", "memory", "ram", "disk", "bitsandbytes", "swarm", "reachability"
    :param status: "ok", "note" (worth knowing, nothing to do) or "problem" (training would fail or crawl)
    :param message: what was found, with the numbers
    :param advice: what to do about it (always given for a problem)
    """

    check: str
    status: str
    message: str
    advice: str = ""


@dataclass
class MachineFacts:
    """What this machine has, as read by ``gather_facts`` (or set by hand to see what a preflight would say).

    :param gpu_name: the first CUDA device's name; None without a usable GPU
    :param gpu_memory_bytes: that device's total memory
    :param ram_bytes: the machine's memory
    :param ram_available_bytes: memory free for this process now
    :param disk_free_bytes: free space where checkpoints and the data cache are written
    :param disk_path: the folder whose disk was measured
    :param addresses: this machine's IPv4 addresses, loopback excluded
    :param gpu_capability: that device's compute capability (None: unknown, taken as a card without bf16)
    :param cuda_build: the CUDA version torch was built with (None: a CPU-only torch)
    :param nvidia_driver: an NVIDIA driver is installed (a GPU torch may not see, with a CPU-only build)
    """

    gpu_name: str | None
    gpu_memory_bytes: int | None
    ram_bytes: int
    ram_available_bytes: int
    disk_free_bytes: int
    disk_path: str
    addresses: tuple[str, ...] = ()
    gpu_capability: tuple[int, int] | None = None
    cuda_build: str | None = None
    nvidia_driver: bool = False

    def device_facts(self) -> DeviceFacts:
        """What collab_kit.model.device chooses from: torch's CUDA build and the GPU."""
        if self.gpu_name is None:
            return DeviceFacts(cuda_build=self.cuda_build)
        gpu = GpuFacts(self.gpu_name, int(self.gpu_memory_bytes or 0), self.gpu_capability or (0, 0))
        return DeviceFacts(cuda_build=self.cuda_build or "unknown", gpus=(gpu,))


def gather_facts(disk_path: str = ".") -> MachineFacts:
    """Read this machine: the GPU through torch.cuda, memory through psutil, the disk holding ``disk_path``."""

    gpu_name = gpu_memory = capability = None
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        gpu_name, gpu_memory = properties.name, int(properties.total_memory)
        capability = (properties.major, properties.minor)
    memory = psutil.virtual_memory()
    folder = os.path.abspath(disk_path)
    while not os.path.exists(folder):  # a folder the run will create: measure the disk it will be on
        folder = os.path.dirname(folder)
    addresses = tuple(
        sorted(
            {
                entry.address
                for entries in psutil.net_if_addrs().values()
                for entry in entries
                if entry.family == socket.AF_INET and not entry.address.startswith("127.")
            }
        )
    )
    return MachineFacts(
        gpu_name=gpu_name,
        gpu_memory_bytes=gpu_memory,
        ram_bytes=int(memory.total),
        ram_available_bytes=int(memory.available),
        disk_free_bytes=int(shutil.disk_usage(folder).free),
        disk_path=folder,
        addresses=addresses,
        gpu_capability=capability,
        cuda_build=torch.version.cuda,
        nvidia_driver=os.path.exists("/proc/driver/nvidia/version"),
    )


# -- the checks ---------------------------------------------------------------------------------------


def check_gpu(facts: MachineFacts, preset: str) -> Finding:
    """A GPU is needed for the paper's model; the small presets train on a CPU."""
    if facts.gpu_name is not None:
        return Finding("gpu", OK, f"GPU: {facts.gpu_name} with {format_bytes(facts.gpu_memory_bytes)}")
    where = (
        "On Colab: Runtime > Change runtime type > T4 GPU, then run the notebook again from the top. "
        "On Kaggle: Settings > Accelerator > GPU. On your own machine: install a CUDA build of PyTorch."
    )
    if preset in GPU_PRESETS:
        return Finding(
            "gpu",
            PROBLEM,
            f"no GPU found: the {preset!r} preset would train hundreds of times slower on this CPU",
            where + " Or choose PRESET = 'small' to try the kit on a CPU.",
        )
    return Finding("gpu", NOTE, f"no GPU found: the {preset!r} preset trains on the CPU (fine for it)", "")


def check_memory(recommendation, facts: MachineFacts, plan: DevicePlan | None = None) -> Finding:
    """Whether the model, its gradients and its activations fit the device that trains (GPU, else RAM)."""
    on_gpu = plan.device.type == "cuda" if plan is not None else facts.gpu_name is not None
    device = "GPU memory" if on_gpu else "RAM"
    if recommendation.fits:
        return Finding(
            "memory",
            OK,
            f"{device}: micro-batch {recommendation.micro_batch}, "
            f"checkpointing {'on' if recommendation.checkpointing else 'off'}, "
            f"about {format_bytes(recommendation.estimate.gpu_bytes)} of the device's memory",
        )
    return Finding(
        "memory",
        PROBLEM,
        f"too little {device}: {recommendation.reason}",
        "Use a machine with more memory (on Colab, a T4 has 15 GiB; Kaggle's P100 16 GiB), or a smaller preset.",
    )


def check_ram(facts: MachineFacts, needed_bytes: int) -> Finding:
    """The CPU side: the offloaded optimizer (8-bit LAMB keeps its state in RAM), the data buffers."""
    if facts.ram_available_bytes >= needed_bytes:
        return Finding(
            "ram",
            OK,
            f"RAM: {format_bytes(facts.ram_available_bytes)} free of {format_bytes(facts.ram_bytes)}, "
            f"about {format_bytes(needed_bytes)} needed",
        )
    return Finding(
        "ram",
        PROBLEM,
        f"too little RAM: {format_bytes(facts.ram_available_bytes)} free, "
        f"about {format_bytes(needed_bytes)} needed for the model's weights and optimizer on the CPU",
        "Close other notebooks or programs (on Colab: Runtime > Disconnect and delete runtime, then "
        "start again), choose a machine with more memory, or a smaller preset.",
    )


def check_disk(facts: MachineFacts, needed_bytes: int) -> Finding:
    """Room for the data cache and a checkpoint."""
    if facts.disk_free_bytes >= needed_bytes:
        return Finding(
            "disk",
            OK,
            f"disk: {format_bytes(facts.disk_free_bytes)} free in {facts.disk_path}, "
            f"about {format_bytes(needed_bytes)} needed",
        )
    return Finding(
        "disk",
        PROBLEM,
        f"too little disk space: {format_bytes(facts.disk_free_bytes)} free in "
        f"{facts.disk_path}, about {format_bytes(needed_bytes)} needed for data and checkpoints",
        "Free some space (delete old checkpoints or datasets), or point the data and checkpoint "
        "folders at a bigger disk.",
    )


def check_bitsandbytes(device: str, needed: bool = True) -> Finding:
    """Run one real step of bitsandbytes' 8-bit Adam on ``device`` and compare it with 32-bit Adam's.

    :param needed: the run's optimizer steps on this device (a failure is then a problem, else a note)
    """

    try:
        bnb = import_bitsandbytes()  # a broken install fails here, which is what this check is for
        weight = torch.linspace(-1, 1, 8192, device=device).reshape(64, 128).requires_grad_()
        reference = weight.detach().clone().requires_grad_()
        quantized_adam, adam = bnb.optim.Adam8bit([weight], lr=1e-2), torch.optim.Adam([reference], lr=1e-2)
        for parameter, optimizer in ((weight, quantized_adam), (reference, adam)):
            parameter.grad = torch.cos(torch.arange(8192.0, device=device)).reshape(64, 128)
            optimizer.step()
        state = quantized_adam.state[weight]["state1"]
        if state.dtype != torch.uint8:
            raise RuntimeError(f"its state is {state.dtype}, not 8-bit")
        error = (weight - reference).abs().max().item()
        if not error < 1e-3:  # one step of Adam moves each weight by about lr; 8 bits keep that to a few %
            raise RuntimeError(f"its step differs from 32-bit Adam's by {error:.2g}")
    except Exception as error:  # an import error, a missing CUDA library, a kernel failure: all mean the same
        found = (
            f"bitsandbytes' 8-bit optimizer does not work on {device}: "
            f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
        )
        if needed:
            return Finding(
                "bitsandbytes",
                PROBLEM,
                found,
                "Reinstall it (pip install -U bitsandbytes), restart the runtime and run the notebook "
                "again; the run's 8-bit optimizer cannot step without it.",
            )
        return Finding(
            "bitsandbytes",
            NOTE,
            found + " (the run's optimizer steps on the CPU, so it is not needed)",
            "Only the GPT-2 tutorial's 8-bit Adam on the GPU needs it: pip install -U bitsandbytes.",
        )
    return Finding("bitsandbytes", OK, f"bitsandbytes: 8-bit Adam steps on {device} as 32-bit Adam does")


def _address_of(maddr: str) -> tuple[str, int] | None:
    """``/ip4/1.2.3.4/tcp/31337/p2p/...`` -> ("1.2.3.4", 31337); None for other transports (dns, quic...)."""
    parts = maddr.strip("/").split("/")
    if len(parts) >= 4 and parts[0] in ("ip4", "ip6") and parts[2] == "tcp":
        return parts[1], int(parts[3])
    return None


def check_swarm(initial_peers: Sequence[str], timeout: float = 5.0) -> Finding:
    """Open a TCP connection to each initial peer: at least one must answer for this peer to join."""
    if not initial_peers:
        return Finding("swarm", NOTE, "no initial peers: this peer starts a new swarm, which others join through it")
    answered, failures = [], []
    for maddr in initial_peers:
        address = _address_of(maddr)
        if address is None:
            failures.append(f"{maddr}: not an /ip4 or /ip6 TCP address, not checked")
            continue
        try:
            with socket.create_connection(address, timeout=timeout):
                answered.append(maddr)
        except OSError as error:
            failures.append(f"{address[0]}:{address[1]}: {error.strerror or type(error).__name__}")
    if answered:
        return Finding("swarm", OK, f"{len(answered)} of {len(initial_peers)} initial peers answer")
    return Finding(
        "swarm",
        PROBLEM,
        "cannot reach the swarm: no initial peer answers (" + "; ".join(failures) + ")",
        "Copy the whole 'To join this swarm' line again from a peer that is running now (addresses "
        "change when a peer restarts); check that the run has not ended; a network that blocks "
        "outgoing connections (some university or company networks) cannot join.",
    )


def is_public(address: str) -> bool:
    """Whether others on the Internet can dial ``address`` (documentation and private ranges cannot)."""
    try:
        return ipaddress.ip_address(address).is_global
    except ValueError:
        return False


@dataclass
class Reachability:
    """How this peer takes part: listening for others, or only connecting out.

    :param public_addresses: addresses others can dial (seen by the swarm's peers, announced, or found on this
      machine's interfaces)
    :param client_mode: connect out only
    :param swarm: the swarm settings the check resolved (the probed port, announced addresses), if it probed
    """

    public_addresses: tuple[str, ...]
    client_mode: bool
    swarm: SwarmConfig | None = None


def check_reachability(
    facts: MachineFacts,
    config: RunConfig,
    verdict: ReachabilityVerdict | None = None,
    resolved: SwarmConfig | None = None,
) -> tuple[Finding, Reachability]:
    """Whether others can connect to this peer; client mode is chosen when they cannot.

    :param verdict: what the swarm's peers found when they dialled this machine back (collab_kit.swarm.reachability);
      None, or one with no answer: judged by the address class
    :param resolved: the swarm settings the check resolved along with ``verdict``
      (collab_kit.swarm.dht.resolve_reachability)
    """
    swarm = config.swarm
    if verdict is not None and verdict.reachable is not None and swarm.client_mode is None:
        if verdict.reachable:
            return Finding("reachability", OK, verdict.explain()), Reachability(
                verdict.public_addresses, False, resolved
            )
        return Finding(
            "reachability",
            NOTE,
            f"{verdict.explain()}: joining in client mode, which connects out only "
            f"and averages through the run's anchor (a peer that accepts connections, "
            f"run by the organizer)",
        ), Reachability((), True, resolved)
    if swarm.client_mode is None and swarm.initial_peers and all_on_this_machine(swarm.initial_peers):
        return Finding(
            "reachability", OK, "every initial peer is on this computer: they reach this peer on 127.0.0.1"
        ), Reachability((), False)
    announced = tuple(address[0] for address in map(_address_of, swarm.announce_maddrs) if address)
    host = swarm.listen_host
    if host not in ("0.0.0.0", "::"):
        candidates = (host,)  # it listens on one address only
    else:
        candidates = facts.addresses
    public = tuple(address for address in announced + candidates if is_public(address))
    if swarm.client_mode:
        return Finding("reachability", OK, "client mode (set by you): this peer connects out only"), Reachability(
            public, True
        )
    if public:
        return Finding(
            "reachability",
            OK,
            f"public address {public[0]}: other peers can connect to this one "
            f"(if no firewall blocks port {swarm.port or 'chosen at start'})",
        ), Reachability(public, False)
    private = ", ".join(candidates) or "none"
    if host.startswith("127."):
        if swarm.initial_peers and not all_on_this_machine(swarm.initial_peers):
            return Finding(
                "reachability",
                NOTE,
                f"listening on {host} only, and the initial peers are on other "
                f"machines: joining in client mode (leave HOST empty to listen "
                f"where they can reach this peer)",
            ), Reachability((), True)
        return Finding(
            "reachability", NOTE, f"listening on {host} only: peers on this computer can join, others cannot"
        ), Reachability((), False)
    if swarm.initial_peers:
        return Finding(
            "reachability",
            NOTE,
            f"no public address ({private}): joining in client mode, which "
            f"connects out only and trains like any other peer",
        ), Reachability((), True)
    # most machines have no public address (Colab, Kaggle, home): a swarm of their own still works, for peers on
    # this computer and its network; only a run for the whole Internet needs a machine others can dial
    return Finding(
        "reachability",
        NOTE,
        f"no public address ({private}): this peer starts a new swarm that peers on this computer and "
        f"its network can join, but not peers elsewhere on the Internet",
        "To host a run for the Internet, start it on a machine with a public address (a cloud VM "
        "running `collab-kit monitor`), or forward a port on your router and announce it "
        "(swarm.announce_maddrs); to join someone's run instead, paste its addresses into INITIAL_PEERS "
        "(collab-kit join --initial-peers).",
    ), Reachability((), False)


# -- the whole preflight ------------------------------------------------------------------------------


@dataclass(repr=False)  # its repr is the readable report: what a notebook shows as text
class PreflightReport:
    """Every finding, the facts behind them, and the settings chosen for this machine."""

    findings: list[Finding]
    facts: MachineFacts
    recommendation: object  # collab_kit.memory.recommend.Recommendation
    reachability: Reachability
    plan: DevicePlan | None = None  # where and in what precision this peer trains (collab_kit.model.device)

    @property
    def problems(self) -> list[Finding]:
        return [finding for finding in self.findings if finding.status == PROBLEM]

    @property
    def ok(self) -> bool:
        return not self.problems

    def apply(self, config: RunConfig, client_mode: bool | None = None) -> RunConfig:
        """``config`` with this machine's micro-batch, checkpointing and client mode.

        These are a peer's own choices: the swarm adds up samples whatever each peer's micro-batch is,
        and reversible layers (the kit's checkpointing) change how activations are kept, not the weights.

        :param client_mode: override the client mode the preflight chose (None: keep its choice)
        """
        recommendation = self.recommendation
        client_mode = self.reachability.client_mode if client_mode is None else client_mode
        swarm = config.swarm
        if self.reachability.swarm is not None:  # the port that was checked, the address the swarm's peers saw
            swarm = dataclasses.replace(
                swarm, port=self.reachability.swarm.port, announce_maddrs=self.reachability.swarm.announce_maddrs
            )
        return dataclasses.replace(
            config,
            model=dataclasses.replace(config.model, reversible=bool(recommendation.checkpointing)),
            optimizer=dataclasses.replace(config.optimizer, batch_size_per_step=int(recommendation.micro_batch)),
            swarm=dataclasses.replace(swarm, client_mode=client_mode),
        )

    def __str__(self) -> str:
        marks = {OK: "ok     ", NOTE: "note   ", PROBLEM: "PROBLEM"}
        lines = []
        for finding in self.findings:
            lines.append(f"{marks[finding.status]} {finding.check:<13} {finding.message}")
            if finding.advice and finding.status != OK:
                lines.append(f"{'':22}-> {finding.advice}")
        verdict = (
            "ready to train"
            if self.ok
            else f"{len(self.problems)} problem(s) to fix before training: see the lines marked PROBLEM"
        )
        return "\n".join(lines + [verdict])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        colours = {OK: "#1a7f37", NOTE: "#9a6700", PROBLEM: "#cf222e"}
        rows = "".join(
            f"<tr><td style='color:{colours[f.status]};font-weight:bold'>{html.escape(f.status)}</td>"
            f"<td>{html.escape(f.check)}</td><td>{html.escape(f.message)}"
            + (f"<br><i>{html.escape(f.advice)}</i>" if f.advice and f.status != OK else "")
            + "</td></tr>"
            for f in self.findings
        )
        return f"<table>{rows}</table><p><b>{html.escape(str(self).splitlines()[-1])}</b></p>"


def disk_needed_bytes(estimate) -> int:
    """A checkpoint (the weights, saved twice while the older one is rotated out) and the data cache (1 GiB)."""
    return int(2 * estimate.weights_bytes + GiB)


def check_device(config: RunConfig, facts: MachineFacts, device: str = "auto", precision: str = "auto"):
    """Where this peer trains, in what precision and why, with the micro-batch that fits there: (finding, plan,
    recommendation). A GPU that cannot be used (no CUDA build of torch, too little memory for one sample) is said in
    one sentence, and the peer trains on the CPU; a device asked for that is not here is a problem."""
    problem = None
    try:
        plan = choose_device(device, precision, facts.device_facts())
    except DeviceProblem as e:
        problem, plan = str(e), choose_device("cpu", "auto", facts.device_facts())
    fit = memory.fit_to_device(config, plan, facts.device_facts(), facts.ram_available_bytes, device)
    plan, recommendation, note = fit.plan, fit.recommendation, fit.note
    if note is None and plan.device.type == "cpu" and facts.nvidia_driver and facts.cuda_build is None:
        note = (
            "this machine has an NVIDIA GPU, but this PyTorch is a CPU-only build: training on the CPU (install "
            "a CUDA build of torch to use the GPU)"
        )
        plan = dataclasses.replace(plan, reason="torch sees no GPU")
    layers = "reversible layers" if recommendation.checkpointing else "no checkpointing"
    where = (
        f"of {format_bytes(plan.memory_bytes)}"
        if plan.device.type == "cuda"
        else f"of the {format_bytes(facts.ram_available_bytes)} RAM free"
    )
    how = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16 with loss scaling"}[plan.precision]
    summary = (
        f"{plan.name}: {how} ({plan.reason}), micro-batch {recommendation.micro_batch}, {layers}, about "
        f"{format_bytes(recommendation.estimate.gpu_bytes)} {where}"
    )
    if problem is not None:
        return (
            Finding(
                "device",
                PROBLEM,
                f"{problem}; the CPU instead: {summary}",
                "Set DEVICE = 'auto' (or --device auto) to train where this machine can",
            ),
            plan,
            recommendation,
        )
    if note is not None:
        return Finding("device", NOTE, f"{note}; {summary}"), plan, recommendation
    return Finding("device", OK, summary), plan, recommendation


def run_preflight(
    config: RunConfig,
    *,
    facts: MachineFacts | None = None,
    disk_path: str = ".",
    check_peers: bool = True,
    peer_timeout: float = 5.0,
    device: str = "auto",
    precision: str = "auto",
) -> PreflightReport:
    """Check this machine against ``config``'s run, and choose its device and precision, micro-batch, checkpointing
    and client mode.

    :param config: the run to join (its preset sets the model whose memory is estimated)
    :param facts: the machine's facts; None reads this machine (``gather_facts``)
    :param disk_path: where data and checkpoints go
    :param check_peers: try to connect to the initial peers, and ask them to dial this machine back (off: no network
      at all; reachability is then judged by the address class)
    :param peer_timeout: seconds to wait for each initial peer
    :param device: "auto", "cpu", "cuda" or "cuda:N" (collab_kit.model.device.choose_device)
    :param precision: "auto", "fp32", "bf16" or "fp16"
    """

    facts = facts if facts is not None else gather_facts(disk_path)
    device_finding, plan, recommendation = check_device(config, facts, device, precision)
    device = plan.device.type
    findings = [check_gpu(facts, config.preset), device_finding, check_memory(recommendation, facts, plan)]
    if device == "cuda":  # the CPU holds the offloaded optimizer
        findings.append(check_ram(facts, recommendation.estimate.cpu_bytes))
    findings.append(check_disk(facts, disk_needed_bytes(recommendation.estimate)))
    # the run's 8-bit LAMB steps on the CPU when offloaded (the paper's setting), else on the GPU
    optimizer_device = "cpu" if config.optimizer.offload_optimizer else device
    findings.append(check_bitsandbytes(optimizer_device))
    if device != optimizer_device:
        findings.append(check_bitsandbytes(device, needed=False))
    verdict = resolved = None
    if check_peers:
        findings.append(check_swarm(config.swarm.initial_peers, timeout=peer_timeout))
        if findings[-1].status == OK:
            resolved, verdict = resolve_reachability(config.swarm, timeout=peer_timeout)
    reachability_finding, reachability = check_reachability(facts, config, verdict, resolved)
    findings.append(reachability_finding)
    for finding in findings:  # the report is what a reader sees (a notebook displays it): the log holds a copy
        logger.debug(f"{finding.check}: {finding.status}: {finding.message}")
    return PreflightReport(
        findings=findings, facts=facts, recommendation=recommendation, reachability=reachability, plan=plan
    )
