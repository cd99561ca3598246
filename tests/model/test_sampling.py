"""Top-k, top-p and temperature on crafted logits; generation with a KV cache against without one."""

import pytest
import torch

from collab_kit.config import ModelConfig
from collab_kit.model.sampling import generate_image_codes, sample_next, top_k_filter, top_p_filter
from collab_kit.model.transformer import TextToImageTransformer


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


def generation_model() -> TextToImageTransformer:
    """Nine layers (every kind, shared blocks) whose random weights are large enough to vary their choices."""
    config = ModelConfig(
        hidden_size=32,
        num_layers=9,
        num_heads=2,
        text_length=5,
        image_side=6,
        codebook_size=40,
        text_vocab_size=50,
        pad_token_id=0,
        conv_kernel_size=3,
    )
    torch.manual_seed(0)
    model = TextToImageTransformer(config).double().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model


def test_cached_decoding_gives_the_logits_of_the_full_forward_pass():
    model = generation_model()
    text, codes = torch.randint(1, 50, (3, 5)), torch.randint(0, 40, (3, 36))
    full = model(text, codes, compute_loss=False).image_logits
    logits, cache = model.start_decoding(text)
    steps = [logits]
    for position in range(35):
        steps.append(model.continue_decoding(codes[:, position], cache))
    assert torch.allclose(torch.stack(steps, dim=1), full, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="already decoded"):
        model.continue_decoding(codes[:, -1], cache)


def test_greedy_generation_with_the_cache_equals_generation_without_it():
    model = generation_model()
    text = torch.randint(1, 50, (3, 5))
    steps = []
    cached = generate_image_codes(model, text, temperature=0, progress=steps.append)
    uncached = generate_image_codes(model, text, temperature=0, use_cache=False)
    assert cached.shape == (3, 36) and len(steps) == 36
    assert torch.equal(cached, uncached)
    assert cached.unique().numel() > 5  # a varied drawing, not one code repeated
    # greedy means: each code is the argmax of the model's prediction given the codes before it
    assert torch.equal(model(text, cached, compute_loss=False).image_logits.argmax(-1), cached)


def test_sampled_generation_is_reproducible_and_respects_top_k():
    model = generation_model()
    text = torch.randint(1, 50, (2, 5)).repeat(2, 1)  # two captions, twice each

    def draw(seed, **kwargs):
        return generate_image_codes(model, text, generator=torch.Generator().manual_seed(seed), **kwargs)

    assert torch.equal(draw(1, top_k=4), draw(1, top_k=4))
    assert not torch.equal(draw(1), draw(2))
    codes = draw(3, top_k=1)  # top-1 sampling is greedy
    assert torch.equal(codes, generate_image_codes(model, text, temperature=0))
