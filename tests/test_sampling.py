"""Top-k, top-p and temperature on crafted logits."""
import pytest
import torch

from collab_kit.sampling import sample_next, top_k_filter, top_p_filter


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, -2.0, 4.0]])
    kept = top_k_filter(logits, 2)
    assert torch.isfinite(kept).tolist() == [[False, True, False, False, True]]
    assert kept[0, 1] == 5.0 and kept[0, 4] == 4.0  # kept logits are unchanged
    assert torch.equal(top_k_filter(logits, 10), logits)
    with pytest.raises(ValueError, match="top_k=0"):
        top_k_filter(logits, 0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probabilities = torch.tensor([[0.5, 0.05, 0.3, 0.15]])
    logits = probabilities.log()
    # 0.5 alone < 0.75; 0.5 + 0.3 = 0.8 >= 0.75: keep those two
    assert torch.isfinite(top_p_filter(logits, 0.75)).tolist() == [[True, False, True, False]]
    # exactly reaching p stops there: 0.5 + 0.3 = 0.8
    assert torch.isfinite(top_p_filter(logits, 0.8)).tolist() == [[True, False, True, False]]
    assert torch.isfinite(top_p_filter(logits, 0.81)).tolist() == [[True, False, True, True]]
    # the most likely entry always survives
    assert torch.isfinite(top_p_filter(logits, 1e-6)).tolist() == [[True, False, False, False]]
    with pytest.raises(ValueError, match="top_p=1.5"):
        top_p_filter(logits, 1.5)


def test_filters_work_row_by_row_on_batches():
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    assert torch.isfinite(top_k_filter(logits, 1)).tolist() == [[False, False, True], [True, False, False]]
    assert torch.isfinite(top_p_filter(logits, 0.5)).tolist() == [[False, False, True], [True, False, False]]


def test_sampling_respects_the_filters_and_temperature():
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.9, 1.8, -5.0, 0.0]]).repeat(2000, 1)
    drawn = sample_next(logits, top_k=2, generator=generator)
    assert set(drawn.tolist()) == {0, 1}
    drawn = sample_next(logits, top_p=0.5, generator=generator)
    assert set(drawn.tolist()) <= {0, 1}
    assert torch.equal(sample_next(logits, temperature=0), torch.zeros(2000, dtype=torch.long))
    # a high temperature flattens the distribution: the unlikely code 3 appears
    hot = sample_next(logits, temperature=100.0, generator=generator)
    share = (hot == 3).float().mean().item()
    assert abs(share - 0.2) < 0.05
    cold = sample_next(logits, temperature=0.05, generator=generator)
    assert (cold == 0).float().mean().item() > 0.8
    with pytest.raises(ValueError, match="temperature=-1"):
        sample_next(logits, temperature=-1)
