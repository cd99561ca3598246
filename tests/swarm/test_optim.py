"""The paper's optimizer: schedule, parameter groups, 8-bit LAMB, compression, and the hivemind wiring."""

import contextlib
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from hivemind.compression.base import CompressionInfo
from hivemind.proto import runtime_pb2
from waiting import wait_until

from collab_kit.config import SwarmConfig, get_preset
from collab_kit.model.transformer import TextToImageTransformer
from collab_kit.swarm.anchor import state_sources
from collab_kit.swarm.averagers import CLIENT_JOIN_ANSWER_TIMEOUT, STATE_DOWNLOAD_PART_TIMEOUT, ForkedTorchThreadsMixin
from collab_kit.swarm.dht import start_dht
from collab_kit.swarm.lamb import gradient_compression, linear_warmup_then_decay, make_lamb8bit, parameter_groups
from collab_kit.swarm.optimizer import NO_STATE_AVERAGING
from collab_kit.swarm.progress import SwarmProgressTracker


def test_schedule_warms_up_linearly_then_decays_to_zero():
    warmup, total = 3125, 31250  # the paper: 10% of 31250 steps
    rates = [linear_warmup_then_decay(step, warmup, total) for step in range(total + 1)]
    assert 0 < rates[0] < rates[1000] < rates[3000] <= 1.0
    assert rates[warmup] == pytest.approx(1.0)
    assert rates[warmup + (total - warmup) // 2] == pytest.approx(0.5, abs=1e-3)
    assert rates[total] == 0.0
    assert all(a <= b for a, b in zip(rates[:warmup], rates[1 : warmup + 1]))
    assert all(a >= b for a, b in zip(rates[warmup:], rates[warmup + 1 :]))


def test_biases_and_norms_get_no_weight_decay():
    model = TextToImageTransformer(get_preset("tiny").model)
    decay, no_decay = parameter_groups(model, weight_decay=0.045)
    assert decay["weight_decay"] == 0.045 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize(
    "numel, expected", [(2**16, "UNIFORM_8BIT"), (2**16 + 5, "UNIFORM_8BIT"), (2**16 - 1, "FLOAT16"), (32, "FLOAT16")]
)
def test_size_adaptive_compression_follows_the_papers_threshold(numel, expected):
    compression = gradient_compression(threshold=2**16)
    tensor = torch.randn(numel)
    serialized = compression.compress(tensor, CompressionInfo.from_tensor(tensor))
    assert runtime_pb2.CompressionType.Name(serialized.compression) == expected
    restored = compression.extract(serialized)  # what the receiving peer decodes
    error = (restored - tensor).abs()
    if expected == "UNIFORM_8BIT":
        assert error.mean() < 0.02 and serialized.ByteSize() < 0.27 * tensor.numel() * 4
    else:
        assert error.max() < 1e-2 and serialized.ByteSize() <= 0.5 * tensor.numel() * 4 + 32  # + a small header


def test_lamb8bit_keeps_8bit_statistics_clips_gradients_and_moves_biases():
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256)
    torch.nn.init.zeros_(layer.bias)
    config = get_preset("paper").optimizer
    optimizer = make_lamb8bit(parameter_groups(layer, config.weight_decay), config)
    layer.weight.grad = torch.full_like(layer.weight, 10.0)  # norm 2560, far above max_grad_norm=4
    layer.bias.grad = torch.ones_like(layer.bias)
    optimizer.step()
    assert optimizer.last_grad_norm == pytest.approx((2560.0**2 + 256) ** 0.5, rel=1e-4)
    clipped = torch.cat([layer.weight.grad.flatten(), layer.bias.grad]).norm()
    assert clipped == pytest.approx(config.max_grad_norm, rel=1e-4)
    state = optimizer.state[layer.weight]
    assert state["state1"].dtype == torch.uint8 and state["state2"].dtype == torch.uint8
    # biases skip the trust ratio: a zero-initialized bias takes a plain Adam step of about lr
    assert layer.bias.detach().abs().max().item() == pytest.approx(config.learning_rate, rel=0.05)


@pytest.mark.parametrize("gradient_scale", [1e-4, 1.0, 1e3])
def test_lamb8bit_steps_each_matrix_by_lr_times_its_norm_whatever_the_gradient_scale(gradient_scale):
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    config = get_preset("paper").optimizer
    config.max_grad_norm = 1e9  # no clipping: look at the trust ratio alone
    optimizer = make_lamb8bit(parameter_groups(layers, 0.0), config)
    before = [layer.weight.detach().clone() for layer in layers]
    for layer, scale in zip(layers, (gradient_scale, 1.0)):
        layer.weight.grad = torch.randn_like(layer.weight) * scale
        layer.bias.grad = torch.zeros_like(layer.bias)
    optimizer.step()
    for layer, old in zip(layers, before):
        step = (layer.weight.detach() - old).norm() / old.norm()
        assert step == pytest.approx(config.learning_rate, rel=1e-3)


# hivemind allows one Optimizer per process: this one is built in a process of its own
WIRING_CHECK = textwrap.dedent("""
    import json, torch, hivemind
    from collab_kit.config import get_preset
    from collab_kit.model.transformer import TextToImageTransformer
    from collab_kit.swarm.lamb import LAMB8bit
    from collab_kit.swarm.optimizer import make_optimizer
    from collab_kit.swarm.dht import start_dht
    config = get_preset("tiny")
    dht = start_dht(config.swarm)
    model = TextToImageTransformer(config.model)
    opt = make_optimizer(model, dht, "wiring", config.optimizer)
    try:
        inner = opt.state_averager.optimizer
        with opt.grad_averager.get_tensors() as averaged:
            averaged_shapes = [list(tensor.shape) for tensor in averaged]
        # the order docs/run-your-own.md gives a hand-written peer: tensors of 2+ dimensions, then 1-D ones,
        # in model order
        documented = ([list(p.shape) for _, p in model.named_parameters() if p.ndim >= 2] +
                      [list(p.shape) for _, p in model.named_parameters() if p.ndim < 2])
        print(json.dumps(dict(
            inner=type(inner).__name__, is_lamb=isinstance(inner, LAMB8bit),
            lr=inner.param_groups[0]["lr"], betas=list(inner.param_groups[0]["betas"]),
            weight_decays=[g["weight_decay"] for g in inner.param_groups],
            max_grad_norm=inner.max_grad_norm, offload=opt.offload_optimizer, delay=opt.delay_optimizer_step,
            target=opt.target_batch_size, matchmaking=opt.matchmaking_time, timeout=opt.averaging_timeout,
            join_timeout=opt.grad_averager.client_join_timeout,
            compression=type(opt.grad_averager.allreduce_kwargs["compression"]).__name__,
            threshold=opt.grad_averager.allreduce_kwargs["compression"].threshold,
            state_on_cpu=all(p.device.type == "cpu" for g in inner.param_groups for p in g["params"]),
            averaged_shapes=averaged_shapes, documented_shapes=documented,
            state_shapes=[list(p.shape) for p in opt.state_averager.main_parameters],
            model_order_shapes=[list(p.shape) for p in model.parameters()],
        )))
    finally:
        opt.shutdown(); dht.shutdown()
""")


def test_make_optimizer_wires_the_papers_choices_into_hivemind():
    result = subprocess.run([sys.executable, "-c", WIRING_CHECK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    wiring = json.loads(result.stdout.strip().splitlines()[-1])
    config = get_preset("tiny").optimizer
    assert wiring["is_lamb"] and wiring["max_grad_norm"] == config.max_grad_norm
    # the scheduler has already set step 0's warm-up rate
    assert 0 < wiring["lr"] < config.learning_rate and wiring["betas"] == list(config.betas)
    assert wiring["weight_decays"] == [config.weight_decay, 0.0]
    assert wiring["offload"] and wiring["delay"] and wiring["state_on_cpu"]
    assert wiring["target"] == config.target_batch_size
    assert wiring["matchmaking"] == config.matchmaking_time and wiring["timeout"] == config.averaging_timeout
    assert wiring["join_timeout"] == config.averaging_timeout  # a round not scheduled ahead, in client mode
    assert wiring["compression"] == "SizeAdaptiveCompression" and wiring["threshold"] == 2**16
    # gradients and parameters are averaged in the order docs/run-your-own.md documents for a
    # hand-written peer (hivemind pairs tensors by position): not the model's own order
    assert wiring["averaged_shapes"] == wiring["documented_shapes"] == wiring["state_shapes"]
    assert wiring["documented_shapes"] != wiring["model_order_shapes"]


def test_a_held_step_leaves_parameters_and_statistics_as_they_are():
    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 128)
    config = get_preset("paper").optimizer
    optimizer = make_lamb8bit(parameter_groups(layer, config.weight_decay), config)
    for param in layer.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    statistics = optimizer.state[layer.weight]["state1"].clone()
    optimizer.hold_next_step()  # the anchor's round that no training peer reached
    optimizer.step()
    assert all(torch.equal(before[name], p) for name, p in layer.named_parameters())
    assert torch.equal(statistics, optimizer.state[layer.weight]["state1"])
    optimizer.step()  # only the next step is held
    assert not torch.equal(before["weight"], layer.weight)


def test_round_reports_keep_hiveminds_averager_name_and_travel_between_processes():
    import pickle

    from hivemind.optim.grad_averager import GradientAverager

    from collab_kit.swarm.averagers import ANCHOR_ROLE, RoundResult, round_report_averager_class

    averager_class = round_report_averager_class(GradientAverager, ANCHOR_ROLE)
    # hivemind names RPCs after the class: a peer with the mixin and one without still talk to each other
    assert averager_class.__name__ == "GradientAverager" and averager_class.round_role == ANCHOR_ROLE
    result = RoundResult({"a": "trainer", "b": ANCHOR_ROLE})
    result.received, result.failed_senders = 0.5, 1
    copy = pickle.loads(pickle.dumps(result))
    assert copy == result and (copy.received, copy.failed_senders) == (0.5, 1)


def test_a_sender_dropped_after_its_last_part_left_nothing_out():
    import asyncio

    from hivemind.averaging.partition import TensorPartReducer

    from collab_kit.swarm.averagers import senders_left_out

    async def one_round():
        reducer = TensorPartReducer([(2,), (2,)], num_senders=3)
        reducer.on_sender_failed(1)  # gone before its first part: the parts are averaged without it
        for part in range(2):
            await asyncio.gather(*(reducer.accumulate_part(sender, part, torch.ones(2)) for sender in (0, 2)))
        reducer.on_sender_failed(2)  # its stream broke as it closed, after every part was averaged
        return senders_left_out(reducer)

    assert asyncio.run(one_round()) == 1


def test_an_anchor_serves_no_state_older_than_the_swarms():
    # two volunteers at the swarm's epoch 12 (one record a report behind), and a joiner that has not loaded yet
    records = [(b"behind", 11), (b"ahead", 12), (b"joiner", 0)]
    assert state_sources(records, 12) == (b"ahead", b"behind")
    # every volunteer gone but a joiner: nobody's state is the swarm's, none is served
    assert state_sources([(b"joiner", 0)], 12) == ()
    assert state_sources([], 12) == ()


def test_a_rounds_epoch_is_its_anchors_or_its_majoritys_and_never_one_members_claim():
    from collab_kit.swarm.averagers import ANCHOR_ROLE, TRAINER_ROLE, RoundResult, round_member

    def epoch_of(*members):
        return RoundResult({f"peer{i}": member for i, member in enumerate(members)}).epoch()

    trainer, anchor = (
        (lambda epoch: round_member(TRAINER_ROLE, epoch)),
        (lambda epoch: round_member(ANCHOR_ROLE, epoch)),
    )
    assert epoch_of(trainer(10), anchor(11), trainer(11), trainer(11)) == 11  # the NAT lab's late joiner
    assert epoch_of(trainer(10), anchor(11)) == 11  # the anchor's epoch is the swarm's for peers in client mode
    assert epoch_of(trainer(4), trainer(4), trainer(9)) == 4  # the majority
    # a hostile member's claim decides nothing, alone against one other, or as half of the group
    assert epoch_of(trainer(4), trainer(10**9)) is None
    assert epoch_of(trainer(4), trainer(4), trainer(7), trainer(7)) is None
    assert epoch_of(trainer(4), "trainer", "not a member") is None  # peers that sent no epoch count against it


# -- averagers in forked processes --------------------------------------------------------------------------------


# In an interpreter of its own: whether the parent's torch thread pool exists when it forks (what the race needs)
# depends on what ran in it before, so the pytest process, after other tests, is no place to measure it
FORKED_THREADS_RACE = textwrap.dedent("""
    import json, multiprocessing as mp, platform, threading, torch
    from collab_kit.swarm.averagers import ForkedTorchThreadsMixin

    class ThreadsAtOnce(mp.get_context("fork").Process):
        # a forked process whose threads run their first tensor operation at the same moment, as hivemind's
        # averagers compress the parts of their first round; it reports how many of them failed
        def __init__(self, results, threads=4):
            super().__init__(daemon=True)
            self.results, self.threads = results, threads

        def run(self):
            barrier, failures = threading.Barrier(self.threads), []

            def first_operation():
                barrier.wait()
                try:
                    torch.ones(300_000).mean()
                except RuntimeError as e:  # "pool INTERNAL ASSERT FAILED ... Invalid thread pool!"
                    failures.append(str(e))

            workers = [threading.Thread(target=first_operation) for _ in range(self.threads)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            self.results.put(len(failures))

    class ThreadsAtOnceRebuilt(ForkedTorchThreadsMixin, ThreadsAtOnce):
        pass

    def failed_processes(process_class, count=12):
        results, failed = mp.get_context("fork").Queue(), 0
        for _ in range(count):
            process = process_class(results)
            process.start()
            failed += results.get(timeout=60) > 0
            process.join(timeout=10)
        return failed

    torch.set_num_threads(2)  # a trainer with more than one torch thread (volunteers use every core)
    torch.randn(500, 500).sum()  # the trainer used torch before hivemind forked its averagers
    print(json.dumps(dict(plain=failed_processes(ThreadsAtOnce), rebuilt=failed_processes(ThreadsAtOnceRebuilt),
                          machine=platform.machine(), torch=torch.__version__,
                          parallel=torch.__config__.parallel_info().splitlines()[:6])))
""")


def test_averager_processes_rebuild_torch_threads_before_their_threads_race():
    finished = subprocess.run([sys.executable, "-c", FORKED_THREADS_RACE], capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    failed = json.loads(finished.stdout.strip().splitlines()[-1])
    # without the mixin the race must show, or the test would show nothing: on this project's x86_64 machines 11 or
    # 12 of the 12 plain processes fail; a CI machine once showed none (its torch build or CPU did not race)
    if failed["plain"] == 0:
        pytest.skip(f"the race does not show on this machine, so there is nothing to rebuild against: {failed}")
    assert failed["rebuilt"] == 0, failed
    # every averager the kit builds carries it: gradient averagers (plain, CenteredClip, authorized) and state averagers
    from hivemind.optim.grad_averager import GradientAverager

    from collab_kit.swarm.averagers import (
        ANCHOR_ROLE,
        TRAINER_ROLE,
        recording_state_averager_class,
        round_report_averager_class,
    )
    from collab_kit.swarm.robust import with_centered_clip

    for role in (TRAINER_ROLE, ANCHOR_ROLE):
        averager_class = round_report_averager_class(GradientAverager, role)
        assert issubclass(averager_class, ForkedTorchThreadsMixin)
        assert issubclass(with_centered_clip(averager_class), ForkedTorchThreadsMixin)
    assert issubclass(recording_state_averager_class(), ForkedTorchThreadsMixin)


# a peer in client mode on loopback, with the tiny preset (matchmaking_time 2 s): what its averagers' processes were
# given and printed; beside it, hivemind's own averager in client mode with the same wait (the control)
CLIENT_MODE_AVERAGERS = textwrap.dedent("""
    import json, sys, hivemind, torch
    from collab_kit.config import SwarmConfig, get_preset
    from collab_kit.model.transformer import TextToImageTransformer
    from collab_kit.swarm.averagers import CLIENT_JOIN_ANSWER_TIMEOUT
    from collab_kit.swarm.optimizer import make_optimizer
    from collab_kit.swarm.dht import join_addresses, start_dht

    first = start_dht(SwarmConfig(host="127.0.0.1"))
    client = start_dht(SwarmConfig(host="127.0.0.1", client_mode=True, initial_peers=join_addresses(first)))
    config = get_preset("tiny").optimizer
    optimizer = make_optimizer(TextToImageTransformer(get_preset("tiny").model), client, "run", config,
    client_mode=True)
    waits = [averager.matchmaking_kwargs["request_timeout"]
             for averager in (optimizer.grad_averager, optimizer.state_averager)]
    state = optimizer.state_averager
    download = dict(part=state.next_chunk_timeout, rounds=[state.allreduce_kwargs["sender_timeout"],
                                                           state.allreduce_kwargs["reducer_timeout"]],
                    chunk_timeout=config.chunk_timeout)
    optimizer.shutdown()
    print("--- hivemind's own averager", file=sys.stderr, flush=True)
    plain = hivemind.DecentralizedAverager([torch.zeros(3)], client, prefix="plain", client_mode=True,
                                           min_matchmaking_time=config.matchmaking_time,
                                           request_timeout=CLIENT_JOIN_ANSWER_TIMEOUT, start=True)
    plain.shutdown()
    client.shutdown()
    first.shutdown()
    print(json.dumps(dict(waits=waits, matchmaking_time=config.matchmaking_time, download=download)), flush=True)
""")


def test_a_peer_in_client_mode_waits_for_its_leader_and_for_state_parts_as_its_link_needs_and_prints_no_advice():
    """A join request crosses a volunteer's home link twice; on a thin link that is full, that takes seconds whatever
    the preset's matchmaking time. hivemind's advice to wait less than matchmaking_time is for peers that lead."""
    finished = subprocess.run(
        [sys.executable, "-c", CLIENT_MODE_AVERAGERS], capture_output=True, text=True, timeout=180
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    assert (
        result["waits"] == [CLIENT_JOIN_ANSWER_TIMEOUT] * 2 and CLIENT_JOIN_ANSWER_TIMEOUT > result["matchmaking_time"]
    )
    kit, plain = finished.stderr.split("--- hivemind's own averager")
    advice = "request_timeout smaller than min_matchmaking_time"
    assert advice not in kit, kit
    assert advice in plain, plain  # the control: the same wait in hivemind's own averager prints it
    # a download of the swarm's state waits for each part as a thin link needs; the state's own averaging rounds keep
    # the preset's timeouts, as hivemind derives them from next_chunk_timeout
    download = result["download"]
    assert download["part"] == STATE_DOWNLOAD_PART_TIMEOUT > download["chunk_timeout"], download
    assert download["rounds"] == [download["chunk_timeout"], 2 * download["chunk_timeout"]], download


# a leader and a peer in client mode, in one process. argv[1]: the leader, the kit's anchor (expecting this peer and one
# that never comes, as a peer that fell behind) or hivemind's averager ("plain", which starts at its own time);
# argv[2]: the peer's round, not scheduled ahead with the timeout CollaborativeOptimizer gives ("join") or with none,
# as hivemind leaves it ("none"), or with a timeout shorter than the leader's wait ("short"). The matchmaking logs say
# who was turned away.
LEADER_AND_CLIENT = textwrap.dedent("""
    import json, logging, sys, torch
    from hivemind.optim.grad_averager import GradientAverager
    from hivemind.utils import get_dht_time
    from collab_kit.config import SwarmConfig, get_preset
    from collab_kit.swarm.averagers import ANCHOR_ROLE, TRAINER_ROLE, round_report_averager_class
    from collab_kit.swarm.dht import join_addresses, start_dht

    logging.getLogger("hivemind.averaging.matchmaking").setLevel(logging.DEBUG)
    leader_kind, client_round = sys.argv[1:3]
    config = get_preset("tiny").optimizer
    leader_dht = start_dht(SwarmConfig(host="127.0.0.1", client_mode=False))
    client_dht = start_dht(SwarmConfig(host="127.0.0.1", client_mode=True, initial_peers=join_addresses(leader_dht)))
    options = dict(dht=None, prefix="run_grad_averager", min_matchmaking_time=config.matchmaking_time,
                   request_timeout=1.0, warn=False, start=True)

    def averager(averager_class, dht, **kwargs):
        return averager_class([torch.nn.Parameter(torch.ones(8))], **dict(options, dht=dht, **kwargs))

    if leader_kind == "anchor":
        leader = averager(round_report_averager_class(GradientAverager, ANCHOR_ROLE), leader_dht)
        leader.expect_peers([client_dht.peer_id.to_bytes(), b"a peer that fell behind"])
    else:
        leader = averager(GradientAverager, leader_dht)
    client = averager(round_report_averager_class(GradientAverager, TRAINER_ROLE), client_dht, client_mode=True)
    client.client_join_timeout = config.averaging_timeout if client_round == "join" else None
    # the leader's time: the epoch's estimated end, then a chunk's timeout for peers that are late (AnchorOptimizer)
    leader_time = get_dht_time() + config.matchmaking_time + 6
    leader_round = leader.schedule_step(scheduled_time=leader_time, timeout=30)
    leader_round.weight = 0.0
    leader.step(control=leader_round, wait=False)
    # a round at an epoch's end that was not foreseen: no schedule. With no timeout, a peer turned away that then misses
    # the leader's last declaration looks for a group for good (the round hivemind loses): the script waits 60 s at most
    client_round_control = client.step(weight=1.0, timeout=4.0 if client_round == "short" else None, wait=False)
    try:
        said = client_round_control.result(timeout=60)
        joined = dict(members=len(said), before_leader_time=get_dht_time() < leader_time)
    except Exception as error:
        client_round_control.cancel()
        joined = dict(members=0, error=repr(error))
    for running in (client, leader, client_dht, leader_dht):
        running.shutdown()
    print(json.dumps(joined), flush=True)
""")


def run_leader_and_client(leader: str, client_round: str):
    finished = subprocess.run(
        [sys.executable, "-c", LEADER_AND_CLIENT, leader, client_round], capture_output=True, text=True, timeout=120
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    return json.loads(finished.stdout.strip().splitlines()[-1]), finished.stderr


def test_a_peer_in_client_mode_whose_round_was_not_scheduled_ahead_asks_for_the_optimizers_timeout():
    """In the NAT lab, the late joiner's first round after a download started at the epoch's end with no timeout (as
    hivemind's optimizer does a round it did not schedule), asked to start within matchmaking_time, and its leader,
    whose time was later, turned it away: a round lost, and the state downloaded again (11 s on its link)."""
    joined, log = run_leader_and_client("plain", "join")
    assert joined["members"] == 2 and "BAD_EXPIRATION_TIME" not in log, (joined, log[-3000:])
    # the control: as hivemind leaves it, the leader turns the peer away
    joined, log = run_leader_and_client("plain", "none")
    assert "BAD_EXPIRATION_TIME" in log, (joined, log[-3000:])


def test_an_anchor_lets_in_a_peer_whose_time_comes_before_its_own_and_starts_the_group_by_then():
    """The anchor's time holds a chunk's timeout for late peers, and moves on while it waits for a peer it expects: in
    the NAT lab, a volunteer back from a cut link asked to start before it and was turned away (then downloaded the
    state again). hivemind's leader turns such a peer away, as it would give up before the leader's time."""
    joined, log = run_leader_and_client("anchor", "short")
    assert joined["members"] == 2 and joined["before_leader_time"], (joined, log[-3000:])
    assert "BAD_EXPIRATION_TIME" not in log, log[-3000:]
    joined, log = run_leader_and_client("plain", "short")  # the control: hivemind's leader
    assert "BAD_EXPIRATION_TIME" in log and joined["members"] == 0, (joined, log[-3000:])


# an anchor that leads, a volunteer in client mode that joins it at once, and a second anchor that starts looking 4 s
# later, as one whose reading of the epoch's end came later. argv[1]: whether the leader expects the second anchor.
LEADER_AND_LATE_CO_ANCHOR = textwrap.dedent("""
    import json, sys, threading, torch
    from hivemind.optim.grad_averager import GradientAverager
    from hivemind.utils import get_dht_time
    from collab_kit.config import SwarmConfig, get_preset
    from collab_kit.swarm.averagers import ANCHOR_ROLE, TRAINER_ROLE, round_report_averager_class
    from collab_kit.swarm.dht import join_addresses, start_dht

    config, expects_co_anchor = get_preset("tiny").optimizer, sys.argv[1] == "expected"
    leader_dht = start_dht(SwarmConfig(host="127.0.0.1", client_mode=False))
    co_dht = start_dht(SwarmConfig(host="127.0.0.1", client_mode=False, initial_peers=join_addresses(leader_dht)))
    client_dht = start_dht(SwarmConfig(host="127.0.0.1", client_mode=True, initial_peers=join_addresses(leader_dht)))
    options = dict(prefix="run_grad_averager", min_matchmaking_time=config.matchmaking_time, request_timeout=1.0,
                   warn=False, start=True)
    anchor_class = round_report_averager_class(GradientAverager, ANCHOR_ROLE)

    def averager(averager_class, dht, **kwargs):
        return averager_class([torch.nn.Parameter(torch.ones(8))], **dict(options, dht=dht, **kwargs))

    leader, co_anchor = averager(anchor_class, leader_dht), averager(anchor_class, co_dht)
    co_anchors = [co_dht.peer_id.to_bytes()] if expects_co_anchor else []
    leader.expect_peers([client_dht.peer_id.to_bytes()], co_anchors, co_anchor_wait=20.0)
    client = averager(round_report_averager_class(GradientAverager, TRAINER_ROLE), client_dht, client_mode=True)
    client.client_join_timeout = config.averaging_timeout
    leader_time = get_dht_time() + config.matchmaking_time + 6
    leader_round = leader.schedule_step(scheduled_time=leader_time, timeout=30)
    leader_round.weight = 0.0
    leader.step(control=leader_round, wait=False)
    co_round = []

    def co_anchor_looks():  # its time comes after the leader's: it joins the leader's group, or finds none
        co_round.append(co_anchor.step(weight=0.0, scheduled_time=leader_time + 5, timeout=30, wait=False))

    late = threading.Timer(4.0, co_anchor_looks)
    late.start()
    said = client.step(weight=1.0)
    late.join()
    for running in (client, co_anchor, leader, client_dht, co_dht, leader_dht):
        running.shutdown()
    print(json.dumps(dict(members=len(said))), flush=True)
""")


def test_an_anchor_that_leads_waits_for_the_runs_other_anchor_before_it_starts_the_group():
    """In the NAT lab with two anchors, one started looking a moment after the volunteers had joined the other, which
    started the group without it and reduced the whole vector: that anchor's link carried 0.72 of one anchor's alone
    over three epochs instead of half. The leader now waits for the run's other anchors too (at most co_anchor_wait
    once its training peers are in)."""
    results = {}
    for expected in ("expected", "unexpected"):
        finished = subprocess.run(
            [sys.executable, "-c", LEADER_AND_LATE_CO_ANCHOR, expected], capture_output=True, text=True, timeout=120
        )
        assert finished.returncode == 0, finished.stderr[-3000:]
        results[expected] = json.loads(finished.stdout.strip().splitlines()[-1])["members"]
    # the control: a leader that waits only for its training peers starts without the late anchor
    assert results == {"expected": 3, "unexpected": 2}, results


# a peer that accepts connections, alone on loopback: the state-averaging period hivemind reads at a global step, before
# and after the peer is found apart from the swarm, and after the step that loads the swarm's state takes that request
STATE_ROUND_AFTER_RESYNC = textwrap.dedent("""
    import json
    from collab_kit.config import SwarmConfig, get_preset
    from collab_kit.model.transformer import TextToImageTransformer
    from collab_kit.swarm.optimizer import make_optimizer
    from collab_kit.swarm.dht import start_dht

    dht = start_dht(SwarmConfig(host="127.0.0.1"))
    config = get_preset("tiny").optimizer
    optimizer = make_optimizer(TextToImageTransformer(get_preset("tiny").model), dht, "run", config)
    periods = [optimizer.average_state_every]
    optimizer.request_resync("its round came back in part")
    periods.append(optimizer.average_state_every)
    wants = optimizer._should_load_state_from_peers()  # what hivemind's next step asks; it loads when True
    periods.append(optimizer.average_state_every)
    optimizer.shutdown()
    dht.shutdown()
    print(json.dumps(dict(periods=periods, wants=wants, configured=config.average_state_every)), flush=True)
""")


def test_a_peer_apart_from_the_swarm_takes_no_state_round_before_it_loads_the_swarms_state():
    """Its parameters would be handed to the others, and its download would wait for the round (averaging_timeout)."""
    finished = subprocess.run(
        [sys.executable, "-c", STATE_ROUND_AFTER_RESYNC], capture_output=True, text=True, timeout=180
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    configured = result["configured"]
    assert result["wants"] is True, result
    assert result["periods"] == [configured, NO_STATE_AVERAGING, configured], result


STALE_PROGRESS_AFTER_A_SLOW_DOWNLOAD = textwrap.dedent("""
    import json
    from collab_kit.config import SwarmConfig, get_preset
    from collab_kit.model.transformer import TextToImageTransformer
    from collab_kit.swarm.optimizer import make_optimizer
    from collab_kit.swarm.dht import start_dht

    dht = start_dht(SwarmConfig(host="127.0.0.1"))
    preset = get_preset("tiny")
    optimizer = make_optimizer(TextToImageTransformer(preset.model), dht, "run", preset.optimizer)
    tracker = optimizer.tracker
    assert tracker.fetched_global_progress_this_epoch.wait(30), "the tracker never read the swarm's progress"
    tracker.shutdown(timeout=30)  # from here on, the swarm's progress is what this script writes
    # a download that lasted epochs brought the state of epoch 7 (what load_state_from_peers leaves for the next
    # step's check); the tracker, paused meanwhile, last read epoch 6
    optimizer.state_averager.local_epoch = 7
    optimizer._loaded = (7, 11.0)
    answers = []
    for read_epoch in (6, 9, 9):  # then it reads the swarm again: it moved on to 9 during the download
        tracker.global_progress.epoch = read_epoch
        answers.append([optimizer._should_load_state_from_peers(), optimizer.local_epoch])
    optimizer.shutdown()
    dht.shutdown()
    print(json.dumps(answers), flush=True)
""")


def test_a_peer_just_loaded_does_not_download_again_before_it_has_read_the_swarms_progress():
    """hivemind's exact-epoch rule, against progress read before the download, asked for a second download at once."""
    finished = subprocess.run(
        [sys.executable, "-c", STALE_PROGRESS_AFTER_A_SLOW_DOWNLOAD], capture_output=True, text=True, timeout=180
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    answers = json.loads(finished.stdout.strip().splitlines()[-1])
    # [load?, its epoch after the check]: no download against the stale reading; against the fresh one it goes on at
    # the swarm's epoch without downloading again (its parameters miss two updates, as the log says); then in step
    assert answers == [[False, 7], [False, 9], [False, 9]], answers
    assert "the swarm moved from epoch 7 to 9 while this peer downloaded its state" in finished.stderr


# a peer whose reading of the swarm still says epoch 4 (the others' records lag: they ended epoch 4 a moment ago) joins
# the others' round, which is the round of epoch 5: hivemind's groups are not keyed by epoch. The others are a real
# gradient averager of the kit in the anchor's role and a progress record, in a process of their own (hivemind signs
# every record of a
# process with the same key: two peers in one process would be one record)
OTHERS_AT_THE_NEXT_EPOCH = textwrap.dedent("""
    import json, sys, time
    from hivemind.optim.grad_averager import GradientAverager
    from hivemind.optim.progress_tracker import ProgressTracker
    from collab_kit.config import SwarmConfig, get_preset
    from collab_kit.model.transformer import TextToImageTransformer
    from collab_kit.swarm.averagers import round_member
    from collab_kit.swarm.averagers import ANCHOR_ROLE, round_report_averager_class
    from collab_kit.swarm.lamb import parameter_groups
    from collab_kit.swarm.dht import join_addresses, start_dht

    preset = get_preset("tiny")
    target = preset.optimizer.target_batch_size
    dht = start_dht(SwarmConfig(host="127.0.0.1"))
    record = ProgressTracker(dht, "run", target, start=True)
    time.sleep(3)  # what hivemind measures of its throughput: a sample in 3 s, so that the epoch's estimated end is far
    record.report_local_progress(4, 1)  # epoch 4 (hivemind publishes a record once it holds samples)
    model = TextToImageTransformer(preset.model)
    averager = round_report_averager_class(GradientAverager, ANCHOR_ROLE)(
        [p for group in parameter_groups(model, 0.0) for p in group["params"]],  # the optimizer's order
        dht=dht, prefix="run_grad_averager", min_matchmaking_time=preset.optimizer.matchmaking_time,
        request_timeout=1.0, warn=False, start=True)
    print(json.dumps(join_addresses(dht)), flush=True)
    # their round (an anchor's, as behind NAT, whose epoch is the swarm's), though, is the round of epoch 5
    said = averager.step(weight=1.0, gather=round_member(ANCHOR_ROLE, 5), timeout=150)
    print(json.dumps(sorted(said.values(), key=lambda member: member["epoch"])), flush=True)
    sys.stdin.read()  # until the peer is done
    averager.shutdown()
    record.shutdown()
    dht.shutdown()
""")

PEER_READING_EPOCH_4 = textwrap.dedent("""
    import json, sys, time, torch
    from collab_kit.config import SwarmConfig, get_preset
    from collab_kit.model.transformer import TextToImageTransformer
    from collab_kit.swarm.optimizer import make_optimizer
    from collab_kit.swarm.dht import start_dht

    preset = get_preset("tiny")
    dht = start_dht(SwarmConfig(host="127.0.0.1", initial_peers=json.loads(sys.argv[1])))
    model = TextToImageTransformer(preset.model)
    optimizer = make_optimizer(model, dht, "run", preset.optimizer)
    # at epoch 4 with parameters it just loaded from the swarm (argv[2] "loaded"), or with parameters of its own
    optimizer.adopt_epoch(4, parameters_from_swarm=sys.argv[2] == "loaded")
    assert optimizer.tracker.fetched_global_progress_this_epoch.wait(30), "the tracker never read the swarm"

    def batch():
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        optimizer.step()

    batch()  # this peer's record is published with its first samples; then it waits to read both records
    deadline = time.monotonic() + 90
    while optimizer.tracker.global_progress.num_peers < 2:
        assert time.monotonic() < deadline, optimizer.tracker.global_progress
        time.sleep(0.1)
    assert optimizer.local_epoch == 4 == optimizer.tracker.global_progress.epoch, optimizer.tracker.global_progress
    while optimizer.local_epoch == 4:  # until the swarm's epoch ends: a global step, with the others' round
        assert time.monotonic() < deadline, "this peer never ended its epoch"
        batch()
    print(json.dumps(dict(epoch=optimizer.local_epoch, averaged=optimizer.averaged_rounds,
                          ended=optimizer.last_round_epoch)), flush=True)
    optimizer.shutdown()
    dht.shutdown()
""")


@pytest.mark.parametrize("parameters", ["loaded", "its_own"])
def test_a_peer_whose_group_was_at_the_next_epoch_ends_that_epoch_with_the_others_if_it_holds_their_state(
    tmp_path, parameters
):
    """In the NAT lab, the late joiner adopted epoch 10 0.7 s before the anchor ended it and joined the round of 11: it
    moved to 11 while the others moved to 12, was taken for a peer that missed a round, and downloaded the state again
    (11 s on its thin link, in which it missed the next rounds). A peer with parameters of its own stays behind, to
    load the swarm's state (in the CenteredClip test, one that followed drifted away for good)."""
    others_log = open(tmp_path / "others.log", "w")
    # each in a session of its own: hivemind's DHT and averagers are processes of their own, killed with it
    others = subprocess.Popen(
        [sys.executable, "-c", OTHERS_AT_THE_NEXT_EPOCH],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=others_log,
        text=True,
        start_new_session=True,
    )
    peer = None
    try:
        addresses = others.stdout.readline()
        assert addresses, (tmp_path / "others.log").read_text()[-3000:]
        peer = subprocess.Popen(
            [sys.executable, "-c", PEER_READING_EPOCH_4, addresses, parameters],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        out, err = peer.communicate(timeout=180)
        assert peer.returncode == 0, err[-3000:]
        said = json.loads(others.stdout.readline())
    finally:
        for process in (peer, others):
            if process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        others_log.close()
    result = json.loads(out.strip().splitlines()[-1])
    # each member told the group its role and epoch; the round was the anchor's, of epoch 5
    assert said == [dict(role="trainer", epoch=4), dict(role="anchor", epoch=5)], said
    if parameters == "loaded":
        assert result["epoch"] == 6, result  # it ended epoch 5 with the others (without the rule: 5, a round behind)
        assert result["ended"] == 5, result  # and its losses of that step are reported under epoch 5, not 4
    else:
        # a round behind (hivemind's once-an-epoch check then loads the swarm's state), its losses under epoch 4
        assert (result["epoch"], result["ended"]) == (5, 4), result


def test_importing_the_kit_prints_nothing_of_bitsandbytes_unused_4bit_kernels():
    # plain bitsandbytes warns at import that its CPU 4-bit kernels are missing: a red box in every notebook
    result = subprocess.run(
        [sys.executable, "-c", "import collab_kit.swarm.optimizer, collab_kit.tutorial.finetuning"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "gemm_4bit" not in result.stderr and "kernels" not in result.stderr, result.stderr


def test_the_progress_tracker_leaves_no_task_of_its_loop_pending_when_it_stops():
    """hivemind's tracker left its shutdown checker (a wait on an executor) and a DHT read as tasks of its thread's
    loop: destroyed pending later, they printed asyncio's "Task was destroyed but it is pending!" as an ERROR, on the
    user's process (a notebook's red box) after every run where nothing was wrong."""
    destroyed = []

    class Recorder(logging.Handler):
        def emit(self, record):
            if "Task was destroyed" in record.getMessage():
                destroyed.append(record.getMessage())

    recorder = Recorder()
    logging.getLogger("asyncio").addHandler(recorder)
    dht = start_dht(SwarmConfig(host="127.0.0.1"))
    try:
        # a race: with hivemind's own ending, 1 of 20 stops left a task pending here (0 of 40 with the kit's)
        for attempt in range(6):
            tracker = SwarmProgressTracker(
                dht=dht, prefix=f"tracker_{attempt}", target_batch_size=64, min_refresh_period=0.05, start=True
            )
            assert tracker.fetched_global_progress_this_epoch.wait(30), "the tracker never read the swarm's progress"
            tracker.shutdown(timeout=30)
            tracker.join(timeout=30)
            assert not tracker.is_alive()
            del tracker
            gc.collect()
    finally:
        dht.shutdown()
        logging.getLogger("asyncio").removeHandler(recorder)
    assert destroyed == [], destroyed[0]


def test_the_progress_tracker_publishes_a_burst_of_steps_once_per_period_and_a_new_epoch_at_once():
    """hivemind's tracker stored its record in the DHT at every local step: dozens a second for a fast peer, which
    filled a thin link (1.7 Mbit/s of a tiny-preset volunteer's download behind NAT) and starved its DHT lookups. The
    kit's publishes a burst of steps once per ``min_report_period``, the burst's last count included, and a new epoch
    at once."""
    dht = start_dht(SwarmConfig(host="127.0.0.1"))
    stores = []
    original_store = dht.store

    def counting_store(*args, **kwargs):  # the real store, counted
        stores.append(kwargs.get("value"))
        return original_store(*args, **kwargs)

    dht.store = counting_store
    original_get = dht.get
    tracker = None

    def published(prefix):
        found = original_get(f"{prefix}_progress", latest=True, return_future=True).result(timeout=10)
        records = [] if found is None else [entry.value for entry in found.value.values() if entry.value is not None]
        return records[0] if records else None

    try:
        # a period far longer than the test: within an epoch, only the first step of the burst goes out
        tracker = SwarmProgressTracker(
            dht=dht, prefix="burst", target_batch_size=10**6, min_report_period=600.0, start=True
        )
        # the first step comes after the tracker has looked at its (empty) progress, as a peer's first step, slower
        # than the others, does: that look published nothing, and must not hold the first step's report for a period
        wait_until(tracker.fetched_global_progress_this_epoch.is_set, 30, "the tracker's first reading of the swarm")
        for samples in range(4, 4 * 201, 4):  # 200 local steps of 4 samples, as fast as a tiny-preset peer's
            tracker.report_local_progress(0, samples)
            time.sleep(0.005)
        record = wait_until(lambda: published("burst"), 30, "the burst's first report in the DHT")
        assert record["epoch"] == 0 and record["samples_accumulated"] < 4 * 200, record
        assert len(stores) == 1, f"{len(stores)} stores for one burst of 200 steps"
        with tracker.pause_updates():  # a new epoch waits for no period
            tracker.update_epoch(1)
        record = wait_until(
            lambda: (published("burst") or {}).get("epoch") == 1 and published("burst"), 30, "the new epoch in the DHT"
        )
        assert record["samples_accumulated"] == 0 and len(stores) == 2, (record, len(stores))
        tracker.shutdown(timeout=30)
        tracker.join(timeout=30)

        # with a period of 1 s, a burst's last count goes out within a period of its last step
        stores.clear()
        tracker = SwarmProgressTracker(
            dht=dht, prefix="last", target_batch_size=10**6, min_report_period=1.0, start=True
        )
        started = time.monotonic()
        for samples in range(4, 4 * 201, 4):
            tracker.report_local_progress(0, samples)
            time.sleep(0.005)
        wait_until(lambda: (published("last") or {}).get("samples_accumulated") == 800, 30, "the burst's last count")
        assert 2 <= len(stores) <= 2 + (time.monotonic() - started) / 1.0, f"{len(stores)} stores"
    finally:
        if tracker is not None:
            tracker.shutdown(timeout=30)
        dht.shutdown()


CANCELLED_ROUND_AT_SHUTDOWN = textwrap.dedent("""
    import json, sys, hivemind
    from hivemind.averaging.control import AveragingStage, StepControl
    from hivemind.utils import get_dht_time
    from hivemind.utils.mpfuture import MPFuture
    from collab_kit.config import get_preset
    from collab_kit.model.transformer import TextToImageTransformer
    from collab_kit.swarm.optimizer import make_optimizer
    from collab_kit.swarm.dht import start_dht
    config = get_preset("tiny")
    dht = start_dht(config.swarm)
    opt = make_optimizer(TextToImageTransformer(config.model), dht, "cancelled_round", config.optimizer)
    # a round another thread has just cancelled, before the averager moved it out of its matchmaking stage
    control = StepControl(get_dht_time() + 60, float("inf"), True, 1.0, b"")
    control.attach(MPFuture(), MPFuture())
    control.stage = AveragingStage.LOOKING_FOR_GROUP
    control.cancel()
    opt.scheduled_grads = control
    try:
        (hivemind.Optimizer.shutdown if sys.argv[1] == "hivemind" else type(opt).shutdown)(opt)
        outcome = "clean"
    except Exception as e:
        outcome = type(e).__name__
    dht.shutdown()
    print(json.dumps(dict(outcome=outcome)))
""")


@pytest.mark.parametrize("shutdown, outcome", [("kit", "clean"), ("hivemind", "InvalidStateError")])
def test_a_round_already_cancelled_is_not_cancelled_again_at_shutdown(shutdown, outcome):
    """hivemind's own shutdown cancels a round still marked as looking for a group, done or not, and raises for one
    another thread cancelled just before; the kit's shutdown leaves that round alone and shuts down cleanly."""
    result = subprocess.run(
        [sys.executable, "-c", CANCELLED_ROUND_AT_SHUTDOWN, shutdown], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"outcome": outcome}, result.stderr[-2000:]
