"""The run's DHT keys are the ones hivemind writes under, and the averager classes the kit composes keep hivemind's
RPC names, except where a round computes something else (CenteredClip)."""

import asyncio
from typing import AsyncIterator  # noqa: UP035 (hivemind finds a stream rpc_ handler by typing's hint)

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from collab_kit.config import SwarmConfig, get_preset
from collab_kit.model.transformer import initial_model
from collab_kit.swarm import keys
from collab_kit.swarm.averagers import (
    ANCHOR_ROLE,
    ClientModeMatchmakingMixin,
    DirectStateMixin,
    DownloadRecorderMixin,
    FinishServingMixin,
    ForkedTorchThreadsMixin,
    RoundReportMixin,
    SentBytesMixin,
    compose_averager,
    recording_state_averager_class,
    round_report_averager_class,
)
from collab_kit.swarm.bindings import AuthorizedAveragerMixin, authorized_averager_class
from collab_kit.swarm.dht import start_dht
from collab_kit.swarm.kept_tasks import KeptPipeCallsMixin
from collab_kit.swarm.local_updates import mode_averager_class
from collab_kit.swarm.optimizer import make_optimizer
from collab_kit.swarm.robust import CenteredClipAveragerMixin, CenteredClipGradientAverager, with_centered_clip
from collab_kit.swarm.streams import CallerClosesStreamsMixin


@pytest.fixture
def optimizer():
    """A lone peer's collaborative optimizer on a real DHT (127.0.0.1), as the volunteer builds it."""
    dht = start_dht(SwarmConfig(host="127.0.0.1"))
    preset = get_preset("tiny")
    built = make_optimizer(initial_model(preset.model, "keys_run"), dht, "keys_run", preset.optimizer)
    yield built
    built.shutdown()
    dht.shutdown()


def test_the_keys_the_monitor_reads_are_those_hivemind_writes(optimizer):
    # the monitor reads the progress and downloads the state with no optimizer of its own: by these names only
    assert optimizer.tracker.training_progress_key == keys.progress_key("keys_run") == "keys_run_progress"
    assert optimizer.state_averager.prefix == keys.state_averager_prefix("keys_run")
    assert optimizer.grad_averager.prefix == keys.grad_averager_prefix("keys_run")
    names = [
        keys.progress_key("r"),
        keys.grad_averager_prefix("r"),
        keys.state_averager_prefix("r"),
        keys.metrics_key("r"),
        keys.presence_key("r"),
        keys.peer_tokens_key("r"),
    ]
    assert len(set(names)) == len(names) and all(name.startswith("r_") for name in names)


def test_composed_averagers_keep_hivemind_rpc_names_unless_the_round_computes_otherwise():
    state = recording_state_averager_class()
    assert state.__name__ == "TrainingStateAverager" and state.__qualname__ == "RecordingTrainingStateAverager"
    assert state.__mro__[1:10] == (
        KeptPipeCallsMixin,
        ForkedTorchThreadsMixin,
        SentBytesMixin,
        DirectStateMixin,
        FinishServingMixin,
        CallerClosesStreamsMixin,
        ClientModeMatchmakingMixin,
        TrainingStateAverager,
        DownloadRecorderMixin,
    )
    gradients = round_report_averager_class(GradientAverager, ANCHOR_ROLE)
    assert gradients.__name__ == "GradientAverager" and gradients.round_role == ANCHOR_ROLE
    assert issubclass(gradients, RoundReportMixin)
    # CenteredClip changes what a round computes: a peer that takes the plain mean must not join its rounds
    robust = with_centered_clip(gradients)
    assert robust.__name__ == "CenteredClipGradientAverager" == CenteredClipGradientAverager.__name__
    assert issubclass(robust, CenteredClipAveragerMixin) and issubclass(robust, RoundReportMixin)
    # the authorization gate only guards: its averagers still average with the run's others
    gated = authorized_averager_class(robust, peer_gate=None)
    assert gated.__name__ == "CenteredClipGradientAverager" and issubclass(gated, AuthorizedAveragerMixin)
    assert compose_averager(DecentralizedAverager, AuthorizedAveragerMixin).__name__ == "DecentralizedAverager"
    # the local-update mode averages pseudo-gradients and holds the outer optimizer's state: its peers average and
    # download among themselves only
    local = get_preset("tiny", optimizer=dict(local_steps=4)).optimizer
    assert mode_averager_class(gradients, get_preset("tiny").optimizer) is gradients
    assert mode_averager_class(gradients, local).__name__ == "LocalUpdatesGradientAverager"
    assert (
        with_centered_clip(mode_averager_class(gradients, local)).__name__ == "CenteredClipLocalUpdatesGradientAverager"
    )
    assert mode_averager_class(state, local).__name__ == "LocalUpdatesTrainingStateAverager"
    assert issubclass(mode_averager_class(state, local), SentBytesMixin)


def test_each_composed_class_collects_its_own_rpc_handlers_under_its_rpc_name():
    # hivemind caches a class's handlers in class attributes: a composed class must not take its base's cache
    GradientAverager._collect_rpc_handlers()  # the base's cache filled first, as by an averager built before
    gated = authorized_averager_class(GradientAverager, peer_gate=None)
    assert "_rpc_handlers" in vars(gated) and vars(gated)["_rpc_handlers"] is None
    gated._collect_rpc_handlers()
    assert gated._rpc_handlers is not GradientAverager._rpc_handlers
    assert {handler.method_name for handler in gated._rpc_handlers} >= {
        "rpc_join_group",
        "rpc_aggregate_part",
        "rpc_download_state",
    }
    # the name other peers call it by is GradientAverager's, and the call reaches the gate first
    assert gated._get_handle_name("run_grad_averager", "rpc_join_group") == GradientAverager._get_handle_name(
        "run_grad_averager", "rpc_join_group"
    )
    assert gated.rpc_join_group is AuthorizedAveragerMixin.rpc_join_group


class SlowReducerMixin:
    """A reducer that sends each averaged part back half a second late: a slow uplink, made certain."""

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super().rpc_aggregate_part(stream, context):
            await asyncio.sleep(0.5)
            yield message


@pytest.mark.parametrize("finish_serving", [False, True], ids=["hivemind_as_shipped", "with_the_mixin"])
def test_a_peer_that_stops_after_its_last_round_first_sends_the_parts_it_owes_its_group(finish_serving):
    """hivemind's round ends for a peer when its own results are back; as a reducer it may still owe the others theirs.
    Stopping then (the last round of --max-epochs) cut them: a groupmate got 78.7% of the state average and ended
    apart. Two real averagers on 127.0.0.1; the one that stops reduces slowly, so that it surely stops mid-send."""
    mixins = (FinishServingMixin, SlowReducerMixin) if finish_serving else (SlowReducerMixin,)
    slow_class = compose_averager(DecentralizedAverager, *mixins)
    first = start_dht(SwarmConfig(host="127.0.0.1"))
    second = start_dht(SwarmConfig(host="127.0.0.1", initial_peers=[str(a) for a in first.get_visible_maddrs()]))
    size = 2**20  # 4 MiB of fp32: each peer reduces 2 MiB, 4 parts of hivemind's 512 KiB
    common = dict(
        prefix="finish_serving", target_group_size=2, min_matchmaking_time=2.0, request_timeout=2.0, start=True
    )
    stopping = slow_class([torch.ones(size)], dht=first, **common)
    staying = DecentralizedAverager([torch.zeros(size)], dht=second, **common)
    try:
        stopping_round, staying_round = stopping.step(wait=False), staying.step(wait=False)
        assert stopping_round.result(timeout=60) is not None, "the stopping peer's round failed"
        stopping.shutdown()  # at once, as a peer at its last epoch does
        assert staying_round.result(timeout=60) is not None, "the staying peer's round failed"
        with staying.get_tensors() as (averaged,):
            left_alone = (averaged != 0.5).sum().item()
    finally:
        if stopping.is_alive():
            stopping.shutdown()
        staying.shutdown()
        second.shutdown()
        first.shutdown()
    if finish_serving:
        assert left_alone == 0, f"{left_alone} of {size} values missed the average"
    else:  # should hivemind ever wait by itself, this half fails and the mixin can go
        assert left_alone > 0, "hivemind now sends what a stopping peer owes: FinishServingMixin is no longer needed"


def test_state_parts_split_every_tensor_once_and_evenly():
    from collab_kit.swarm.direct_state import state_parts

    sizes = [4096, 64, 4096, 8192, 64, 2048, 2048, 10]
    parts = state_parts(sizes, 3)
    assert sorted(index for part in parts for index in part) == list(range(len(sizes)))
    totals = sorted(sum(sizes[index] for index in part) for part in parts)
    assert totals[-1] - totals[0] <= max(sizes) // 2, totals
    assert state_parts(sizes, 3) == parts  # the same on every peer
    assert state_parts([5], 2) == [[0], []]


@pytest.mark.slow
def test_a_sharer_serves_the_state_of_the_peers_it_names():
    from functools import partial

    from waiting import wait_until

    def model(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))

    # a volunteer behind NAT (client mode) holds the swarm's state and lets two anchors read it; theirs are stale
    first = start_dht(SwarmConfig(host="127.0.0.1"))
    initial = [str(a) for a in first.get_visible_maddrs()]
    dhts = [
        first,
        start_dht(SwarmConfig(host="127.0.0.1", initial_peers=initial)),
        start_dht(SwarmConfig(host="127.0.0.1", initial_peers=initial, client_mode=True)),
        start_dht(SwarmConfig(host="127.0.0.1", initial_peers=initial)),
    ]
    state_class = recording_state_averager_class()
    first_anchor, second_anchor, volunteer, joiner = [
        state_class(
            dht=dht,
            optimizer=partial(torch.optim.Adam, lr=0.01),
            params=model(seed).parameters(),
            prefix="proxy_run_state_averager",
            start=True,
            request_timeout=2.0,
            client_mode=dht.client_mode,
        )
        for seed, dht in enumerate(dhts)
    ]
    anchors = (first_anchor, second_anchor)
    try:
        swarm_state = [p.detach().clone() for p in volunteer.main_parameters]
        own_state = [p.detach().clone() for p in first_anchor.main_parameters]
        volunteer.serve_state_to([dhts[0].peer_id, dhts[1].peer_id])
        for anchor in anchors:
            anchor.serve_state_of([dhts[2].peer_id.to_bytes()])
        key = "proxy_run_state_averager.all_averagers"
        wait_until(
            lambda: (found := dhts[3].get(key, latest=True)) is not None and len(found.value) >= 2,
            timeout=30,
            what="both anchors in the DHT",
        )
        # in parts from both anchors, each taking from the volunteer only the part it serves
        joiner.load_state_from_peers(timeout=30)
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(joiner.main_parameters, swarm_state))
        served = [anchor.bytes_sent()[1] for anchor in anchors]
        from_volunteer = volunteer.bytes_sent()[1]
        print(f"bytes each anchor served: {served}; the volunteer served them {from_volunteer}")
        assert min(served) > 0.3 * sum(served), served
        assert from_volunteer < 1.2 * sum(served), (served, from_volunteer)  # the state once, not once per anchor
        whole = first_anchor.served_state()
        assert whole is not None and torch.equal(whole[1][0], swarm_state[0])
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(first_anchor.main_parameters, own_state))
        # its own state again once it names nobody
        for anchor in anchors:
            anchor.serve_state_of([])
        joiner.load_state_from_peers(timeout=30)
        assert not torch.equal(joiner.main_parameters[0], swarm_state[0])
        # a source that gives nothing: the anchor serves nothing (a joiner asks another peer)
        volunteer.serve_state_to([])
        first_anchor.serve_state_of([dhts[2].peer_id.to_bytes()])
        assert first_anchor.served_state() is None
    finally:
        for each in (*anchors, volunteer, joiner):
            each.shutdown()
        for dht in dhts:
            dht.shutdown()


@pytest.mark.slow
def test_a_late_joiner_downloads_different_tensors_from_each_sharer():
    from functools import partial

    from waiting import wait_until

    def model(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))

    def averager(averager_class, dht, built):
        return averager_class(
            dht=dht,
            optimizer=partial(torch.optim.Adam, lr=0.01),
            params=built.parameters(),
            prefix="parts_run_state_averager",
            start=True,
            request_timeout=2.0,
        )

    first = start_dht(SwarmConfig(host="127.0.0.1"))
    initial = [str(a) for a in first.get_visible_maddrs()]
    dhts = [first] + [start_dht(SwarmConfig(host="127.0.0.1", initial_peers=initial)) for _ in range(3)]
    state_class = recording_state_averager_class()
    sharers = [averager(state_class, dht, model(0)) for dht in dhts[:2]]
    joiner_model = model(1)
    joiner = averager(state_class, dhts[2], joiner_model)
    started = []
    try:
        shared = [p.detach().clone() for p in sharers[0].main_parameters]
        key = "parts_run_state_averager.all_averagers"

        def sharing(count):
            found = dhts[2].get(key, latest=True)
            return found is not None and len(found.value) >= count + 1

        wait_until(lambda: sharing(2), timeout=30, what="both sharers in the DHT")
        joiner.load_state_from_peers(timeout=30)
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(joiner.main_parameters, shared))
        served = [sharer.bytes_sent()[1] for sharer in sharers]
        print(f"bytes each sharer served: {served}")
        assert min(served) > 0.3 * sum(served), served  # each gave about half, neither all

        # a sharer that has no parts to give (hivemind's own averager): its part comes from the others
        started.append(averager(TrainingStateAverager, dhts[3], model(0)))
        wait_until(lambda: sharing(3), timeout=30, what="the third sharer in the DHT")
        with torch.no_grad():
            for parameter in joiner.main_parameters:
                parameter.add_(1.0)
        joiner.load_state_from_peers(timeout=30)
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(joiner.main_parameters, shared))
        again = [sharer.bytes_sent()[1] - before for sharer, before in zip(sharers, served)]
        print(f"bytes each sharer served with a third one that gives no parts: {again}")
        # in parts again (hivemind's download would take it all from one peer), the third one's part from the others
        assert min(again) > 0.2 * sum(served) and sum(again) > 0.9 * sum(served), (served, again)
    finally:
        for each in [*sharers, joiner, *started]:
            each.shutdown()
        for dht in dhts:
            dht.shutdown()
