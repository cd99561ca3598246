"""The all-reduce runners of the kit's rounds: which runner a round uses, and each member's mode in it.

- ``RunnerChoiceMixin`` (put before a hivemind averager): chooses the class of a round's all-reduce runner and gives
  it each member's mode (an auxiliary peer only reduces).
- ``StandInRunnerMixin``: an anchor's runner sends its reducers one value per part, since its parts weigh nothing.
- ``SharedFourBitAverageMixin``: parts sent in 4 bits come back to every member as one and the same 4-bit average.
- ``StreamedResultsMixin``: a kit peer in client mode gets its averages while it still sends its parts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, TypeAlias

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.partition import BannedException
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import amap_in_executor, as_aiter, azip

from collab_kit.swarm.four_bit import is_whole_average, round_4bit, sends_4_bits, serialize_average

if TYPE_CHECKING:  # the type checker's view: what each mixin is put before
    from hivemind.averaging import DecentralizedAverager

    _RunnerBase: TypeAlias = AllReduceRunner
    _AveragerBase: TypeAlias = DecentralizedAverager
else:
    _RunnerBase = _AveragerBase = object


class StandInRunnerMixin(_RunnerBase):
    """Put before hivemind's AllReduceRunner: with ``stand_ins`` and a weight of 0, this peer sends each reducer one
    zero value per part instead of the part itself, and still gets every averaged part back.

    A part of weight 0 never counts, and one value broadcasts to the part's shape
    (tests/swarm/test_robust.py::test_an_anchor_sends_its_reducers_almost_nothing_and_gets_the_whole_average).
    """

    def __init__(self, *, stand_ins: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.stand_ins = stand_ins

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        if not (self.stand_ins and self.weight == 0):
            async for message in super()._generate_input_for_peer(peer_index):
                yield message
            return
        container = self.tensor_part_container
        container._inputs_consumed_by_peer[peer_index] = True  # as hivemind's iterate_input_parts_for marks them
        for part_index, (part, info) in enumerate(container._input_parts_by_peer[peer_index]):
            # compressed as the part would be: the reducer sends the average back in the sender's compression
            stand_in = container.compression.compress(torch.zeros(1, dtype=part.dtype), info)
            if part_index == 0:
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.PART_FOR_AVERAGING,
                    group_id=self.group_id,
                    tensor_part=stand_in,
                    weight=self.weight,
                )
            else:
                yield averaging_pb2.AveragingData(tensor_part=stand_in, weight=self.weight)


class SharedFourBitAverageMixin(_RunnerBase):
    """Put before hivemind's AllReduceRunner: the parts sent in 4 bits (collab_kit.swarm.four_bit) come back to every
    member as one and the same 4-bit average.

    hivemind's reply (the average minus the sender's part, rounded in 4 bits per sender) would set members apart;
    here the reducer sends the rounded average whole, and a member subtracts its part. Shown by
    tests/swarm/test_local_updates.py::test_4_bit_pseudo_gradients_with_error_feedback_average_through_hivemind.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        container = self.tensor_part_container
        # the parts this member sends each reducer (hivemind empties its lists as it sends them)
        self._parts_sent = [tuple(part for part, _ in parts) for parts in container._input_parts_by_peer]
        reduced = container._input_parts_by_peer[self.ordered_peer_ids.index(self.peer_id)]
        self._four_bit_parts = frozenset(
            index for index, (_, info) in enumerate(reduced) if sends_4_bits(container.compression, info)
        )
        register = container.register_processed_part

        def register_difference(peer_index: int, part_index: int, part: torch.Tensor) -> None:
            if is_whole_average(part):
                part = part - self._parts_sent[peer_index][part_index]
            register(peer_index, part_index, part)

        container.register_processed_part = register_difference

    async def run(self) -> AsyncIterator[torch.Tensor]:
        if self._four_bit_parts:  # the reducer as the round uses it (a subclass may have replaced it in __init__)
            reducer = self.tensor_part_reducer
            accumulate = reducer.accumulate_part

            async def accumulate_and_round(sender_index, part_index, tensor_part, weight: float = 1.0):
                average = await accumulate(sender_index, part_index, tensor_part, weight=weight)
                return round_4bit(average) if part_index in self._four_bit_parts else average

            reducer.accumulate_part = accumulate_and_round
        async for delta in super().run():
            yield delta

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int):
        # hivemind's (1.1.12), with one change: a 4-bit part's reply is the rounded average itself
        part_index = 0
        try:
            loop = asyncio.get_event_loop()
            async for tensor_part, weight, part_compression in amap_in_executor(
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                    rounded = part_index in self._four_bit_parts
                    part_index += 1
                except BannedException:
                    break  # sender was banned, we no longer need to aggregate it
                if rounded:
                    serialized = await loop.run_in_executor(None, serialize_average, averaged_part)
                else:
                    serialized = await loop.run_in_executor(
                        None, lambda: serialize_torch_tensor(averaged_part - tensor_part, part_compression)
                    )
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


class StreamedResultsMixin(_RunnerBase):
    """Put before hivemind's AllReduceRunner: a member in client mode that is a kit peer gets its averaged parts while
    it still sends (``streamed_results``: per member, whether it reads its averages as they come).

    hivemind 1.1.12 holds them back until it has sent everything (``should_delay_results``); overlapping the two
    directions makes a round take the longer, not the sum. A member that is not a kit peer keeps hivemind's rule
    (tests/swarm/test_robust.py::test_a_member_in_client_mode_gets_averages_while_it_sends).
    """

    def __init__(self, *, streamed_results: Sequence[bool] = (), **kwargs):
        super().__init__(**kwargs)
        self.streamed_results = tuple(streamed_results)

    def should_delay_results(self, peer_id) -> bool:
        index = self.ordered_peer_ids.index(peer_id)
        if index < len(self.streamed_results) and self.streamed_results[index]:
            return False
        return super().should_delay_results(peer_id)


def reads_averages_as_they_come(serializer, gathered: bytes) -> bool:
    """Whether a member of a round is a kit peer, which reads its averages while it sends: its all-gather entry (bytes,
    hivemind's [bandwidth, mode, user data]) carries a dict with its role (collab_kit.swarm.averagers.round_member)."""
    try:
        member = serializer.loads(serializer.loads(gathered)[2])
    except Exception:  # not hivemind's layout: hivemind's rule for it
        return False
    return isinstance(member, dict) and "role" in member


class StandInAllReduceRunner(StreamedResultsMixin, SharedFourBitAverageMixin, StandInRunnerMixin, AllReduceRunner):
    """hivemind's AllReduceRunner with StreamedResultsMixin, SharedFourBitAverageMixin and StandInRunnerMixin."""


class RunnerChoiceMixin(_AveragerBase):
    """Put before a hivemind averager class: its rounds run the all-reduce runner ``make_allreduce_runner`` builds
    (StandInAllReduceRunner by default, sending stand-ins when ``sends_stand_ins``).

    hivemind builds the runner inside ``DecentralizedAverager._run_allreduce_inplace_`` (1.1.12), copied here with the
    runner's class as the one change; CenteredClip overrides ``make_allreduce_runner``.
    """

    sends_stand_ins = False  # whether parts of weight 0 go out as one value each (StandInRunnerMixin)

    def make_allreduce_runner(self, **kwargs) -> AllReduceRunner:
        """The runner of one round (hivemind's AllReduceRunner arguments)."""
        return StandInAllReduceRunner(**kwargs)

    def round_modes(self, group_info, peer_fractions: Sequence[float]) -> tuple[AveragingMode, ...]:
        """Each member's mode in a round: auxiliary where its all-gather says so, else hivemind's rule (client mode for
        a member that reduces nothing, a node otherwise).

        hivemind 1.1.12 does not pass the mode to the runner, which then takes an auxiliary peer for a node
        (tests/swarm/test_robust.py::test_an_auxiliary_anchor_only_reduces)."""
        announced = [AveragingMode(self.serializer.loads(entry)[1]) for entry in group_info.gathered]
        return tuple(
            AveragingMode.AUX
            if mode == AveragingMode.AUX
            else AveragingMode.CLIENT
            if fraction == 0
            else AveragingMode.NODE
            for mode, fraction in zip(announced, peer_fractions)
        )

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info, group_id: bytes | None = None, **kwargs
    ):
        group_id = group_info.group_id if group_id is None else group_id
        kwargs.setdefault("modes", self.round_modes(group_info, kwargs["peer_fractions"]))
        streamed = tuple(reads_averages_as_they_come(self.serializer, entry) for entry in group_info.gathered)
        runner = self.make_allreduce_runner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            stand_ins=self.sends_stand_ins,
            streamed_results=streamed,
            **kwargs,
        )
        assert group_id in self._running_groups, (
            f"Group id {group_id!r} was not registered in _register_allreduce_group"
        )
        self._running_groups[group_id].set_result(runner)

        if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
            async for tensor, update in azip(as_aiter(*tensors), runner):
                tensor.add_(update, alpha=self._averaging_alpha)
                self.last_updated = get_dht_time()
                self._state_updated.set()
        else:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
