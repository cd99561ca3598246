"""Axial attention computes exactly the masked attention it stands for, without the n x n matrix."""

import pytest
import torch
import torch.nn.functional as F

from collab_kit.config import ATTENTION_KINDS
from collab_kit.model.attention import Layout


@pytest.mark.parametrize("text_length, image_side, kernel", [(3, 4, 3), (5, 6, 5), (2, 5, 11), (4, 7, 1), (1, 3, 3)])
@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_axial_attention_equals_dense_masked_attention(text_length, image_side, kernel, kind):
    layout = Layout(text_length, image_side, kernel)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, layout.length, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    axial = layout.attend(q, k, v, kind)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.dense_mask(kind))
    assert torch.allclose(axial, dense, rtol=0, atol=1e-12)
    # and so do the gradients
    upstream = torch.randn_like(dense)
    axial_grads = torch.autograd.grad(axial, (q, k, v), upstream)
    dense_grads = torch.autograd.grad(dense, (q, k, v), upstream)
    for a, d in zip(axial_grads, dense_grads):
        assert torch.allclose(a, d, rtol=0, atol=1e-12)


def test_the_masks_are_causal_and_every_image_position_sees_the_caption():
    layout = Layout(4, 5, 3)
    for kind in ATTENTION_KINDS:
        mask = layout.dense_mask(kind)
        assert not mask.triu(diagonal=1).any(), kind  # nothing after a position
        assert mask.diagonal().all(), kind  # every position sees itself
        assert mask[4:, :4].all(), kind  # the whole caption
        assert not mask[:4, 4:].any(), kind  # caption never sees the image
    # per image query: the row and column layers see one line, the conv layer a window
    visible = {kind: layout.dense_mask(kind)[4:, 4:].sum(1) for kind in ATTENTION_KINDS}
    assert visible["row"].max() == 5 and visible["column"].max() == 5 and visible["conv"].max() == 5
    assert visible["full"].max() == 25


def test_an_unknown_kind_is_explained():
    with pytest.raises(ValueError, match="choose one of row, column, conv, full"):
        Layout(2, 2).dense_mask("diagonal")
