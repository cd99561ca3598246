"""Fragments of the local-update mode (collab_kit.swarm.fragments) in this process: how parameters are split, the
outer step of one fragment, and the setting. Two real peers averaging one fragment a round:
tests/swarm/test_local_updates.py::test_fragments_average_in_turn_and_the_others_keep_training."""

import pytest
import torch

from collab_kit.config import SettingProblem, get_preset
from collab_kit.swarm.fragments import fragment_of_tensors, round_fragment
from collab_kit.swarm.local_updates import OuterNesterovSGD


def test_fragments_are_contiguous_even_and_never_empty():
    sizes = [100] * 40
    assignment = fragment_of_tensors(sizes, 4)
    assert assignment == tuple(sorted(assignment)) and [assignment.count(f) for f in range(4)] == [10, 10, 10, 10]
    # one huge tensor first (an embedding): no fragment is skipped, the last ones still get a tensor each
    assignment = fragment_of_tensors([10_000, 10, 10, 10, 10], 4)
    assert assignment == (0, 1, 2, 3, 3)
    assert fragment_of_tensors([5, 5, 5], 3) == (0, 1, 2)
    # unequal tensors: every fragment holds about a quarter of the values
    sizes = [int(1000 * (1.5 + (i % 7) / 3)) for i in range(60)]
    assignment = fragment_of_tensors(sizes, 4)
    shares = [sum(size for size, f in zip(sizes, assignment) if f == fragment) / sum(sizes) for fragment in range(4)]
    assert all(0.2 < share < 0.3 for share in shares), shares
    assert [round_fragment(epoch, 4) for epoch in (0, 1, 5, 8, None)] == [0, 1, 1, 0, 0]


def test_the_outer_step_of_a_fragment_moves_it_alone_and_keeps_the_others_momentum():
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]
    outer = OuterNesterovSGD(params, lr=0.5, momentum=0.9)
    for param in params:
        param.grad = torch.full((3,), 0.2)
    outer.step()  # every parameter: momentum in all three
    moved = [param.detach().clone() for param in params]
    momentum = [outer.state[param]["momentum_buffer"].clone() for param in params]
    outer.fragment_mask = [False, True, False]
    for param in params:
        param.grad = torch.full((3,), float("nan"))  # a non-finite gradient outside the fragment is not this step's
    params[1].grad = torch.full((3,), 0.4)
    outer.step()
    assert outer.dropped_steps == 0
    assert torch.equal(params[0], moved[0]) and torch.equal(params[2], moved[2])
    assert not torch.equal(params[1], moved[1])
    assert torch.equal(outer.state[params[0]]["momentum_buffer"], momentum[0])
    assert not torch.equal(outer.state[params[1]]["momentum_buffer"], momentum[1])
    assert torch.isnan(params[0].grad).all()  # the gradients left out are given back as they were


def test_fragments_are_a_setting_of_the_local_update_mode_dividing_its_steps():
    config = get_preset("tiny", optimizer=dict(local_steps=8, fragments=4))
    assert config.optimizer.epoch_batches == 2 and config.optimizer.round_samples == 2 * 2048
    assert get_preset("tiny").optimizer.epoch_batches == 1
    with pytest.raises(SettingProblem, match="local_steps set to H > 0 too, a multiple of F"):
        get_preset("tiny", optimizer=dict(fragments=2))
    with pytest.raises(SettingProblem, match="a multiple of F"):
        get_preset("tiny", optimizer=dict(local_steps=6, fragments=4))
    with pytest.raises(SettingProblem, match="expected an integer >= 1"):
        get_preset("tiny", optimizer=dict(local_steps=4, fragments=0))
