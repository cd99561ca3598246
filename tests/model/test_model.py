"""The paper's decoder: shapes, the loss, what each attention layer sees, reversible layers, shared blocks."""

import copy

import pytest
import torch

from collab_kit.config import ModelConfig, get_preset
from collab_kit.model.transformer import TextToImageTransformer, count_compute_parameters, count_parameters, describe


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
    assert not hasattr(model, "lm_head") and not any("position" in name for name, _ in model.named_parameters())
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = model(text, codes).loss.item()
    for _ in range(60):
        loss = model(text, codes).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5 * first


# --- what each attention layer sees -------------------------------------------------------------
# One-layer models on a 3-token caption and a 5 x 5 image. The output at position i is the prediction
# made there; a position j is "seen" when changing the token at j changes that output.

T, S = 3, 5


def one_layer_model(kind: str) -> TextToImageTransformer:
    config = ModelConfig(
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        text_length=T,
        image_side=S,
        codebook_size=20,
        text_vocab_size=30,
        pad_token_id=0,
        attention_pattern=(kind,),
        last_layer_attention=None,
        conv_kernel_size=3,
    )
    torch.manual_seed(0)
    return TextToImageTransformer(config).double().eval()


def seen_by(model: TextToImageTransformer, query: int) -> set:
    """Positions whose token changes the output at ``query`` (caption positions 0..T-1, image T..)."""
    torch.manual_seed(1)
    text, codes = torch.randint(1, 30, (1, T)), torch.randint(0, 20, (1, S * S))

    def output():
        out = model(text, codes, compute_loss=False)
        return out.text_logits[0, query] if query < T - 1 else out.image_logits[0, query - (T - 1)]

    reference, seen = output(), set()
    for position in range(T + S * S):
        tokens, index = (text, position) if position < T else (codes, position - T)
        original = tokens[0, index].item()
        tokens[0, index] = (original + 7) % 20
        if not torch.allclose(output(), reference, rtol=0, atol=1e-12):
            seen.add(position)
        tokens[0, index] = original
    return seen


def image(row: int, column: int) -> int:
    return T + row * S + column


CAPTION = {0, 1, 2}


@pytest.mark.parametrize(
    "kind, query, expected",
    [
        # a row layer: the caption and its own row up to itself
        ("row", image(2, 2), CAPTION | {image(2, 0), image(2, 1), image(2, 2)}),
        ("row", image(3, 0), CAPTION | {image(3, 0)}),
        # a column layer: the caption and its own column up to itself
        ("column", image(2, 2), CAPTION | {image(0, 2), image(1, 2), image(2, 2)}),
        ("column", image(0, 4), CAPTION | {image(0, 4)}),
        # the conv-like layer (3 x 3 window): the caption, the row above within one column, its left neighbour
        ("conv", image(2, 2), CAPTION | {image(1, 1), image(1, 2), image(1, 3), image(2, 1), image(2, 2)}),
        ("conv", image(2, 4), CAPTION | {image(1, 3), image(1, 4), image(2, 3), image(2, 4)}),
        ("conv", image(0, 0), CAPTION | {image(0, 0)}),
        # caption tokens see the caption up to themselves, in every kind of layer, and never the image
        ("row", 1, {0, 1}),
        ("column", 0, {0}),
        ("conv", 1, {0, 1}),
        ("full", image(2, 2), CAPTION | set(range(T, image(2, 2) + 1))),
    ],
)
def test_each_layer_sees_exactly_what_its_mask_allows(kind, query, expected):
    model = one_layer_model(kind)
    assert seen_by(model, query) == expected
    # the written-out rule (used by cached generation) says the same
    allowed = model.layout.dense_mask(kind)[query]
    assert set(allowed.nonzero().flatten().tolist()) == expected


def test_the_paper_pattern_repeats_row_column_row_row_and_ends_with_conv():
    plan = ModelConfig().layer_plan()
    kinds = [kind for _, kind in plan]
    assert len(plan) == 64 and kinds[:8] == ["row", "column", "row", "row"] * 2 and kinds[-1] == "conv"
    assert kinds[:63] == (["row", "column", "row", "row"] * 16)[:63]
    assert sorted({block for block, _ in plan}) == [0, 1, 2, 3, 4]


# --- reversible layers and shared blocks -----------------------------------------------------------


def small_config(**changes) -> ModelConfig:
    values = dict(
        hidden_size=32,
        num_layers=9,
        num_heads=2,
        text_length=4,
        image_side=4,
        codebook_size=24,
        text_vocab_size=40,
        pad_token_id=0,
        conv_kernel_size=3,
    )
    values.update(changes)
    return ModelConfig(**values)


def loss_and_gradients(model, text, codes):
    model.zero_grad()
    loss = model(text, codes).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_reversible_gradients_equal_the_plain_computation():
    torch.manual_seed(0)
    reversible = TextToImageTransformer(small_config(reversible=True)).double().train()
    plain = copy.deepcopy(reversible)
    plain.config = small_config(reversible=False)
    text, codes = torch.randint(1, 40, (3, 4)), torch.randint(0, 24, (3, 16))
    loss_r, grads_r = loss_and_gradients(reversible, text, codes)
    loss_p, grads_p = loss_and_gradients(plain, text, codes)
    assert torch.allclose(loss_r, loss_p, rtol=0, atol=1e-12)
    assert grads_r.keys() == grads_p.keys()
    for name in grads_p:
        assert grads_p[name].abs().max() > 0, name
        assert torch.allclose(grads_r[name], grads_p[name], rtol=1e-7, atol=1e-10), name
    # and in float32, as trained: equal within rounding (inputs are rebuilt from outputs in backward)
    reversible32, plain32 = reversible.float(), plain.float()
    _, grads_r = loss_and_gradients(reversible32, text, codes)
    _, grads_p = loss_and_gradients(plain32, text, codes)
    for name in grads_p:
        assert torch.allclose(grads_r[name], grads_p[name], rtol=1e-3, atol=1e-6), name


def test_reversible_layers_keep_no_activations_per_layer():
    """What autograd saves for backward does not grow with depth when layers are reversible."""

    def saved_bytes(config):
        model = TextToImageTransformer(config).train()
        text, codes = torch.randint(1, 40, (2, 4)), torch.randint(0, 24, (2, 16))
        total = [0]

        def pack(tensor):
            if not isinstance(tensor, torch.nn.Parameter):
                total[0] += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(text, codes).loss  # what the forward pass leaves for backward
        loss.backward()  # (recomputing a layer in backward keeps that layer's activations only for a moment)
        return total[0]

    torch.manual_seed(0)
    shallow, deep = saved_bytes(small_config(num_layers=2)), saved_bytes(small_config(num_layers=16))
    assert deep == shallow
    assert saved_bytes(small_config(num_layers=16, reversible=False)) > 4 * deep


def test_shared_blocks_share_storage_and_sum_their_gradients():
    torch.manual_seed(0)
    config = small_config(num_layers=9)  # row column row row | row column row row | conv
    shared = TextToImageTransformer(config).double()
    assert len(shared.blocks) == 5 and [b for b, _ in shared.plan] == [0, 1, 2, 3, 0, 1, 2, 3, 4]
    layers = shared.layers(*[torch.zeros(1)] * 2)
    assert layers[0][1].__self__ is layers[4][1].__self__ is shared.blocks[0]
    assert (
        layers[0][0].func.__self__.attention.qkv.weight.data_ptr()
        == layers[4][0].func.__self__.attention.qkv.weight.data_ptr()
    )
    state = shared.state_dict()
    assert not any(key.startswith("blocks.5") for key in state)

    # the same weights without sharing: nine blocks, copies of the shared ones
    unshared = TextToImageTransformer(small_config(num_layers=9, share_layer_groups=False)).double()
    assert len(unshared.blocks) == 9
    with torch.no_grad():
        for layer, (b, _) in enumerate(shared.plan):
            unshared.blocks[layer].load_state_dict(shared.blocks[b].state_dict())
        for name in ("text_embedding", "image_embedding", "final_norm"):
            getattr(unshared, name).load_state_dict(getattr(shared, name).state_dict())
    assert count_compute_parameters(shared) == count_parameters(unshared) == count_compute_parameters(unshared)
    assert count_parameters(shared) < count_parameters(unshared)

    text, codes = torch.randint(1, 40, (2, 4)), torch.randint(0, 24, (2, 16))
    loss_s, _ = loss_and_gradients(shared, text, codes)
    loss_u, _ = loss_and_gradients(unshared, text, codes)
    assert torch.allclose(loss_s, loss_u, rtol=0, atol=1e-12)
    # a shared block's gradient is the sum of the gradients of its uses
    for name, param in shared.blocks[0].named_parameters():
        uses = [dict(unshared.blocks[layer].named_parameters())[name].grad for layer in (0, 4)]
        assert torch.allclose(param.grad, uses[0] + uses[1], rtol=1e-9, atol=1e-12), name


def test_the_paper_preset_has_about_1_1b_parameters_of_compute_and_8x_fewer_stored():
    info = describe(get_preset("paper").model)
    assert info["unique_blocks"] == 5 and info["layers"] == 64
    assert 1.0e9 <= info["compute_parameters"] <= 1.2e9
    assert info["compute_parameters"] / info["unique_parameters"] >= 7


def test_reversible_layers_train_under_bf16_autocast():
    """Backward recomputes the layers under the forward pass's autocast; gradients stay those of plain layers."""
    torch.manual_seed(0)
    reversible = TextToImageTransformer(small_config(reversible=True)).train()
    plain = copy.deepcopy(reversible)
    plain.config = small_config(reversible=False)
    text, codes = torch.randint(1, 40, (3, 4)), torch.randint(0, 24, (3, 16))
    grads = []
    for model in (reversible, plain):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(text, codes).loss
        loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in grads[1].items():
        assert grads[0][name].dtype == torch.float32
        assert ((grads[0][name] - grad).norm() / grad.norm()).item() < 2e-2, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_reversible_gradients_equal_the_plain_computation_under_autocast(dtype):
    """As a GPU trains (here torch's CPU autocast): the rebuilt activations are those of the forward pass, so the
    gradients equal the standard layers' within the 16-bit precision."""
    torch.manual_seed(0)
    reversible = TextToImageTransformer(small_config(reversible=True)).train()
    plain = copy.deepcopy(reversible)
    plain.config = small_config(reversible=False)
    text, codes = torch.randint(1, 40, (3, 4)), torch.randint(0, 24, (3, 16))
    with torch.autocast("cpu", dtype=dtype):
        loss_r, grads_r = loss_and_gradients(reversible, text, codes)
        loss_p, grads_p = loss_and_gradients(plain, text, codes)
    assert loss_r.dtype == torch.float32 and torch.allclose(loss_r, loss_p, atol=1e-6)
    for name in grads_p:
        scale = grads_p[name].abs().max()
        assert scale > 0 and (grads_r[name] - grads_p[name]).abs().max() <= 0.02 * scale, name


def test_a_stochastic_layer_draws_in_backward_what_it_drew_in_forward():
    """Dropout in a reversible layer: backward replays each call's random state, so it rebuilds the forward pass's
    activations and the gradients are the plain computation's (with fresh draws they would not be)."""
    from collab_kit.model.reversible import run_plain, run_reversible

    torch.manual_seed(0)
    linears = [torch.nn.Linear(8, 8) for _ in range(6)]
    dropout = torch.nn.Dropout(0.3).train()
    layers = [
        (lambda x, a=a: dropout(torch.tanh(a(x))), lambda x, b=b: dropout(torch.tanh(b(x))))
        for a, b in zip(linears[::2], linears[1::2])
    ]
    x1, x2 = (torch.randn(4, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    for linear in linears:
        linear.double()

    def run(how, seed):
        for linear in linears:
            linear.zero_grad()
        torch.manual_seed(seed)
        y1, y2 = how(x1, x2, layers)
        (y1.square().sum() + y2.sum()).backward()
        return (y1.detach(), y2.detach()), [linear.weight.grad.clone() for linear in linears]

    (plain_y, plain_grads), (rev_y, rev_grads) = run(run_plain, 1), run(run_reversible, 1)
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(plain_y, rev_y))
    assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(plain_grads, rev_grads))
    # another seed draws other masks: the gradients differ, so the equality above is the replay's doing
    _, other = run(run_plain, 2)
    assert not all(torch.allclose(a, b) for a, b in zip(other, plain_grads))
