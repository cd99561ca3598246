"""Whether others can dial this peer: asked of the swarm, not guessed from the address class.

A private address may have a forwarded port and a public one a firewall, so a joining peer asks peers of the swarm
to connect back to it (as Petals' servers do, and libp2p's AutoNAT in spirit):

1. it starts a temporary libp2p host on the port it will listen on, connected to the initial peers;
2. it asks up to ``max_helpers`` of them over a stream of their own protocol (``PROTOCOL``) to dial it back, and
   asks once more each one that gave no answer (tests/swarm/test_swarm.py::
   test_a_helper_that_drops_a_reachability_check_is_asked_once_more);
3. each helper opens a fresh TCP connection to the address it sees the request come from and the port
   asked about, and checks that a libp2p host answers there (the multistream-select handshake);
4. the peer is reachable when most helpers that answered got through, and then announces the address
   they saw (what a forwarded port needs); otherwise it joins in client mode.

A helper only ever dials the address the request came from (the rule that keeps AutoNAT from being
used to scan third parties), at most ``MAX_PORTS`` ports, each with a short deadline. Every peer that
accepts connections serves checks (``serve_reachability_checks``, called by collab_kit.swarm.dht).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from collab_kit.swarm.kept_tasks import kept_until_done
from collab_kit.swarm.p2p_fixes import install_p2p_fixes

logger = logging.getLogger(__name__)

PROTOCOL = "/collab_kit/reachability/1.0.0"
MAX_PORTS = 4  # ports one request may ask about
MAX_REQUEST_BYTES = 1024
MULTISTREAM_HEADER = b"/multistream/1.0.0\n"  # what a libp2p host says first on a new TCP connection


@dataclass
class HelperAnswer:
    """What one peer of the swarm found when it dialled this one back.

    :param helper: the helper's peer id
    :param observed_address: the address it saw the request come from (None: it did not answer)
    :param results: port -> "reachable", "refused", "timeout", "not libp2p" or "error"
    :param problem: why there is no answer (None: there is one)
    """

    helper: str
    observed_address: str | None = None
    results: dict = field(default_factory=dict)
    problem: str | None = None

    @property
    def reachable(self) -> bool | None:
        if self.problem is not None or not self.results:
            return None
        return any(result == "reachable" for result in self.results.values())


@dataclass
class ReachabilityVerdict:
    """Whether others can dial this peer, as the swarm's peers found.

    :param reachable: True or False by the helpers' majority; None when no helper answered
    :param port: the port that was checked (the one the peer will listen on)
    :param answers: each helper's answer
    """

    reachable: bool | None
    port: int
    answers: list[HelperAnswer]

    @property
    def public_addresses(self) -> tuple[str, ...]:
        """The addresses helpers that got through saw this peer at (what others should dial)."""
        return tuple(
            sorted({answer.observed_address for answer in self.answers if answer.reachable and answer.observed_address})
        )

    def explain(self) -> str:
        """One sentence: what was checked and what the helpers found."""
        answered = [answer for answer in self.answers if answer.reachable is not None]
        if not answered:
            problems = (
                "; ".join(f"{answer.helper[:12]}...: {answer.problem}" for answer in self.answers) or "none asked"
            )
            return f"no peer of the swarm could check whether others can dial this one ({problems})"
        seen = ", ".join(sorted({answer.observed_address for answer in answered if answer.observed_address}))
        got_through = sum(bool(answer.reachable) for answer in answered)
        if self.reachable:
            return (
                f"{got_through} of {len(answered)} peers of the swarm dialled this one back at {seen} port "
                f"{self.port}: others can connect to it"
            )
        results = sorted({result for answer in answered for result in answer.results.values()})
        return (
            f"peers of the swarm could not dial this one back at {seen} port {self.port} "
            f"({', '.join(results)}): it is behind NAT or a firewall"
        )


# -- the helper's side ---------------------------------------------------------------------------------------


def _observed_ip(address: Multiaddr) -> str | None:
    for protocol in ("ip4", "ip6"):
        try:
            return address.value_for_protocol(protocol)
        except Exception:  # the multiaddr package raises its own kinds for a protocol that is not there
            continue
    return None


async def _dial_back(ip: str, port: int, timeout: float) -> str:
    """Open a new TCP connection to ``ip:port`` and check that a libp2p host answers the multistream handshake."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout)
    except asyncio.TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "error"
    try:
        writer.write(bytes([len(MULTISTREAM_HEADER)]) + MULTISTREAM_HEADER)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(64), timeout)
        return "reachable" if MULTISTREAM_HEADER in answer else "not libp2p"
    except (asyncio.TimeoutError, OSError):
        return "not libp2p"
    finally:
        writer.close()


async def _handle_check(
    stream_info,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    timeout: float = 3.0,
    read_timeout: float = 10.0,
) -> None:
    try:
        # the asker writes its request as soon as the stream opens; on a busy machine it may take seconds to come
        request = json.loads(await asyncio.wait_for(reader.readline(), read_timeout) or b"{}")
        ports = [port for port in request.get("ports", []) if isinstance(port, int) and 0 < port < 65536]
        ports = list(dict.fromkeys(ports))[:MAX_PORTS]
        ip = _observed_ip(stream_info.addr)
        results = {}
        if ip is not None:
            outcomes = await asyncio.gather(*(_dial_back(ip, port, timeout) for port in ports))
            results = {str(port): outcome for port, outcome in zip(ports, outcomes)}
        writer.write(json.dumps(dict(observed=ip, results=results)).encode() + b"\n")
        await writer.drain()
    except Exception as e:  # a malformed or abandoned request: nothing to answer
        logger.info(f"a reachability check from {stream_info.peer_id} got no answer ({type(e).__name__}: {e})")
    finally:
        writer.close()


@kept_until_done
async def _install_handler(_dht, node) -> None:
    await node.p2p.add_binary_stream_handler(PROTOCOL, _handle_check)


def serve_reachability_checks(dht: hivemind.DHT) -> None:
    """Answer other peers' reachability checks through this peer's libp2p host (in the DHT's process)."""
    dht.run_coroutine(_install_handler)


# -- the asking side -----------------------------------------------------------------------------------------


def free_port(host: str = "0.0.0.0") -> int:
    """A TCP port free on ``host`` now (to check it, then listen on it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _helper_ids(initial_peers: Sequence[str], max_helpers: int) -> list[PeerID]:
    ids = []
    for address in initial_peers:
        try:
            peer_id = PeerID.from_base58(Multiaddr(address).value_for_protocol("p2p"))
        except Exception:  # a multiaddr without a peer id: it cannot be asked
            continue
        if peer_id not in ids:
            ids.append(peer_id)
    return ids[:max_helpers]


async def _ask(p2p: P2P, helper: PeerID, ports: Sequence[int], timeout: float) -> HelperAnswer:
    answer = HelperAnswer(helper=helper.to_base58())
    try:
        _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(helper, PROTOCOL), timeout)
        try:
            writer.write(json.dumps(dict(ports=list(ports))).encode() + b"\n")
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), timeout)
        finally:
            writer.close()
        if not line:
            answer.problem = "it closed the stream without an answer"
            return answer
        reply = json.loads(line)
        answer.observed_address = reply.get("observed")
        answer.results = {int(port): result for port, result in dict(reply.get("results", {})).items()}
        if answer.observed_address is None:
            answer.problem = "it saw this peer through a relay, not at an address"
    except asyncio.TimeoutError:
        answer.problem = "no answer in time"
    except Exception as e:  # an older peer without the protocol, a dropped stream, a malformed reply
        answer.problem = f"{type(e).__name__}: {str(e)[:120]}"
    return answer


async def _ask_again_unless_answered(
    p2p: P2P, helper: PeerID, answer: HelperAnswer, ports: Sequence[int], timeout: float
) -> HelperAnswer:
    return answer if answer.reachable is not None else await _ask(p2p, helper, ports, timeout)


async def _probe(
    initial_peers: Sequence[str], host: str, port: int, extra_ports: Sequence[int], timeout: float, max_helpers: int
) -> ReachabilityVerdict:
    listen = f"/ip{'6' if ':' in host else '4'}/{host}/tcp/{port}"
    try:
        p2p = await P2P.create(initial_peers=list(initial_peers), host_maddrs=[listen], startup_timeout=timeout)
    except Exception as e:  # no initial peer answered, or the port is taken: the DHT's start will say which
        return ReachabilityVerdict(None, port, [HelperAnswer(helper="-", problem=f"{type(e).__name__}: {e}")])
    try:
        helpers = _helper_ids(initial_peers, max_helpers)
        ports = [port, *[p for p in extra_ports if p != port]][:MAX_PORTS]
        answers = list(await asyncio.gather(*(_ask(p2p, helper, ports, timeout) for helper in helpers)))
        # a helper busy with a round may drop one check: those that gave no answer are asked once more, since an anchor
        # that no helper could check must not start (it would join in client mode)
        answers = list(
            await asyncio.gather(
                *(
                    _ask_again_unless_answered(p2p, helper, answer, ports, timeout)
                    for helper, answer in zip(helpers, answers)
                )
            )
        )
    finally:
        await p2p.shutdown()
    votes = [answer.reachable for answer in answers if answer.reachable is not None]
    reachable = None if not votes else sum(votes) * 2 > len(votes)
    return ReachabilityVerdict(reachable, port, answers)


def probe_reachability(
    initial_peers: Sequence[str],
    host: str = "0.0.0.0",
    port: int = 0,
    extra_ports: Sequence[int] = (),
    timeout: float = 10.0,
    max_helpers: int = 3,
) -> ReachabilityVerdict:
    """Ask peers of the swarm whether they can dial this machine at ``port`` (see the module's docstring).

    Runs in a thread of its own (with its own event loop), so it works inside a notebook's running loop too.

    :param initial_peers: multiaddrs of peers already in the swarm (with /p2p/ ids): the helpers are among them
    :param host: the address this peer will listen on
    :param port: the port it will listen on (0: a free one is chosen, and returned in the verdict)
    :param extra_ports: more ports to ask about (the port of an announced address, after a port forward)
    :param timeout: seconds for starting the temporary host and for each helper's answer
    :param max_helpers: how many initial peers to ask
    """
    port = port or free_port(host)
    install_p2p_fixes()  # its temporary host's calls time out like any other
    outcome: list[ReachabilityVerdict] = []

    def run():
        outcome.append(asyncio.run(_probe(initial_peers, host, port, extra_ports, timeout, max_helpers)))

    thread = threading.Thread(target=run, name="collab_kit-reachability", daemon=True)
    thread.start()
    thread.join(timeout * 3 + 10)
    verdict = outcome[0] if outcome else ReachabilityVerdict(None, port, [HelperAnswer("-", problem="timed out")])
    logger.info(f"reachability: {verdict.explain()}")
    return verdict
