"""The local-update mode (DiLoCo, collab_kit.swarm.local_updates) with real peers on 127.0.0.1.

One swarm serves most tests (tests/helpers/round_probe_peer.py reports each round): peer A steps every 0.05 s, peer B
every
0.10 s (half its speed), and peer C joins at A's speed once A has ended three rounds. The rounds carry pseudo-gradients
in fp16 (the compression threshold is above every tensor), without state averaging, so that what the outer steps make
of them can be checked exactly.
"""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from collab_kit.config import get_preset
from collab_kit.memory import estimate
from collab_kit.roles.processes import PeerProcess
from collab_kit.swarm.four_bit import round_4bit
from collab_kit.swarm.fragments import fragment_of_tensors
from collab_kit.swarm.local_updates import OuterNesterovSGD, make_outer_sgd

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(TESTS, "helpers", "round_probe_peer.py")
ROUNDS = 8
# C joins after A's third round; A and B take no step from round HOLD_EPOCH on until C has its download, so that C
# averages in full groups after its resync round however long a busy machine makes that download
HOLD_EPOCH = 5
SETTINGS = (
    "optimizer.local_steps=4",
    "optimizer.target_batch_size=256",
    "optimizer.average_state_every=1000",
    "optimizer.state_compression='none'",
    f"optimizer.compression_threshold={2**30}",
)


def _join_args(run_id: str, shards: str, peers: int, max_epochs: int, settings=SETTINGS):
    return [
        "join",
        "--preset",
        "tiny",
        "--run-id",
        run_id,
        "--host",
        "127.0.0.1",
        "--data",
        shards,
        "--threads",
        "1",
        "--events",
        "--no-progress",
        "--wait-for-peers",
        str(peers),
        "--max-epochs",
        str(max_epochs),
        *[arg for setting in settings for arg in ("--set", setting)],
    ]


def _probe(name: str, out: str, log_dir: str, period: float, args, *extra: str) -> PeerProcess:
    return PeerProcess(
        name,
        ["--out", out, "--name", name, "--step-period", str(period), *extra, *args],
        os.path.join(log_dir, f"{name}.log"),
        command=(sys.executable, PROBE),
    )


def _loaded(event) -> bool:
    return event["type"] == "loaded" and event["loaded"]


def _overlapped_caught_up(event) -> bool:
    """With overlapped rounds, a download of a state before HOLD_EPOCH leaves C an epoch behind the held swarm: were A
    and B let go then, C would chase them (a download per round) through the last round on a busy machine. C has
    caught up with a download of the held epoch's state, or with its own round into that epoch."""
    if event["type"] == "loaded":
        return event["loaded"] and event["downloaded"] == event["epoch"] >= HOLD_EPOCH
    return event["type"] == "applied" and event["epoch"] >= HOLD_EPOCH - 1 and not event["resync"]


def _uneven_peers(folder, tiny_shards, run_id: str, settings=SETTINGS):
    """Peers A (a step every 0.05 s), B (every 0.10 s, and twice its own step's work: half A's pace on a busy machine
    too) and C (0.05 s, joining after A's third round; A and B hold at HOLD_EPOCH until C has the swarm's state) in
    local-update mode with ``settings`` for ROUNDS rounds: (their events by name, the folder of their rounds'
    pseudo-gradients)."""
    out, logs = str(folder / "rounds"), str(folder)
    peers = {}
    try:
        loaded = str(folder / "C.loaded")
        hold = ("--hold-at-epoch", str(HOLD_EPOCH), "--hold-until", loaded)
        peers["A"] = _probe("A", out, logs, 0.05, _join_args(run_id, tiny_shards, 2, ROUNDS, settings), *hold)
        addresses = peers["A"].wait_for(lambda e: e["type"] == "ready", timeout=60, what="its address")["addresses"]
        joining = _join_args(run_id, tiny_shards, 2, ROUNDS, settings) + ["--initial-peers", *addresses]
        peers["B"] = _probe("B", out, logs, 0.10, joining, "--slowness", "2", *hold)
        # C's process starts now and joins once A has ended three rounds: started then, on a busy machine its imports
        # alone outlasted A's last five rounds, and it found A gone
        go = str(folder / "C.go")
        peers["C"] = _probe("C", out, logs, 0.05, joining, "--join-when", go)
        peers["A"].wait_for(lambda e: e["type"] == "round" and e["epoch"] >= 3, timeout=120, what="its third round")
        open(go, "w").close()
        peers["C"].wait_for(
            _overlapped_caught_up if "optimizer.overlap_rounds=true" in settings else _loaded,
            timeout=300,
            what="the swarm's state",
        )
        open(loaded, "w").close()
        for name, peer in peers.items():
            code = peer.wait_exit(timeout=180)
            assert code == 0, f"{name} exited with {code}:\n{peer.log_tail()}"
        return {name: peer.events for name, peer in peers.items()}, out
    finally:
        for peer in peers.values():
            peer.kill()


@pytest.fixture(scope="module")
def uneven_swarm(tiny_shards, tmp_path_factory):
    """_uneven_peers with rounds awaited, the whole model in each."""
    return _uneven_peers(tmp_path_factory.mktemp("local_updates"), tiny_shards, "test_local_updates")


def _rounds(events, name):
    return {e["epoch"]: e for e in events[name] if e["type"] == "round"}


def _round_file(out, round_event):
    """The round's saved pseudo-gradient and global parameters (a late joiner's first round may have begun epochs
    before the one it ended at, so the file is named by the peer, not by the event's epoch)."""
    assert round_event["file"], round_event
    return torch.load(os.path.join(out, round_event["file"]))


def _each_tensor_from(digests, sources) -> bool:
    """Whether each tensor (by its digest) is that tensor of one of ``sources`` (lists of digests, in the same
    order)."""
    return (
        bool(sources)
        and all(len(source) == len(digests) for source in sources)
        and all(any(source[index] == tensor for source in sources) for index, tensor in enumerate(digests))
    )


def _distance(first, second) -> float:
    return math.sqrt(sum(float((x - y).norm() ** 2) for x, y in zip(first, second)))


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.norm() ** 2) for t in tensors))


@pytest.mark.slow
def test_peers_end_every_round_with_equal_global_parameters(uneven_swarm):
    """Equal up to what the averaged pseudo-gradient's compression leaves: hivemind's all-reduce gives each peer the
    average as its own part plus a compressed difference (the reducer of a part keeps it exact), so peers' results
    differ by the compression's rounding (fp16 here), far below what a round changes, and they do not drift apart."""
    events, out = uneven_swarm
    rounds = {name: _rounds(events, name) for name in events}
    together = [
        epoch
        for epoch in rounds["A"]
        if epoch in rounds["B"] and rounds["A"][epoch]["group_size"] >= 2 and rounds["B"][epoch]["group_size"] >= 2
    ]
    assert len(together) >= ROUNDS - 3, rounds
    gaps = {}
    for epoch in together:
        # after the outer step each peer's model goes on from its global parameters
        assert rounds["A"][epoch]["model"] == rounds["A"][epoch]["global"], epoch
        a, b = (_round_file(out, rounds[name][epoch]) for name in ("A", "B"))
        change = _norm(a["averaged"])  # the round's averaged pseudo-gradient: what the peers' parameters differed by
        gaps[epoch] = _distance(a["global"], b["global"]) / change
    print(f"global parameters of A and B: distance / the averaged pseudo-gradient's norm, by epoch: {gaps}")
    assert max(gaps.values()) < 0.01, gaps
    # a round C took part in from global parameters behind the swarm's is followed by a download (it goes on from the
    # swarm's parameters, not from its own): every other round of all three must end with A's global parameters
    with_c = [
        epoch
        for epoch in rounds["C"]
        if epoch in rounds["A"] and rounds["C"][epoch]["group_size"] == 3 and not rounds["C"][epoch]["resync"]
    ]
    assert with_c, rounds["C"]
    for epoch in with_c:
        a, c = (_round_file(out, rounds[name][epoch]) for name in ("A", "C"))
        change = _norm(a["averaged"])
        assert _distance(a["global"], c["global"]) < 0.01 * change, epoch
    for index, event in enumerate(events["C"]):
        if event["type"] == "round" and event["resync"]:
            loads = [e for e in events["C"][index:] if e["type"] == "loaded" and e["loaded"]]
            assert loads, ("C went on from global parameters behind the swarm's", event)
            held = [_rounds(events, name).get(loads[0]["epoch"], {}).get("global") for name in ("A", "B")]
            assert _each_tensor_from(loads[0]["global"], [h for h in held if h]), (loads[0], held)


@pytest.mark.slow
def test_pseudo_gradients_are_weighted_by_the_samples_each_peer_processed(uneven_swarm):
    events, out = uneven_swarm
    checked = 0
    rounds_b = _rounds(events, "B")
    for epoch, round_a in sorted(_rounds(events, "A").items()):
        round_b = rounds_b.get(epoch)
        if round_a["group_size"] != 2 or round_b is None or not (round_a["file"] and round_b["file"]):
            continue  # a round of all three (A and B alone are checked), or one a peer did not take part in
        a, b = _round_file(out, round_a), _round_file(out, round_b)
        share_b = b["weight"] / (a["weight"] + b["weight"])
        # B steps half as often as A: it processes about half as many samples, and weighs half as much
        assert 0.2 < share_b < 0.45, (epoch, a["weight"], b["weight"])
        weighted = [
            (a["weight"] * pa + b["weight"] * pb) / (a["weight"] + b["weight"])
            for pa, pb in zip(a["pseudo"], b["pseudo"])
        ]
        plain = [(pa + pb) / 2 for pa, pb in zip(a["pseudo"], b["pseudo"])]

        def error(expected):
            return math.sqrt(
                sum(float((got - want).norm() ** 2) for got, want in zip(a["averaged"], expected))
            ) / math.sqrt(sum(float(want.norm() ** 2) for want in expected))

        print(
            f"round ending at epoch {epoch}:"
            f" B's share {share_b:.3f}, error from the weighted mean {error(weighted):.5f}, "
            f"from the plain mean {error(plain):.5f}"
        )
        assert error(weighted) < 0.01  # fp16 on the way
        assert error(plain) > 5 * error(weighted)
        # both peers got the same average, up to its compression's rounding
        assert _distance(a["averaged"], b["averaged"]) < 0.01 * _norm(a["averaged"])
        checked += 1
    assert checked >= 1


@pytest.mark.slow
def test_a_late_joiner_gets_the_global_parameters_and_the_outer_momentum(uneven_swarm):
    events, _ = uneven_swarm
    first_round = next(index for index, e in enumerate(events["C"]) if e["type"] == "round")
    loads = [e for e in events["C"][:first_round] if e["type"] == "loaded" and e["loaded"]]
    assert loads, events["C"]
    # C's first round goes on from a state of the epoch it is at: a state of the epoch before (its donor had not ended
    # its round yet), past which hivemind moves a peer, is downloaded again, or C's global parameters would stay one
    # round behind for good
    load = loads[-1]
    assert load["downloaded"] == load["epoch"] >= 3, loads
    # each tensor of the state C downloaded is that tensor of A or of B after the round that ended at that epoch,
    # exactly (state downloads are not compressed here; a download in parts takes different tensors from each
    # sharer): the global parameters and the outer momentum
    held = [_rounds(events, name)[load["epoch"]] for name in ("A", "B")]
    assert _each_tensor_from(load["global"], [state["global"] for state in held]), (load, held)
    assert _each_tensor_from(load["momentum"], [state["momentum"] for state in held]), (load, held)


OVERLAPPED_FRAGMENTS = (*SETTINGS, "optimizer.overlap_rounds=true", "optimizer.fragments=2")


@pytest.mark.slow
def test_overlapped_fragment_rounds_weigh_uneven_peers_and_take_a_late_joiner_in_without_a_wait(tiny_shards, tmp_path):
    """The uneven swarm with optimizer.overlap_rounds and optimizer.fragments=2: each round's fragment comes back as
    the mean of A's and B's pseudo-gradients weighted by their samples, every round leaves all peers with the same
    global parameters, and the late joiner C downloads a state A or B held after a round, while A's rounds go on: C's
    arrival costs A no round, and C's first round from the downloaded state adds no pseudo-gradient of older
    parameters to the swarm's (every round it averages in ends with A's global parameters)."""
    events, out = _uneven_peers(tmp_path, tiny_shards, "test_overlapped_uneven", OVERLAPPED_FRAGMENTS)
    applied = {name: {e["epoch"]: e for e in events[name] if e["type"] == "applied"} for name in events}
    print(
        {
            name: [(epoch, e["group_size"], e["weight"], e["problem"]) for epoch, e in sorted(rounds.items())]
            for name, rounds in applied.items()
        }
    )
    weighed, together = 0, 0
    for epoch, round_a in sorted(applied["A"].items()):
        round_b = applied["B"].get(epoch)
        if round_b is None or round_a["group_size"] < 2 or round_b["group_size"] < 2:
            continue
        a, b = (torch.load(os.path.join(out, event["file"])) for event in (round_a, round_b))
        fragment = [
            index
            for index, owner in enumerate(fragment_of_tensors([t.numel() for t in a["global"]], 2))
            if owner == epoch % 2
        ]
        change = _norm([a["averaged"][index] for index in fragment])
        # every peer of the round ends it with the same global parameters, the other fragment's included
        assert _distance(a["global"], b["global"]) < 0.01 * change, epoch
        together += 1
        if round_a["group_size"] == 2 and a["pseudo"] is not None and b["pseudo"] is not None:
            share_b = b["weight"] / (a["weight"] + b["weight"])
            assert 0.2 < share_b < 0.45, (epoch, a["weight"], b["weight"])  # B steps at half A's pace
            weighted = [
                (a["weight"] * a["pseudo"][i] + b["weight"] * b["pseudo"][i]) / (a["weight"] + b["weight"])
                for i in fragment
            ]
            assert _distance([a["averaged"][i] for i in fragment], weighted) < 0.01 * _norm(weighted), epoch
            weighed += 1
    assert together >= ROUNDS - 4 and weighed >= 1, applied
    # the late joiner: a state one of them held after a round, and no round of A's lost or alone once C arrives
    first_round = next(index for index, e in enumerate(events["C"]) if e["type"] == "round")
    load = [e for e in events["C"][:first_round] if e["type"] == "loaded" and e["loaded"]][-1]  # the one gone on from
    assert load["downloaded"] == load["epoch"], load  # a state of its epoch, not one a round in flight left behind
    held = [event for name in ("A", "B") for event in applied[name].values() if event["epoch"] + 1 == load["epoch"]]
    assert _each_tensor_from(load["global"], [event["global"] for event in held]), (load, held)
    assert _each_tensor_from(load["momentum"], [event["momentum"] for event in held]), (load, held)
    after = [event for epoch, event in sorted(applied["A"].items()) if epoch >= load["epoch"]]
    assert after and all(event["problem"] is None and event["group_size"] >= 2 for event in after), after
    with_c = [epoch for epoch, event in applied["C"].items() if event["group_size"] == 3 and not event["resync"]]
    assert with_c, applied["C"]
    for epoch in with_c:
        a, c = (torch.load(os.path.join(out, applied[name][epoch]["file"])) for name in ("A", "C"))
        assert _distance(a["global"], c["global"]) < 0.01 * _norm(a["averaged"]), epoch


# ---------------------------------------------------------------------------------------------
# non-finite pseudo-gradients, CenteredClip


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra", [(), ("optimizer.overlap_rounds=true", "optimizer.fragments=2")], ids=["plain", "overlap-fragments"]
)
def test_a_peer_whose_pseudo_gradient_is_not_finite_adds_nothing_and_goes_on_from_the_swarm(
    tiny_shards, tmp_path, extra
):
    out, logs = str(tmp_path / "rounds"), str(tmp_path)
    settings = (*SETTINGS, *extra)
    peers = []
    try:
        first = _probe("A", out, logs, 0.05, _join_args("test_local_nan", tiny_shards, 2, 5, settings))
        peers.append(first)
        addresses = first.wait_for(lambda e: e["type"] == "ready", timeout=60, what="its address")["addresses"]
        faulty = _probe(
            "B",
            out,
            logs,
            0.05,
            _join_args("test_local_nan", tiny_shards, 2, 5, settings) + ["--initial-peers", *addresses],
            "--nan-at-epoch",
            "2",
        )
        peers.append(faulty)
        for peer in peers:
            assert peer.wait_exit(timeout=150) == 0, peer.log_tail()
        fault = next(e for e in faulty.events if e["type"] == "fault")
        bad_round = torch.load(os.path.join(out, f"B-{fault['epoch']}.pt"))
        assert bad_round["weight"] == 0  # sent with no weight
        # each round's outcome: with overlap, as its outer step applied it (by the round's epoch), else as the step that
        # ended the round's epoch took it (by the epoch it ended)
        kind, first_after = ("applied", fault["epoch"]) if extra else ("round", fault["epoch"] + 1)
        outcomes = {peer.name: {e["epoch"]: e for e in peer.events if e["type"] == kind} for peer in peers}
        # the swarm's parameters stayed finite and equal; the faulty peer goes on from them
        after = _round_file(out, outcomes["A"][first_after])
        assert all(bool(torch.isfinite(t).all()) for t in after["averaged"])
        common = [epoch for epoch in outcomes["A"] if epoch in outcomes["B"] and epoch >= first_after]
        assert common
        for epoch in common:
            a, b = _round_file(out, outcomes["A"][epoch]), _round_file(out, outcomes["B"][epoch])
            assert all(bool(torch.isfinite(t).all()) for t in b["global"])
            change = _norm(a["averaged"])
            assert _distance(a["global"], b["global"]) < 0.01 * change, epoch
            if not extra:  # with overlap the model keeps the inner progress made while the round averaged
                assert outcomes["B"][epoch]["model"] == outcomes["B"][epoch]["global"]
        # its model trains on from the swarm's parameters (with fragments, every fragment's, not only the one stepped)
        losses = [e["loss"] for e in faulty.events if e["type"] == "epoch" and e["epoch"] > fault["epoch"] + 1]
        assert losses and all(math.isfinite(loss) for loss in losses), losses
        assert "not finite: it takes part in the round with weight 0" in open(os.path.join(logs, "B.log")).read()
    finally:
        for peer in peers:
            peer.kill()


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [
        ("optimizer.local_steps=2",),
        # an epoch as long, of fragment rounds that overlap the next inner steps, in 4 bits
        (
            "optimizer.local_steps=4",
            "optimizer.fragments=2",
            "optimizer.overlap_rounds=true",
            "optimizer.pseudo_gradient_bits=4",
        ),
    ],
    ids=["plain", "overlap-fragments-4bit"],
)
def test_with_centered_clip_a_peer_sending_pseudo_gradients_times_minus_1000_is_contained(
    tiny_shards, tmp_path, settings
):
    from byzantine_peer import loss_ratio, run_poisoned_swarm

    epochs_by_peer = run_poisoned_swarm(
        "centered_clip", -1000.0, 8, tiny_shards, str(tmp_path), "test_local_clip", extra_settings=settings
    )
    ratio = loss_ratio(epochs_by_peer)
    print(f"honest loss last / first: {ratio:.4f}; rounds: {json.dumps(epochs_by_peer)}")
    assert all(len(epochs) >= 6 for epochs in epochs_by_peer)
    # under the plain mean the attacker's pseudo-gradient (x -1000, a quarter of the weight) would move the global
    # parameters by about 250 times an honest round's change, and the loss would soar
    assert all(math.isfinite(loss) for epochs in epochs_by_peer for _, loss, _ in epochs)
    assert ratio < 0.99, epochs_by_peer


def _two_peers_for(epochs: int, settings, run_id: str, shards: str, tmp_path) -> dict:
    """Peers A and B, a step every 0.05 s each, train ``epochs`` epochs together with ``settings``: their events by name
    (their rounds' files in tmp_path/rounds)."""
    out, logs = str(tmp_path / "rounds"), str(tmp_path)
    peers = []
    try:
        peers.append(_probe("A", out, logs, 0.05, _join_args(run_id, shards, 2, epochs, settings)))
        addresses = peers[0].wait_for(lambda e: e["type"] == "ready", timeout=60, what="its address")["addresses"]
        peers.append(
            _probe(
                "B", out, logs, 0.05, _join_args(run_id, shards, 2, epochs, settings) + ["--initial-peers", *addresses]
            )
        )
        for peer in peers:
            assert peer.wait_exit(timeout=150) == 0, peer.log_tail()
        return {peer.name: peer.events for peer in peers}
    finally:
        for peer in peers:
            peer.kill()


@pytest.mark.slow
def test_overlapped_rounds_train_through_the_averaging_and_keep_the_inner_progress(tiny_shards, tmp_path):
    """With optimizer.overlap_rounds, each round averages while the next round's inner steps go on; its outer step,
    taken when the average arrives, moves the model to the new global parameters plus the progress made meanwhile, and
    both peers' global parameters stay equal (up to the compression's rounding, as without overlap)."""
    out = str(tmp_path / "rounds")
    events = _two_peers_for(5, (*SETTINGS, "optimizer.overlap_rounds=true"), "test_overlap", tiny_shards, tmp_path)
    applied = {
        name: {e["epoch"]: e for e in peer_events if e["type"] == "applied"} for name, peer_events in events.items()
    }
    done = {name: next(e for e in peer_events if e["type"] == "done") for name, peer_events in events.items()}
    epochs = {name: [e for e in peer_events if e["type"] == "epoch"] for name, peer_events in events.items()}
    print({name: (d["overlapped_steps"], d["local_steps"], d["averaged_rounds"]) for name, d in done.items()})
    together = [
        epoch
        for epoch in applied["A"]
        if epoch in applied["B"] and applied["A"][epoch]["group_size"] == applied["B"][epoch]["group_size"] == 2
    ]
    assert len(together) >= 3, applied
    for name in ("A", "B"):
        # inner steps went on while rounds averaged, and every epoch was reported once its round was over
        assert done[name]["overlapped_steps"] > 0, done[name]
        assert [e["epoch"] for e in epochs[name]] == list(range(5)), epochs[name]
        assert sum(e["averaged"] for e in epochs[name]) >= 3, epochs[name]
    progress = []
    for epoch in together:
        a, b = (torch.load(os.path.join(out, applied[name][epoch]["file"])) for name in ("A", "B"))
        change = _norm(a["averaged"])
        assert _distance(a["global"], b["global"]) < 0.01 * change, epoch
        for round_ in (a, b):
            # the model is the new global parameters plus exactly the progress made while the round averaged
            kept = [model - global_ for model, global_ in zip(round_["model"], round_["global"])]
            assert _distance(kept, round_["progress"]) <= 1e-5 * _norm(round_["progress"]), epoch
            progress.append(_norm(round_["progress"]) / change)
    print(f"the progress kept / the averaged pseudo-gradient's norm: {progress}")
    assert max(progress) > 0.01  # the model did move on while rounds averaged


@pytest.mark.slow
def test_4_bit_pseudo_gradients_with_error_feedback_average_through_hivemind(tiny_shards, tmp_path):
    """With optimizer.pseudo_gradient_bits=4 the large tensors' pseudo-gradients travel in 4 bits: each peer sends its
    own on the 4-bit grid (error feedback rounds it first, so the averager's rounding drops nothing more), and every
    peer gets back the same weighted mean, rounded to the 4-bit grid once by its reducer: the peers' global parameters
    stay together (with each peer rounding its own difference from the mean, they were 0.004, 0.009, 0.028 and 0.069
    of a round's change apart after rounds 1 to 4)."""
    out, threshold = str(tmp_path / "rounds"), 1024
    settings = (*SETTINGS[:-1], f"optimizer.compression_threshold={threshold}", "optimizer.pseudo_gradient_bits=4")
    events = _two_peers_for(4, settings, "test_4_bit", tiny_shards, tmp_path)
    rounds = {name: _rounds(events, name) for name in events}
    together = [
        epoch
        for epoch in rounds["A"]
        if epoch in rounds["B"]
        and rounds["A"][epoch]["file"]
        and rounds["B"][epoch]["file"]
        and rounds["A"][epoch]["group_size"] == rounds["B"][epoch]["group_size"] == 2
    ]
    assert len(together) >= 2, rounds
    for epoch in together:
        a, b = (_round_file(out, rounds[name][epoch]) for name in ("A", "B"))
        weighted = [
            (a["weight"] * pa + b["weight"] * pb) / (a["weight"] + b["weight"])
            for pa, pb in zip(a["pseudo"], b["pseudo"])
        ]
        large = [index for index, tensor in enumerate(weighted) if tensor.numel() >= threshold]
        assert large
        for round_ in (a, b):
            for index in large:
                sent, got = round_["pseudo"][index], round_["averaged"][index]
                assert torch.equal(round_4bit(sent), sent), (epoch, index)
                # the mean on the 4-bit grid (a value at a rounding's edge may go either way: one step at most)
                mean = weighted[index].reshape(-1)
                blocks = torch.cat([mean, mean.new_zeros((-mean.numel()) % 64)]).view(-1, 64)
                step = (blocks.abs().amax(dim=1, keepdim=True) / 7 * 1.01 + 1e-9).expand_as(blocks)
                assert torch.equal(round_4bit(got), got), (epoch, index)
                off = (got.reshape(-1) - round_4bit(mean)).abs()
                assert bool((off <= step.reshape(-1)[: off.numel()]).all()), (epoch, index)
                assert float((off > 1e-9).float().mean()) < 0.001, (epoch, index)
        apart = _distance(a["global"], b["global"]) / _norm(a["averaged"])
        print(
            f"round ending at epoch {epoch}: A's average off the weighted mean by "
            f"{_distance(a['averaged'], weighted) / _norm(weighted):.4f} of its norm, A's and B's global parameters "
            f"{apart:.6f} of the round's change apart"
        )
        # the same 4-bit average for both (the small tensors, in fp16, differ by fp16's rounding, as in 8-bit mode)
        assert all(torch.allclose(a["averaged"][i], b["averaged"][i], rtol=0, atol=1e-9) for i in large), epoch
        assert apart < 0.01, epoch


@pytest.mark.slow
def test_fragments_average_in_turn_and_the_others_keep_training(tiny_shards, tmp_path):
    """With optimizer.fragments=2 (H = 4: an epoch of 2 global batches), the round ending epoch R averages fragment
    R % 2 alone: its tensors come back as the weighted mean of both peers' pseudo-gradients, the other fragment's
    stay each peer's own (never sent) and the outer step leaves them out; the model takes the new global parameters of
    the averaged fragment, and keeps its inner steps' progress in the other."""
    out = str(tmp_path / "rounds")
    events = _two_peers_for(6, (*SETTINGS, "optimizer.fragments=2"), "test_fragments", tiny_shards, tmp_path)
    rounds = {name: _rounds(events, name) for name in events}
    together = [
        epoch
        for epoch in rounds["A"]
        if epoch in rounds["B"]
        and rounds["A"][epoch]["file"]
        and rounds["B"][epoch]["file"]
        and rounds["A"][epoch]["group_size"] == rounds["B"][epoch]["group_size"] == 2
    ]
    assert len(together) >= 3 and {(epoch - 1) % 2 for epoch in together} == {0, 1}, rounds
    for epoch in together:
        a, b = (_round_file(out, rounds[name][epoch]) for name in ("A", "B"))
        assert a["epoch"] == b["epoch"] == epoch - 1
        assignment = fragment_of_tensors([tensor.numel() for tensor in a["pseudo"]], 2)
        averaged = [index for index, owner in enumerate(assignment) if owner == (epoch - 1) % 2]
        kept = [index for index, owner in enumerate(assignment) if owner != (epoch - 1) % 2]
        weighted = [
            (a["weight"] * pa + b["weight"] * pb) / (a["weight"] + b["weight"])
            for pa, pb in zip(a["pseudo"], b["pseudo"])
        ]
        change = _norm([weighted[index] for index in averaged])
        for round_ in (a, b):
            got = [round_["averaged"][index] for index in averaged]
            assert _distance(got, [weighted[index] for index in averaged]) < 0.01 * change, epoch
            assert all(torch.equal(round_["averaged"][index], round_["pseudo"][index]) for index in kept), epoch
        assert _distance([a["global"][i] for i in averaged], [b["global"][i] for i in averaged]) < 0.01 * change
        for name in ("A", "B"):
            event = rounds[name][epoch]
            same = [event["model"][index] == event["global"][index] for index in range(len(assignment))]
            assert all(same[index] for index in averaged), (name, epoch)
            # the other fragment's parameters trained on since their own round: the model's are not the global ones
            assert sum(not same[index] for index in kept) >= 0.8 * len(kept), (name, epoch, same)


# ---------------------------------------------------------------------------------------------
# without a swarm


# one peer on loopback in local-update mode, its tracker stopped so that the swarm's epoch is what the script writes:
# whether hivemind's next step loads the swarm's state, by the mode, a download just made, and how far behind it is
BEHIND_THE_SWARM = textwrap.dedent("""
    import json, sys
    from collab_kit.config import SwarmConfig, get_preset
    from collab_kit.model.transformer import TextToImageTransformer
    from collab_kit.swarm.optimizer import make_optimizer
    from collab_kit.swarm.dht import start_dht

    dht = start_dht(SwarmConfig(host="127.0.0.1"))
    preset = get_preset("tiny", optimizer=dict(local_steps=4, overlap_rounds=sys.argv[1] == "overlap"))
    optimizer = make_optimizer(TextToImageTransformer(preset.model), dht, "run", preset.optimizer)
    tracker = optimizer.tracker
    assert tracker.fetched_global_progress_this_epoch.wait(30), "the tracker never read the swarm's progress"
    tracker.shutdown(timeout=30)
    answers = {}
    for case, downloaded, swarm in (("one behind", False, 8), ("downloaded, one behind", True, 8),
                                    ("two behind", False, 9)):
        optimizer.state_averager.local_epoch = 7
        optimizer._loaded = (7, 3.0) if downloaded else None
        tracker.global_progress.epoch = swarm
        optimizer._should_check_synchronization_on_update = False  # hivemind's exact check, once an epoch, is past
        answers[case] = optimizer._should_load_state_from_peers()
        optimizer._resync_requested, optimizer._resync_reason = False, None
    optimizer.shutdown()
    dht.shutdown()
    print(json.dumps(answers), flush=True)
""")


@pytest.mark.parametrize("mode", ["synchronous", "overlap"])
def test_a_peer_behind_the_swarm_loads_its_state_unless_its_round_can_join_the_one_in_flight(mode):
    """A download the swarm overtook is never gone on from (its outer steps would start an update short for good: in
    the uneven swarm a late joiner that did so ended each round 4 times a round's change away from the others)."""
    finished = subprocess.run(
        [sys.executable, "-c", BEHIND_THE_SWARM, mode], capture_output=True, text=True, timeout=180
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    answers = json.loads(finished.stdout.strip().splitlines()[-1])
    # with overlapped rounds the others report the next epoch once their round is sent: one epoch behind on its own
    # parameters, a peer ends its epoch and joins that round
    assert answers == {"one behind": mode == "synchronous", "downloaded, one behind": True, "two behind": True}, answers
    assert "while this peer downloaded its state" not in finished.stderr  # nothing went on from the stale download


def test_the_outer_step_is_nesterov_sgd_and_drops_a_non_finite_average():
    weight = torch.nn.Parameter(torch.ones(3))
    outer = make_outer_sgd([dict(params=[weight], weight_decay=0.045)], get_preset("tiny").optimizer)
    assert isinstance(outer, OuterNesterovSGD) and outer.param_groups[0]["weight_decay"] == 0.0
    assert outer.param_groups[0]["lr"] == 0.7 and outer.param_groups[0]["momentum"] == 0.9
    weight.grad = torch.full((3,), 0.1)
    outer.step()  # momentum 0.1; nesterov: 0.1 + 0.9 * 0.1 = 0.19, times 0.7
    assert torch.allclose(weight.detach(), torch.full((3,), 1 - 0.7 * 0.19))
    before = weight.detach().clone()
    weight.grad = torch.tensor([0.1, float("nan"), 0.1])
    outer.step()
    assert torch.equal(weight.detach(), before) and outer.dropped_steps == 1
    outer.hold_next_step()
    weight.grad = torch.full((3,), 0.1)
    outer.step()
    assert torch.equal(weight.detach(), before)


def test_the_configuration_takes_the_mode_with_dilocos_outer_settings():
    config = get_preset("small", optimizer=dict(local_steps=100)).optimizer
    assert config.local_updates and config.round_samples == 100 * config.target_batch_size
    assert (config.outer_learning_rate, config.outer_momentum) == (0.7, 0.9)
    assert not get_preset("small").optimizer.local_updates
    with pytest.raises(ValueError, match="optimizer.local_steps"):
        get_preset("small", optimizer=dict(local_steps=-1))
    with pytest.raises(ValueError, match="optimizer.outer_momentum"):
        get_preset("small", optimizer=dict(outer_momentum=1.0))


def test_the_memory_estimate_counts_the_global_copy_and_the_outer_momentum():
    synchronous = estimate(get_preset("small"), optimizer="8bit")
    local = estimate(get_preset("small", optimizer=dict(local_steps=10)), optimizer="8bit")
    trainable = local.trainable_parameters
    assert local.local_updates and local.outer_bytes == 8 * trainable  # fp32 global weights + fp32 momentum
    assert local.cpu_bytes == 12 * trainable  # + the fp32 pseudo-gradient buffer
    # the inner optimizer's state stays beside the model
    assert local.gpu_bytes == synchronous.gpu_bytes + synchronous.optimizer_bytes
    assert "outer momentum" in local.table() and "PCIe per round" in local.table()
    # overlapped rounds keep the parameters each round was sent from, to keep the progress made since
    overlapped = estimate(get_preset("small", optimizer=dict(local_steps=10, overlap_rounds=True)), optimizer="8bit")
    assert overlapped.cpu_bytes == 16 * trainable and "parameters sent" in overlapped.table()
    # 4-bit pseudo-gradients keep what rounding dropped from the last one
    both = estimate(
        get_preset("small", optimizer=dict(local_steps=10, overlap_rounds=True, pseudo_gradient_bits=4)),
        optimizer="8bit",
    )
    assert both.cpu_bytes == 20 * trainable and "parameters sent, error feedback" in both.table()
