"""The dense baseline decoder: shapes, causality, the loss, and that it learns."""
import pytest
import torch

from collab_kit.config import get_preset
from collab_kit.model import TextToImageTransformer, count_parameters


@pytest.fixture
def model_and_batch():
    config = get_preset("tiny").model
    torch.manual_seed(0)
    model = TextToImageTransformer(config).eval()
    text = torch.randint(3, config.text_vocab_size, (2, config.text_length))
    codes = torch.randint(0, config.codebook_size, (2, config.image_length))
    return config, model, text, codes


def test_shapes_and_a_finite_loss(model_and_batch):
    config, model, text, codes = model_and_batch
    out = model(text, codes)
    assert out.text_logits.shape == (2, config.text_length - 1, config.text_vocab_size)
    assert out.image_logits.shape == (2, config.image_length, config.codebook_size)
    assert torch.isfinite(out.loss)
    # an untrained model is close to uniform over the codebook
    assert abs(out.image_loss.item() - torch.log(torch.tensor(float(config.codebook_size))).item()) < 0.5


def test_a_prediction_never_sees_the_future(model_and_batch):
    config, model, text, codes = model_and_batch
    reference = model(text, codes).image_logits
    changed = codes.clone()
    changed[:, 5] = (changed[:, 5] + 1) % config.codebook_size
    logits = model(text, changed).image_logits
    # the prediction of code k reads codes < k only: predictions 0..5 are unchanged, code 6's changes
    assert torch.allclose(logits[:, :6], reference[:, :6], atol=1e-6)
    assert not torch.allclose(logits[:, 6], reference[:, 6], atol=1e-6)
    changed_text = text.clone()
    changed_text[:, 0] = (changed_text[:, 0] + 1) % config.text_vocab_size
    assert not torch.allclose(model(changed_text, codes).image_logits[:, 0], reference[:, 0], atol=1e-6)


def test_caption_padding_is_not_predicted(model_and_batch):
    config, model, text, codes = model_and_batch
    padded = text.clone()
    padded[:, 4:] = config.pad_token_id
    out = model(padded, codes)
    assert torch.isfinite(out.text_loss)
    # only the 3 real next tokens count: the loss equals the cross-entropy over them alone
    expected = torch.nn.functional.cross_entropy(out.text_logits[:, :3].flatten(0, 1), padded[:, 1:4].flatten())
    assert torch.allclose(out.text_loss, expected, atol=1e-5)


def test_wrong_shapes_are_explained(model_and_batch):
    config, model, text, codes = model_and_batch
    with pytest.raises(ValueError, match="expected text_tokens"):
        model(text[:, :-1], codes)


def test_embeddings_are_tied_and_the_model_learns_a_batch(model_and_batch):
    config, model, text, codes = model_and_batch
    assert count_parameters(model) < 100_000
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = model(text, codes).loss.item()
    for _ in range(60):
        loss = model(text, codes).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5 * first
