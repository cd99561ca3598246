"""A network lab in Linux network namespaces: an "Internet", public hosts, and homes behind NAT routers.

On 127.0.0.1 every peer can dial every other at memory speed; the volunteers this kit is for sit behind
NAT (Colab, Kaggle, a home router) on links of a few Mbit/s that sometimes drop. The lab builds that
world on one Linux machine, so that tests and benchmarks run the real ``collab-kit`` commands in it:

    with NetworkLab() as lab:
        server = lab.public_host("server")            # an address anyone can dial: 10.77.0.10
        alice = lab.home("alice")                     # 192.168.1.2 behind a NAT router (iptables MASQUERADE)
        monitor = server.start("monitor", ["monitor", "--preset", "tiny", ...], log_path)
        alice.limit(20)                               # 20 Mbit/s each way (tc tbf; this kernel has no netem)
        alice.cut(); ...; alice.restore()             # every packet of the link dropped, then let through again
        alice.link_bytes()                            # bytes sent and received on the link (interface counters)
        print(lab.network_report())                   # per host: TCP retransmissions and timeouts, packets dropped

The pieces: one namespace holds a bridge, the Internet (10.77.0.0/16). A public host is a namespace with
one veth on that bridge. A home is two namespaces: its router (one leg on the bridge at 10.77.1.N, one on
the home's LAN 192.168.N.1, forwarding with MASQUERADE and dropping connections that start outside) and
its host (192.168.N.2, default route through the router). Other variants are what the reachability probe
must tell apart: a public host whose firewall drops incoming connections, and a home whose router forwards
one port to its host (a cloud VM whose interface holds a private address). Every address is in a private
range: libp2p drops documentation ranges (203.0.113.0/24, 198.18.0.0/15) from the addresses peers learn.

Everything the lab made (namespaces, with their veths, and the processes inside) goes when it closes, also
when a test fails; a lab left behind by a process that was killed is removed by the next lab that starts.
Making namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and Debian's ``iproute2`` and ``iptables``:
``lab_unavailable()`` says why a lab cannot be built here, for tests to skip with that reason.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from collab_kit.errors import CollabKitError
from collab_kit.roles.processes import PeerProcess

logger = logging.getLogger(__name__)

INTERNET_PREFIX = "10.77"  # the Internet: public hosts at 10.77.0.N, home routers at 10.77.1.N
NAMESPACE_PREFIX = "ckl"  # every namespace a lab makes is named ckl<pid>x<lab>-<name>
_lab_numbers = itertools.count()
# the kernel's TCP counters a report shows: segments sent again, retransmission timeouts (each one a stall of at
# least 200 ms, doubling), and segments that arrived out of order or as duplicates
TCP_COUNTERS = (
    "TcpRetransSegs",
    "TcpExtTCPTimeouts",
    "TcpExtTCPLossProbes",
    "TcpExtTCPOFOQueue",
    "TcpExtTCPDSACKRecv",
    "TcpExtTCPSpuriousRTOs",
)


class LabError(CollabKitError, RuntimeError):
    """A command that builds or changes the lab failed; the message holds the command and what it printed."""


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)
    if check and result.returncode != 0:
        raise LabError(f"{' '.join(command)} failed ({result.returncode}): {result.stdout.strip()}")
    return result


def lab_unavailable() -> str | None:
    """Why no lab can be built on this machine (None: it can): a missing tool, or no right to make namespaces."""
    for tool in ("ip", "iptables", "tc"):
        if shutil.which(tool) is None:
            return (
                f"`{tool}` is not installed: install Debian's iproute2 and iptables as root "
                f"(`make test` does it where it can)"
            )
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN): run the tests as root"
    name = f"{NAMESPACE_PREFIX}{os.getpid()}xprobe"
    result = _run("ip", "netns", "add", name, check=False)
    if result.returncode != 0:
        return f"cannot create a network namespace here: {result.stdout.strip()}"
    try:
        nat = _run("ip", "netns", "exec", name, "iptables", "-t", "nat", "-L", "-n", check=False)
        if nat.returncode != 0:
            return f"iptables' NAT table does not work in a namespace here: {nat.stdout.strip()[:200]}"
        tbf = _run(
            "ip",
            "netns",
            "exec",
            name,
            "tc",
            "qdisc",
            "add",
            "dev",
            "lo",
            "root",
            "tbf",
            "rate",
            "1mbit",
            "burst",
            "16kb",
            "limit",
            "64kb",
            check=False,
        )
        if tbf.returncode != 0:
            return f"tc's tbf does not work in a namespace here: {tbf.stdout.strip()[:200]}"
    finally:
        _run("ip", "netns", "del", name, check=False)
    return None


def remove_stale_labs() -> list[str]:
    """Delete the namespaces of labs whose process is gone (a test run killed before it could clean up)."""
    removed = []
    for name in list_namespaces():
        if not name.startswith(NAMESPACE_PREFIX):
            continue
        pid_part = name[len(NAMESPACE_PREFIX) :].split("x", 1)[0]
        if pid_part.isdigit() and not os.path.exists(f"/proc/{pid_part}"):
            _kill_namespace_processes(name)
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


def list_namespaces() -> list[str]:
    result = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _kill_namespace_processes(namespace: str) -> None:
    pids = _run("ip", "netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError, PermissionError):
            pass


@dataclass
class LinkBytes:
    """What crossed a host's link to the Internet, from the interface counters (IP headers included)."""

    sent: int
    received: int


class Host:
    """A machine of the lab: a namespace where commands run, and its link to the Internet.

    :param lab: the lab it belongs to
    :param name: a short name ("server", "alice")
    :param namespace: the namespace its processes run in
    :param address: its own address (private behind NAT)
    :param public_address: the address others on the Internet see it as (its router's for a home)
    :param uplink: (namespace, device) whose egress is this host's upload: the rate cap and counters go there
    :param downlink: (namespace, device) whose egress is this host's download
    :param cut_rules: (namespace, iptables arguments) that drop the link's traffic when inserted
    """

    def __init__(
        self,
        lab: NetworkLab,
        name: str,
        namespace: str,
        address: str,
        public_address: str,
        uplink: tuple[str, str],
        downlink: tuple[str, str],
        cut_rules: Sequence[tuple[str, list[str]]],
    ):
        self.lab, self.name, self.namespace = lab, name, namespace
        self.address, self.public_address = address, public_address
        self.uplink, self.downlink, self._cut_rules = uplink, downlink, list(cut_rules)
        self.is_cut = False
        self.rate_mbit: float | None = None

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address}, seen as {self.public_address})"

    def command(self, *args: str) -> list[str]:
        """``args`` as a command that runs inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *args]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a command inside this host and wait for it."""
        return _run(*self.command(*args), check=check)

    def start(
        self,
        name: str,
        args: Sequence[str],
        log_path: str,
        env: dict[str, str] | None = None,
        command: Sequence[str] | None = None,
    ) -> PeerProcess:
        """Start ``collab-kit ARGS`` (or ``command + args``) inside this host, as a PeerProcess the lab kills at close.

        :param name: a short name for messages
        :param args: the command's arguments
        :param log_path: where everything it prints goes
        :param env: extra environment variables
        :param command: what runs ``args`` (default: this Python's ``-m collab_kit.cli``)
        """
        command = list(command or (sys.executable, "-m", "collab_kit.cli"))
        peer = PeerProcess(name, list(args), log_path, env=env, command=self.command(*command))
        self.lab.processes.append(peer)
        return peer

    # -- the link -------------------------------------------------------------------------------------

    def limit(self, mbit: float) -> None:
        """Cap this host's link at ``mbit`` Mbit/s each way (token bucket; packets beyond its queue are dropped).

        The bucket holds 10 ms of traffic (at least 16 KiB, so a full-size packet always fits) and the
        queue 100 ms (at least 64 KiB): a home router's modest buffer, not a bufferbloat of seconds.
        """
        if not mbit > 0:
            raise ValueError(f"mbit={mbit!r}: expected a positive rate")
        rate_bytes = mbit * 1e6 / 8
        burst = max(16 * 1024, int(rate_bytes / 100))
        limit = max(64 * 1024, int(rate_bytes / 10))
        for namespace, device in (self.uplink, self.downlink):
            _run(
                "ip",
                "netns",
                "exec",
                namespace,
                "tc",
                "qdisc",
                "replace",
                "dev",
                device,
                "root",
                "tbf",
                "rate",
                f"{int(mbit * 1000)}kbit",
                "burst",
                str(burst),
                "limit",
                str(limit),
            )
        self.rate_mbit = mbit

    def unlimit(self) -> None:
        """Remove the rate cap."""
        for namespace, device in (self.uplink, self.downlink):
            _run("ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root", check=False)
        self.rate_mbit = None

    def cut(self) -> None:
        """Drop every packet to and from the Internet, silently, as a link that goes dead does (connections stay
        open on both sides until their own timeouts notice)."""
        if self.is_cut:
            return
        for namespace, rule in self._cut_rules:
            _run("ip", "netns", "exec", namespace, "iptables", "-I", *rule)
        self.is_cut = True

    def restore(self) -> None:
        """Let traffic through again after ``cut``."""
        if not self.is_cut:
            return
        for namespace, rule in self._cut_rules:
            _run("ip", "netns", "exec", namespace, "iptables", "-D", *rule)
        self.is_cut = False

    def link_bytes(self) -> LinkBytes:
        """Bytes this host has sent and received over its link to the Internet so far."""
        return LinkBytes(sent=_tx_bytes(*self.uplink), received=_tx_bytes(*self.downlink))


def _tx_bytes(namespace: str, device: str) -> int:
    shown = json.loads(_run("ip", "-n", namespace, "-j", "-s", "link", "show", "dev", device).stdout)
    return int(shown[0]["stats64"]["tx"]["bytes"])


class NetworkLab:
    """The Internet and the hosts on it; a context manager that removes everything it made.

    :param internet_prefix: the first two numbers of the Internet's addresses (a private /16)
    """

    def __init__(self, internet_prefix: str = INTERNET_PREFIX):
        reason = lab_unavailable()
        if reason is not None:
            raise LabError(reason)
        remove_stale_labs()
        self.internet_prefix = internet_prefix
        self.tag = f"{NAMESPACE_PREFIX}{os.getpid()}x{next(_lab_numbers)}"
        self.namespaces: list[str] = []
        self.processes: list[PeerProcess] = []
        self.hosts: dict[str, Host] = {}
        self._public_count = 0
        self._home_count = 0
        self._veth_count = itertools.count()
        try:
            self.internet = self._namespace("inet")
            _run("ip", "-n", self.internet, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.internet, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    # -- building -------------------------------------------------------------------------------------

    def _namespace(self, name: str) -> str:
        namespace = f"{self.tag}-{name}"
        _run("ip", "netns", "add", namespace)
        self.namespaces.append(namespace)
        _run("ip", "-n", namespace, "link", "set", "lo", "up")
        return namespace

    def _plug(self, namespace: str, device: str, address: str) -> str:
        """A veth from ``namespace`` (as ``device``, with ``address``/16) to the Internet's bridge; returns the
        bridge side's name (inside the Internet's namespace)."""
        bridge_side = f"p{next(self._veth_count)}"
        _run(
            "ip",
            "link",
            "add",
            device,
            "netns",
            namespace,
            "type",
            "veth",
            "peer",
            "name",
            bridge_side,
            "netns",
            self.internet,
        )
        _run("ip", "-n", self.internet, "link", "set", bridge_side, "master", "br0", "up")
        _run("ip", "-n", namespace, "addr", "add", f"{address}/16", "dev", device)
        _run("ip", "-n", namespace, "link", "set", device, "up")
        return bridge_side

    def _check_name(self, name: str) -> None:
        if name in self.hosts or not name.replace("-", "").isalnum() or len(name) > 20:
            raise ValueError(f"host name {name!r}: expected a new name of letters, digits and '-' (20 at most)")

    def public_host(self, name: str, drop_inbound: bool = False) -> Host:
        """A host with an address on the Internet.

        :param name: its name
        :param drop_inbound: a firewall on the host drops every connection that starts outside it (a public
          address that nobody can dial)
        """
        self._check_name(name)
        self._public_count += 1
        address = f"{self.internet_prefix}.0.{9 + self._public_count}"
        namespace = self._namespace(name)
        bridge_side = self._plug(namespace, "eth0", address)
        if drop_inbound:
            _run(
                "ip",
                "netns",
                "exec",
                namespace,
                "iptables",
                "-A",
                "INPUT",
                "-i",
                "eth0",
                "-m",
                "conntrack",
                "--ctstate",
                "ESTABLISHED,RELATED",
                "-j",
                "ACCEPT",
            )
            _run("ip", "netns", "exec", namespace, "iptables", "-A", "INPUT", "-i", "eth0", "-j", "DROP")
        cut_rules = [
            (namespace, ["INPUT", "-i", "eth0", "-j", "DROP"]),
            (namespace, ["OUTPUT", "-o", "eth0", "-j", "DROP"]),
        ]
        host = Host(
            self,
            name,
            namespace,
            address,
            address,
            uplink=(namespace, "eth0"),
            downlink=(self.internet, bridge_side),
            cut_rules=cut_rules,
        )
        self.hosts[name] = host
        return host

    def home(self, name: str, forward_port: int | None = None) -> Host:
        """A host behind a NAT router of its own: it can dial out, nobody outside can dial it.

        :param name: its name
        :param forward_port: the router forwards this TCP port to the host (a cloud VM whose interface holds a
          private address, with its port open): reachable at the router's address and this port
        """
        self._check_name(name)
        self._home_count += 1
        number = self._home_count
        router = self._namespace(f"{name}-r")
        wan_address, lan_prefix = f"{self.internet_prefix}.1.{number}", f"192.168.{number}"
        self._plug(router, "wan0", wan_address)
        namespace = self._namespace(name)
        _run("ip", "link", "add", "lan0", "netns", router, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        _run("ip", "-n", router, "addr", "add", f"{lan_prefix}.1/24", "dev", "lan0")
        _run("ip", "-n", router, "link", "set", "lan0", "up")
        _run("ip", "-n", namespace, "addr", "add", f"{lan_prefix}.2/24", "dev", "eth0")
        _run("ip", "-n", namespace, "link", "set", "eth0", "up")
        _run("ip", "-n", namespace, "route", "add", "default", "via", f"{lan_prefix}.1")
        in_router = ("ip", "netns", "exec", router)
        _run(*in_router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        _run(*in_router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE")
        if forward_port is not None:
            _run(
                *in_router,
                "iptables",
                "-t",
                "nat",
                "-A",
                "PREROUTING",
                "-i",
                "wan0",
                "-p",
                "tcp",
                "--dport",
                str(forward_port),
                "-j",
                "DNAT",
                "--to-destination",
                f"{lan_prefix}.2:{forward_port}",
            )
        # a home router lets in only what answers the home's own connections (and a forwarded port)
        _run(
            *in_router,
            "iptables",
            "-A",
            "FORWARD",
            "-i",
            "wan0",
            "-m",
            "conntrack",
            "--ctstate",
            "ESTABLISHED,RELATED,DNAT",
            "-j",
            "ACCEPT",
        )
        _run(*in_router, "iptables", "-A", "FORWARD", "-i", "wan0", "-j", "DROP")
        cut_rules = [(router, ["FORWARD", "-j", "DROP"])]
        host = Host(
            self,
            name,
            namespace,
            f"{lan_prefix}.2",
            wan_address,
            uplink=(router, "wan0"),
            downlink=(router, "lan0"),
            cut_rules=cut_rules,
        )
        self.hosts[name] = host
        return host

    # -- what happened on the wires -------------------------------------------------------------------

    def network_report(self) -> str:
        """What the lab's kernels counted so far, host by host, for a failure to be read after the lab is gone:
        each host's TCP retransmissions and retransmission timeouts (a stall of seconds on a link that loses
        packets), the packets each router's firewall dropped (a home router drops what conntrack does not take
        for an answer, also a late or out-of-window packet of a live connection) and each rate cap's drops."""
        lines = []
        for host in self.hosts.values():
            counters = _run("ip", "netns", "exec", host.namespace, "nstat", "-az", *TCP_COUNTERS, check=False)
            found = dict(line.split()[:2] for line in counters.stdout.splitlines()[1:] if len(line.split()) >= 2)
            lines.append(f"{host.name}: " + " ".join(f"{name}={found.get(name, '?')}" for name in TCP_COUNTERS))
            router = host.uplink[0]
            if router != host.namespace:  # a home: its router's firewall and NAT
                dropped = _run(
                    "ip", "netns", "exec", router, "iptables", "-L", "FORWARD", "-v", "-n", "-x", check=False
                ).stdout
                drops = [line.split()[0] for line in dropped.splitlines() if " DROP " in f" {line} "]
                lines.append(f"  {host.name}'s router dropped {'+'.join(drops) or '0'} packet(s) from outside")
            for namespace, device in (host.uplink, host.downlink):
                shown = _run(
                    "ip", "netns", "exec", namespace, "tc", "-s", "qdisc", "show", "dev", device, check=False
                ).stdout
                if "tbf" in shown:
                    lines.append(f"  rate cap on {device}: " + " ".join(shown.split()))
        return "\n".join(lines)

    # -- the end --------------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process started in the lab, then delete its namespaces (their veths go with them)."""
        for process in reversed(self.processes):
            process.kill()
        self.processes.clear()
        for namespace in reversed(self.namespaces):
            _kill_namespace_processes(namespace)
            _run("ip", "netns", "del", namespace, check=False)
        self.namespaces.clear()

    def __enter__(self) -> NetworkLab:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
