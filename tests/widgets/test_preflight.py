"""collab_kit.widgets.preflight: each problem a volunteer can meet is forced, and must be named with what to do.

The facts of this machine are read for real (gather_facts); a case this machine does not have (a GPU too
small, a full disk) is forced by changing the facts the checks judge. Reachability is tried for real on
127.0.0.1: a DHT that answers, a port where nothing listens.
"""

import dataclasses
import socket

import pytest

from collab_kit import get_preset
from collab_kit.config import SwarmConfig
from collab_kit.swarm.dht import start_dht
from collab_kit.swarm.reachability import HelperAnswer, ReachabilityVerdict
from collab_kit.units import GiB
from collab_kit.widgets.preflight import (
    NOTE,
    OK,
    PROBLEM,
    check_bitsandbytes,
    check_reachability,
    check_swarm,
    gather_facts,
    run_preflight,
)


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    return gather_facts(str(tmp_path_factory.mktemp("disk")))


def finding(report, check, device=None):
    [found] = [f for f in report.findings if f.check == check and (device is None or device in f.message)]
    return found


def closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_this_machine_is_read_for_real(facts):
    import psutil
    import torch

    assert facts.ram_bytes == psutil.virtual_memory().total
    assert 0 < facts.ram_available_bytes <= facts.ram_bytes
    assert facts.disk_free_bytes > 0
    assert (facts.gpu_name is not None) == torch.cuda.is_available()
    assert all(not address.startswith("127.") for address in facts.addresses)


def test_a_cpu_machine_is_ready_for_the_tiny_preset(facts):
    config = get_preset("tiny", swarm=dict(host="127.0.0.1"))
    report = run_preflight(config, facts=dataclasses.replace(facts, gpu_name=None, gpu_memory_bytes=None))
    assert report.ok, str(report)
    assert str(report).splitlines()[-1] == "ready to train"
    assert finding(report, "gpu").status == NOTE  # no GPU: fine for tiny
    assert finding(report, "bitsandbytes").status == OK  # a real 8-bit Adam step on this CPU
    chosen = report.apply(config)
    assert chosen.optimizer.batch_size_per_step == report.recommendation.micro_batch >= 1
    assert chosen.model.reversible == report.recommendation.checkpointing
    assert chosen.model.hidden_size == config.model.hidden_size  # the weights' shape is the run's, untouched


def test_no_gpu_for_the_paper_preset_is_a_problem_that_says_where_to_get_one(facts):
    report = run_preflight(
        get_preset("paper"), facts=dataclasses.replace(facts, gpu_name=None, gpu_memory_bytes=None), check_peers=False
    )
    gpu = finding(report, "gpu")
    assert gpu.status == PROBLEM and "no GPU" in gpu.message
    assert "Change runtime type" in gpu.advice and "Kaggle" in gpu.advice
    assert not report.ok and "PROBLEM gpu" in str(report)


def test_a_gpu_too_small_for_the_model_is_named_with_the_memory_it_has(facts):
    small_gpu = dataclasses.replace(facts, gpu_name="Tiny GPU", gpu_memory_bytes=1 * GiB, cuda_build="12.4")
    # on its own choice, the peer says why it cannot use the GPU, and trains on the CPU
    fallback = run_preflight(get_preset("paper"), facts=small_gpu, check_peers=False)
    device = finding(fallback, "device")
    assert device.status == NOTE and "the Tiny GPU's 1.00 GiB cannot hold this model" in device.message, device
    assert "training on the CPU" in device.message and fallback.plan.device.type == "cpu"
    # made to use it, the memory it lacks is the problem
    report = run_preflight(get_preset("paper"), facts=small_gpu, check_peers=False, device="cuda")
    memory = finding(report, "memory")
    assert memory.status == PROBLEM and "too little GPU memory" in memory.message
    assert memory.advice
    assert not report.recommendation.fits
    # the same run on a large GPU fits
    large = run_preflight(
        get_preset("paper"),
        check_peers=False,
        facts=dataclasses.replace(
            facts, gpu_name="an 80 GiB GPU", gpu_memory_bytes=80 * GiB, ram_available_bytes=64 * GiB
        ),
    )
    assert finding(large, "memory").status == OK
    assert large.recommendation.micro_batch >= 1


def test_too_little_ram_or_disk_is_named(facts):
    starved = dataclasses.replace(
        facts,
        gpu_name="an 80 GiB GPU",
        gpu_memory_bytes=80 * GiB,
        ram_available_bytes=256 * 1024**2,
        disk_free_bytes=10 * 1024**2,
    )
    report = run_preflight(get_preset("paper"), facts=starved, check_peers=False)
    ram, disk = finding(report, "ram"), finding(report, "disk")
    assert ram.status == PROBLEM and "too little RAM" in ram.message and ram.advice
    assert disk.status == PROBLEM and "too little disk space" in disk.message and "Free some space" in disk.advice
    # on a CPU the RAM is where the model trains: too little of it is the memory problem
    cpu_only = run_preflight(
        get_preset("small"),
        check_peers=False,
        facts=dataclasses.replace(facts, gpu_name=None, gpu_memory_bytes=None, ram_available_bytes=1024**2),
    )
    assert finding(cpu_only, "memory").status == PROBLEM and "too little RAM:" in finding(cpu_only, "memory").message


T4 = dict(
    gpu_name="Tesla T4",
    gpu_memory_bytes=15 * GiB,
    gpu_capability=(7, 5),
    cuda_build="12.4",
    ram_available_bytes=12 * GiB,
)
A100 = dict(
    gpu_name="NVIDIA A100-SXM4-40GB",
    gpu_memory_bytes=40 * GiB,
    gpu_capability=(8, 0),
    cuda_build="12.4",
    ram_available_bytes=64 * GiB,
)


def test_the_preflight_chooses_the_device_and_precision_and_says_why(facts):
    paper = get_preset("paper")
    t4 = run_preflight(paper, facts=dataclasses.replace(facts, **T4), check_peers=False)
    said = finding(t4, "device")
    assert said.status == OK and said.message.startswith(
        "Tesla T4: fp16 with loss scaling (compute capability 7.5 has no bf16), micro-batch "
    )
    assert "of 15.00 GiB" in said.message and (t4.plan.device.type, t4.plan.precision) == ("cuda", "fp16")
    assert f"micro-batch {t4.recommendation.micro_batch}," in said.message
    a100 = run_preflight(paper, facts=dataclasses.replace(facts, **A100), check_peers=False)
    assert a100.plan.precision == "bf16" and "bf16 (compute capability 8.0" in finding(a100, "device").message
    cpu = run_preflight(
        get_preset("tiny"), facts=dataclasses.replace(facts, gpu_name=None, gpu_memory_bytes=None), check_peers=False
    )
    assert (cpu.plan.device.type, cpu.plan.precision) == ("cpu", "fp32")
    assert finding(cpu, "device").message.startswith("CPU: fp32 (no GPU")
    # asked for a GPU this machine does not have: one sentence, and the CPU instead
    none = run_preflight(
        get_preset("tiny"),
        facts=dataclasses.replace(facts, gpu_name=None, gpu_memory_bytes=None, cuda_build="12.4"),
        check_peers=False,
        device="cuda",
    )
    assert finding(none, "device").status == PROBLEM and "no CUDA GPU is visible" in finding(none, "device").message
    assert none.plan.device.type == "cpu" and not none.ok
    # a GPU that a CPU-only torch cannot see: said, and the CPU
    hidden = run_preflight(
        get_preset("tiny"),
        check_peers=False,
        facts=dataclasses.replace(facts, gpu_name=None, gpu_memory_bytes=None, cuda_build=None, nvidia_driver=True),
    )
    assert "CPU-only build" in finding(hidden, "device").message and hidden.plan.device.type == "cpu"


def test_bitsandbytes_that_cannot_step_on_a_device_is_a_problem():
    # the meta device holds no data: a real 8-bit step fails there, as it does on a GPU whose CUDA
    # library bitsandbytes cannot load
    broken = check_bitsandbytes("meta")
    assert broken.status == PROBLEM and "does not work on meta" in broken.message and "pip install" in broken.advice
    assert check_bitsandbytes("meta", needed=False).status == NOTE


def test_an_unreachable_swarm_is_named_and_a_live_one_answers():
    import hivemind

    dead = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    unreachable = check_swarm([dead], timeout=2.0)
    assert unreachable.status == PROBLEM and "cannot reach the swarm" in unreachable.message
    assert "refused" in unreachable.message.lower() and "Copy the whole" in unreachable.advice

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        live = [str(maddr) for maddr in dht.get_visible_maddrs()]
        assert check_swarm(live + [dead], timeout=2.0).status == OK  # one answering peer is enough
        report = run_preflight(
            get_preset("tiny", swarm=dict(host="127.0.0.1", initial_peers=live)),
            facts=dataclasses.replace(gather_facts("."), gpu_name=None, gpu_memory_bytes=None),
        )
        assert finding(report, "swarm").status == OK
    finally:
        dht.shutdown()


def test_a_peer_without_a_public_address_joins_in_client_mode(facts):
    peers = ["/ip4/10.77.0.10/tcp/31337/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"]  # never dialled
    behind_nat = dataclasses.replace(facts, addresses=("192.168.1.20",))
    joining = get_preset("small", swarm=dict(initial_peers=peers, host="0.0.0.0"))
    found, reachability = check_reachability(behind_nat, joining)
    assert reachability.client_mode and "client mode" in found.message
    # with a public address it listens for others
    found, reachability = check_reachability(dataclasses.replace(facts, addresses=("8.8.8.8",)), joining)
    assert found.status == OK and not reachability.client_mode and "8.8.8.8" in found.message
    # behind NAT with a forwarded port it announces: others dial the announced address
    forwarded = get_preset(
        "small", swarm=dict(initial_peers=peers, host="0.0.0.0", announce_maddrs=["/ip4/8.8.8.8/tcp/31337"])
    )
    found, reachability = check_reachability(behind_nat, forwarded)
    assert found.status == OK and not reachability.client_mode and reachability.public_addresses == ("8.8.8.8",)
    # starting a swarm behind NAT: it starts (peers of this network can join), and the note says who cannot
    found, reachability = check_reachability(behind_nat, get_preset("small", swarm=dict(host="0.0.0.0")))
    assert found.status == NOTE and "not peers elsewhere on the Internet" in found.message
    assert "announce_maddrs" in found.advice and "INITIAL_PEERS" in found.advice and not reachability.client_mode
    # the whole preflight turns client mode on for the peer that joins from behind NAT
    report = run_preflight(
        joining, facts=dataclasses.replace(behind_nat, gpu_name=None, gpu_memory_bytes=None), check_peers=False
    )
    assert report.apply(joining).swarm.client_mode


def test_reachability_is_asked_of_the_swarms_peers_elsewhere_not_of_a_swarm_on_this_computer(facts):
    # a swarm on this computer dials this peer on 127.0.0.1: no probe, no client mode, whatever the address class
    dht = start_dht(SwarmConfig(host="127.0.0.1"))
    try:
        live = [str(maddr) for maddr in dht.get_visible_maddrs()]
        joining = get_preset("tiny", swarm=dict(initial_peers=live))
        report = run_preflight(
            joining, facts=dataclasses.replace(facts, addresses=("192.168.1.20",), gpu_name=None, gpu_memory_bytes=None)
        )
        found = finding(report, "reachability")
        assert found.status == OK and "on this computer" in found.message, found
        assert report.apply(joining).swarm.client_mode is False and report.reachability.swarm is None
    finally:
        dht.shutdown()
    # peers elsewhere that dialled this one back (the probe against real peers: tests/netlab/test_network_lab.py): a
    # private address, yet reachable: the check, not the address class, decides, and the address they saw is announced
    elsewhere = get_preset(
        "tiny",
        swarm=dict(
            initial_peers=["/ip4/10.77.0.10/tcp/31337/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"]
        ),
    )
    verdict = ReachabilityVerdict(True, 4242, [HelperAnswer("12D3KooWDpJ7", "10.77.1.3", {4242: "reachable"})])
    resolved = dataclasses.replace(
        elsewhere.swarm, client_mode=False, port=4242, announce_maddrs=("/ip4/10.77.1.3/tcp/4242",)
    )
    found, reachability = check_reachability(
        dataclasses.replace(facts, addresses=("192.168.1.20",)), elsewhere, verdict, resolved
    )
    assert found.status == OK and "dialled this one back at 10.77.1.3" in found.message, found
    assert not reachability.client_mode and reachability.swarm.announce_maddrs == ("/ip4/10.77.1.3/tcp/4242",)
