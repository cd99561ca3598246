"""Faults in a swarm: a peer killed in the middle of averaging and restarted, a peer whose training goes nan.

Every peer is a real `collab-kit join --events` process on 127.0.0.1 (the nan peer is tests/helpers/nan_peer.py,
the same command with a fault injected in its own process); the tests wait on their events with deadlines.
"""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch

from collab_kit.roles.processes import PeerFailed, group_is_empty
from collab_kit.roles.volunteer import STATE_RETRY_WAITS, Volunteer

# short global epochs (about 21 local steps per peer), and a learning rate at which a few of them already
# take the loss visibly below its initial value
SETTINGS = ("optimizer.target_batch_size=512", "optimizer.learning_rate=0.03")


def join_args(run_id, addresses, shards, *extra):
    # --max-epochs far away: the test decides when the peers stop (Ctrl-C), whatever the speed of this machine
    return [
        "join",
        "--preset",
        "tiny",
        "--run-id",
        run_id,
        "--host",
        "127.0.0.1",
        "--initial-peers",
        *addresses,
        "--data",
        shards,
        "--threads",
        "1",
        "--events",
        "--no-progress",
        "--max-epochs",
        "1000",
        *(arg for setting in SETTINGS for arg in ("--set", setting)),
        *extra,
    ]


def epochs_of(peer):
    return [e for e in peer.events if e["type"] == "epoch"]


def loss_at(peers, epoch):
    """The mean loss the ``peers`` reported for ``epoch`` (None if none did)."""
    losses = [e["loss"] for peer in peers for e in epochs_of(peer) if e["epoch"] == epoch]
    return sum(losses) / len(losses) if losses else None


def first_event(peers, predicate, timeout, what):
    """The first peer of ``peers`` to report an event that satisfies ``predicate``, and that event."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for peer in peers:
            for event in peer.new_events(timeout=0.005):
                if predicate(event):
                    return peer, event
            if peer.process.poll() is not None:
                raise PeerFailed(f"{peer.name} exited before any peer reported {what}:\n{peer.log_tail()}")
    raise PeerFailed(f"no peer reported {what} within {timeout:.0f} s")


def stop_and_load_params(peers, paths, timeout=90):
    """Ctrl-C each peer (it saves its parameters, then exits with 130); their parameters."""
    for peer in peers:
        peer.interrupt()
    for peer in peers:
        assert peer.wait_exit(timeout) == 130, peer.log_tail()
    return [torch.load(path) for path in paths]


def assert_finite(params, who):
    bad = [name for name, tensor in params.items() if not torch.isfinite(tensor).all()]
    assert not bad, f"{who} ended with non-finite parameters: {bad[:5]}"


# ---------------------------------------------------------------------------------------------
# (1) and (2): a peer killed with SIGKILL in the middle of a gradient all-reduce, then restarted

FORMED = ("awaiting_trigger", "running_allreduce")  # stages of a round whose group is formed (hivemind.AveragingStage)


@pytest.mark.slow
def test_a_peer_killed_while_averaging_leaves_the_others_training_and_comes_back_at_the_swarms_epoch(
    first_peer, start_peer, tiny_shards, tmp_path
):
    run_id = "test_fault_kill"
    _, addresses = first_peer(run_id, *(arg for setting in SETTINGS for arg in ("--set", setting)))
    params = [str(tmp_path / f"params-{i}.pt") for i in range(3)]
    command = [
        join_args(run_id, addresses, tiny_shards, "--wait-for-peers", "3", "--save-params", params[i]) for i in range(3)
    ]
    peers = [start_peer(f"volunteer-{i}", *command[i]) for i in range(3)]

    # (1) once the three have trained together for two epochs, kill the first peer to begin averaging its gradients
    # in a group already formed: the group holds at least one of the others, and the all-reduce cannot be over
    # while they have not begun theirs. Most rounds begin while matchmaking still goes on; if none began in a
    # formed group by epoch 12, a peer that began averaging in matchmaking is killed (it is in the others' way too)
    victim, averaging = first_event(
        peers,
        lambda e: e["type"] == "averaging" and e["epoch"] >= 2 and (e["stage"] in FORMED or e["epoch"] >= 12),
        timeout=240,
        what="gradient averaging in a formed group at epoch 2 or later",
    )
    os.killpg(victim.process.pid, signal.SIGKILL)  # the peer, its p2p daemon and its averagers, mid-round
    killed_at = averaging["epoch"]
    print(f"killed {victim.name} as it began averaging at epoch {killed_at} ({averaging['stage']})")
    survivors = [peer for peer in peers if peer is not victim]
    index = peers.index(victim)
    victim.process.wait(10)
    deadline = time.monotonic() + 15
    while not group_is_empty(victim.process.pid):  # nothing of it is left to finish the round
        assert time.monotonic() < deadline, "processes of the killed peer are still running"
        time.sleep(0.2)
    victim.new_events()  # keep what it reported before it died
    initial_loss = epochs_of(victim)[0]["loss"]

    for peer in survivors:
        peer.wait_for(
            lambda e: e["type"] == "epoch" and e["epoch"] >= killed_at + 3,
            timeout=180,
            what=f"three epochs after the kill at epoch {killed_at}",
        )
    for peer in survivors:
        kill_round = [e for e in epochs_of(peer) if e["epoch"] == killed_at]
        # (a group of 3 here may still be the killed peer's: hivemind finishes a round without the parts of a peer
        # that died in it, and its log says "Reducer: received 66.7% of input tensors")
        print(f"{peer.name}: the round of epoch {killed_at} as it saw it: {kill_round}")
        for e in epochs_of(peer):
            assert math.isfinite(e["loss"]), (peer.name, e)
        # they still average with each other after the kill (the dead peer is no longer in their groups)
        later = [e for e in epochs_of(peer) if killed_at < e["epoch"] <= killed_at + 3]
        assert any(e["averaged"] and e["group_size"] == 2 for e in later), later

    # (2) the same command again: it loads the swarm's state and trains at the swarm's epoch
    swarm_epoch = max(e["epoch"] for peer in survivors for e in epochs_of(peer)) + 1
    restarted = start_peer(f"{victim.name}-restarted", *command[index])
    restore = restarted.wait_for(lambda e: e["type"] == "restore", timeout=120, what="loading the swarm's state")
    assert restore["reason"] == "behind_swarm" and restore["loaded"] is True, restore
    assert restore["epoch_before"] == 0 and restore["epoch_after"] >= swarm_epoch, (restore, swarm_epoch)
    first = restarted.wait_for(lambda e: e["type"] == "epoch", timeout=120, what="its first epoch")
    assert first["epoch"] >= swarm_epoch > killed_at + 3
    # three epochs of it (not always consecutive: hivemind may move a peer that fell behind to the swarm's epoch),
    # and the others' reports of the same epochs
    restarted.wait_for(
        lambda e: e["type"] == "epoch" and len(epochs_of(restarted)) >= 3, timeout=120, what="three epochs"
    )
    mine = epochs_of(restarted)[:3]
    for peer in survivors:
        peer.wait_for(
            lambda e: e["type"] == "epoch" and e["epoch"] >= mine[-1]["epoch"],
            timeout=60,
            what=f"epoch {mine[-1]['epoch']}",
        )
    paths = [params[peers.index(peer)] for peer in survivors] + [params[index]]  # the restarted peer's: its own
    final = stop_and_load_params(survivors + [restarted], paths)

    # (its first epoch may be one step only: it came in at the end of one)
    compared = [
        (e["epoch"], e["loss"], loss_at(survivors, e["epoch"]))
        for e in mine
        if loss_at(survivors, e["epoch"]) is not None
    ]
    print(
        f"killed at epoch {killed_at}; restarted at epoch {first['epoch']}: (epoch, its loss, the others') "
        f"{compared}; initial loss {initial_loss:.4f}"
    )
    assert all(math.isfinite(e["loss"]) for e in mine), mine
    assert len(compared) >= 2, (mine, [epochs_of(peer)[-3:] for peer in survivors])
    ours, theirs = (sum(row[i] for row in compared) / len(compared) for i in (1, 2))
    assert initial_loss - theirs > 0.05, "the swarm did not learn enough for this test to tell states apart"
    # it starts from the swarm's parameters, not from the initial ones
    assert abs(ours - theirs) < 0.3 * (initial_loss - theirs), (ours, theirs, initial_loss)
    for name, tensors in zip(("survivor-0", "survivor-1", "restarted"), final):
        assert_finite(tensors, name)


# ---------------------------------------------------------------------------------------------
# (5): one peer's training goes nan

NAN_AT_EPOCH = 6  # by then the loss has fallen visibly below its initial value


@pytest.mark.slow
def test_a_peer_whose_loss_turns_nan_loads_the_swarms_state_and_the_others_are_not_poisoned(
    first_peer, start_peer, tiny_shards, tmp_path
):
    from nan_peer import start_nan_peer

    run_id = "test_fault_nan"
    _, addresses = first_peer(run_id, *(arg for setting in SETTINGS for arg in ("--set", setting)))
    params = [str(tmp_path / f"params-{i}.pt") for i in range(3)]
    honest = [
        start_peer(
            f"honest-{i}",
            *join_args(run_id, addresses, tiny_shards, "--wait-for-peers", "3", "--save-params", params[i]),
        )
        for i in range(2)
    ]
    # at epoch 6 its token embedding turns nan: every loss after it is nan until it loads sound parameters.
    # Were its nan gradients averaged, every peer's step would be nan.
    sick = start_nan_peer(
        "nan-peer",
        join_args(run_id, addresses, tiny_shards, "--wait-for-peers", "3", "--save-params", params[2]),
        str(tmp_path / "nan-peer.log"),
        at_epoch=NAN_AT_EPOCH,
    )
    try:
        fault = sick.wait_for(lambda e: e["type"] == "fault", timeout=240, what="the injected fault")
        # (a peer also reports the states its steps load when it is behind: the one after the fault is non_finite)
        restore = sick.wait_for(
            lambda e: e["type"] == "restore" and e["reason"] == "non_finite",
            timeout=120,
            what="loading the swarm's state",
        )
        assert restore["reason"] == "non_finite" and "nan" in restore["problem"], restore
        assert restore["loaded"] is True, restore
        fault_epoch = restore["epoch_before"]
        # it trains on with the swarm: the epoch it came back in, then two whole ones
        back = restore["epoch_after"]
        sick.wait_for(
            lambda e: e["type"] == "epoch" and e["epoch"] >= back + 2,
            timeout=120,
            what="two whole epochs after loading the swarm's state",
        )
        for peer in honest:
            peer.wait_for(lambda e: e["type"] == "epoch" and e["epoch"] >= back + 2, timeout=60, what="the same epochs")
        final = stop_and_load_params(honest + [sick], params)
    finally:
        sick.kill()

    print(f"fault at step {fault['step']} (epoch {fault_epoch}); {restore}")
    assert fault["epoch"] >= NAN_AT_EPOCH and fault_epoch == fault["epoch"]
    initial_loss = epochs_of(sick)[0]["loss"]
    # whole epochs on the loaded state that the honest peers trained too (the peers are stopped one after the other: the
    # last one can end an epoch, alone, after the others have stopped)
    after = [e for e in epochs_of(sick) if e["epoch"] > back and loss_at(honest, e["epoch"]) is not None]
    assert len(after) >= 2 and any(e["averaged"] for e in after), after  # it averages with the others again
    for e in after:
        print(
            f"epoch {e['epoch']}: nan peer {e['loss']:.4f}, honest peers {loss_at(honest, e['epoch']):.4f} "
            f"(initial {initial_loss:.4f})"
        )
        assert math.isfinite(e["loss"]), e
    # from the swarm's parameters: over those epochs, nearer the others' loss than the initial one (an epoch's loss is
    # a mean over a peer's own batches: of the 0.16 the tiny preset learns by then, 0.3 was within that noise)
    mine = sum(e["loss"] for e in after) / len(after)
    theirs = sum(loss_at(honest, e["epoch"]) for e in after) / len(after)
    assert initial_loss - theirs > 0.05, "the swarm did not learn enough for this test to tell states apart"
    assert abs(mine - theirs) < 0.5 * (initial_loss - theirs), (mine, theirs, initial_loss)
    for e in epochs_of(sick):  # the nan step never counted in an epoch's loss
        assert math.isfinite(e["loss"]), e
    done = sick.wait_for(lambda e: e["type"] == "done", timeout=1, what="done")
    assert done["skipped_steps"] == 1, done  # one step dropped, then sound again

    for peer in honest:
        records = epochs_of(peer)
        assert all(math.isfinite(e["loss"]) for e in records), records
        # training went on (averaged with peers) and kept learning
        later = [e for e in records if e["epoch"] > fault_epoch]
        assert len(later) >= 2 and any(e["averaged"] for e in later), later
        assert records[-1]["loss"] < records[0]["loss"], records
    for name, tensors in zip(("honest-0", "honest-1", "nan-peer"), final):
        assert_finite(tensors, name)


# ---------------------------------------------------------------------------------------------
# alone in the swarm: nobody to load a state from


@pytest.mark.slow
def test_a_nan_loss_alone_skips_the_step_and_nan_parameters_alone_stop_with_a_clear_error(tiny_shards, tmp_path):
    from nan_peer import start_nan_peer

    cases = dict(nan_loss=("loss", 1), nan_params=("parameters", 1), nan_always=("loss", 1000))
    peers = {}
    try:
        for name, (what, steps) in cases.items():  # three lone peers at once, each in a run of its own
            peers[name] = start_nan_peer(
                name,
                [
                    "join",
                    "--preset",
                    "tiny",
                    "--run-id",
                    f"test_fault_{name}",
                    "--host",
                    "127.0.0.1",
                    "--data",
                    tiny_shards,
                    "--threads",
                    "1",
                    "--events",
                    "--no-progress",
                    "--max-steps",
                    "20",
                ],
                str(tmp_path / f"{name}.log"),
                at_step=5,
                what=what,
                steps=steps,
            )
        codes = {name: peer.wait_exit(timeout=180) for name, peer in peers.items()}
    finally:
        for peer in peers.values():
            peer.kill()

    # a nan loss with sound parameters: the step is dropped, training goes on from the local state
    peer = peers["nan_loss"]
    assert codes["nan_loss"] == 0, peer.log_tail()
    restore = next(e for e in peer.events if e["type"] == "restore" and e["reason"] == "non_finite")
    assert restore["reason"] == "non_finite" and restore["loaded"] is False, restore
    done = next(e for e in peer.events if e["type"] == "done")
    assert done["local_steps"] == 20 and done["skipped_steps"] == 1, done

    # nan parameters and nobody to load from: a clear error, not a swarm fed with nan
    peer = peers["nan_params"]
    assert codes["nan_params"] == 2, peer.log_tail()
    log = open(peer.log_path).read()
    assert "no peer of run 'test_fault_nan_params' could give its state" in log and "Traceback" not in log, log[-2000:]

    # a loss that stays nan (the data or the settings are wrong): it gives up after max_non_finite_steps
    peer = peers["nan_always"]
    assert codes["nan_always"] == 2, peer.log_tail()
    log = open(peer.log_path).read()
    assert f"for {Volunteer.max_non_finite_steps + 1} local steps in a row" in log, log[-2000:]
    assert (
        sum(e["type"] == "restore" and e["reason"] == "non_finite" for e in peer.events)
        == Volunteer.max_non_finite_steps
    )


# a lone volunteer on 127.0.0.1 whose every step asks for the swarm's state (as a peer behind the swarm does, each step
# finding it behind): no peer can give it, as when a late joiner's DHT lost its neighbours on a full link; the moment
# and
# outcome of each try, as the volunteer reports them
STATE_NEVER_COMES = textwrap.dedent("""
    import json, logging, sys, time
    from collab_kit.config import get_preset
    from collab_kit.roles.volunteer import Volunteer

    logging.basicConfig(level=logging.INFO)
    config = get_preset("tiny", swarm=dict(run_id="state_never_comes", host="127.0.0.1"))
    tries = []
    with Volunteer.from_config(config, data_shards=sys.argv[1], num_threads=1) as volunteer:
        def ask_again(record):
            tries.append(dict(at=time.monotonic(), loaded=record.loaded, reason=record.reason))
            volunteer.optimizer.request_resync("the test asks for the swarm's state at every step")

        volunteer.optimizer.request_resync("the test asks for the swarm's state at every step")
        started = time.monotonic()
        history = volunteer.train(max_steps=4, progress=False, on_restore=ask_again)
    print(json.dumps(dict(tries=tries, steps=history.local_steps, seconds=time.monotonic() - started)), flush=True)
""")


@pytest.mark.slow
def test_a_peer_that_cannot_get_the_swarms_state_waits_longer_between_tries_instead_of_spinning(tiny_shards):
    """A peer behind the swarm tries to load its state at each step; when no peer gives it, the next step waits
    (STATE_RETRY_WAITS: 1, 2, 4 s...). A late joiner on a thin link tried 1197 times in 49 s without it."""
    finished = subprocess.run(
        [sys.executable, "-c", STATE_NEVER_COMES, tiny_shards], capture_output=True, text=True, timeout=180
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    tries = result["tries"]
    assert result["steps"] == 4 and len(tries) == 4, result
    assert all(t["reason"] == "behind_swarm" and t["loaded"] is False for t in tries), tries
    gaps = [later["at"] - earlier["at"] for earlier, later in zip(tries, tries[1:])]
    for gap, wait in zip(gaps, STATE_RETRY_WAITS):
        assert gap >= wait, (gaps, STATE_RETRY_WAITS)  # each try waited its turn, doubling
    for attempt, wait in enumerate(STATE_RETRY_WAITS[:4], start=1):
        assert (
            f"no peer gave the swarm's state ({attempt} time(s) in a row): trying again in {wait:.0f} s"
            in finished.stderr
        ), finished.stderr[-3000:]


# a lone volunteer on 127.0.0.1 that has reached the epoch it trains to when its link goes down (the other peers,
# done at the same epoch, left): whether training returns, and what it waited for; a stop after 30 s ends a wait
LIMIT_REACHED_AS_THE_LINK_GOES_DOWN = textwrap.dedent("""
    import json, sys, threading
    from collab_kit.config import get_preset
    from collab_kit.roles.volunteer import Volunteer

    config = get_preset("tiny", swarm=dict(run_id="limit_then_link_down", host="127.0.0.1"))
    with Volunteer.from_config(config, data_shards=sys.argv[1], num_threads=1) as volunteer:
        volunteer.train(max_steps=1, progress=False)
        volunteer._watchdog.link_down.set()  # what the watchdog does when no initial peer and no neighbour answers
        stop = threading.Timer(30, volunteer.request_stop)
        stop.start()
        history = volunteer.train(max_epochs=volunteer.local_epoch, progress=False)
        stop.cancel()
    print(json.dumps(dict(interrupted=history.interrupted, link_outages=history.link_outages)), flush=True)
""")


@pytest.mark.slow
def test_a_peer_at_its_last_epoch_stops_even_if_its_link_went_down(tiny_shards):
    """In the CenteredClip benchmark, one honest peer reached its last epoch as the others, done, left: it took their
    leaving for a cut link and waited for the link to come back, for ever."""
    finished = subprocess.run(
        [sys.executable, "-c", LIMIT_REACHED_AS_THE_LINK_GOES_DOWN, tiny_shards],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    assert result == dict(interrupted=False, link_outages=0), result


def test_the_non_finite_checks_name_what_is_wrong():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    volunteer = SimpleNamespace(model=model)  # the checks read only the model
    loss = model(torch.ones(4, 3)).pow(2).mean()
    loss.backward()
    assert Volunteer._non_finite_step_problem(volunteer, loss) is None
    assert Volunteer._non_finite_step_problem(volunteer, loss * float("nan")) == "the loss is nan"
    assert Volunteer._non_finite_step_problem(volunteer, loss.detach() + float("inf")) == "the loss is inf"
    model[1].weight.grad[0, 0] = float("inf")  # a finite loss whose backward pass overflowed
    assert Volunteer._non_finite_step_problem(volunteer, loss) == "the gradients are not finite"

    assert Volunteer._non_finite_parameters_problem(volunteer) is None
    with torch.no_grad():
        model[1].bias.fill_(float("nan"))
    assert Volunteer._non_finite_parameters_problem(volunteer) == "parameters are not finite: 1.bias"
