"""collab_kit.memory.estimate: parameter counts, byte-exact estimates against real optimizer steps, the activation
formula against what autograd saves, recommendations, the chart and the widget."""

import dataclasses
import math
import warnings

import pytest
import torch

from collab_kit import memory
from collab_kit.config import get_preset
from collab_kit.memory.catalogue import CATALOGUE, ModelShape
from collab_kit.memory.estimator import estimate
from collab_kit.memory.measured import gradient_bytes, optimizer_state_bytes, parameter_bytes
from collab_kit.memory.recommend import fit_to_device, recommend_settings
from collab_kit.model.device import DeviceFacts, GpuFacts, choose_device
from collab_kit.model.transformer import TextToImageTransformer, count_parameters

GiB = 2**30
# a tiny GPT-2: its biases and norms (64, 192, 256 elements) stay below bitsandbytes' min_8bit_size (4096),
# its matrices are at it (64 x 64 = 4096: 8-bit, the boundary) or above, and 12288 is not a multiple of 256 x 256
TINY_GPT2 = ModelShape(2, 64, 4, 256, 1000, 128, activation="gelu_new")


def tiny_gpt2(shape: ModelShape = TINY_GPT2, dropout: float = 0.1, attention: str = "sdpa"):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=shape.layers,
        n_embd=shape.hidden,
        n_head=shape.heads,
        n_inner=shape.ffn,
        vocab_size=shape.vocab,
        n_positions=shape.seq_len,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
        attn_implementation=attention,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def gpt2_step(model, make_optimizer):
    """One real training step; returns the optimizer (its state now allocated)."""
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer = make_optimizer(model.parameters())
    optimizer.step()
    return optimizer


def kit_step(model, make_optimizer):
    config = model.config
    text = torch.randint(0, config.text_vocab_size, (2, config.text_length))
    codes = torch.randint(0, config.codebook_size, (2, config.image_length))
    model(text, codes).loss.backward()
    optimizer = make_optimizer(model.parameters())
    optimizer.step()
    return optimizer


def adam8bit(params, **kwargs):
    import bitsandbytes as bnb

    return bnb.optim.Adam8bit(params, lr=1e-3, **kwargs)


def adafactor(params):
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=1e-3, relative_step=False, scale_parameter=False, beta1=None)


OPTIMIZERS = {"32bit": lambda params: torch.optim.Adam(params, lr=1e-3), "8bit": adam8bit, "factorized": adafactor}


def assert_states_exact(model, optimizer, name: str, **kwargs):
    guess = estimate(model, optimizer=name, **kwargs)
    assert (guess.weights_bytes, guess.gradients_bytes, guess.optimizer_bytes) == (
        parameter_bytes(model),
        gradient_bytes(model),
        optimizer_state_bytes(optimizer),
    )
    return guess


def test_gpt2_shapes_count_what_transformers_builds():
    from transformers import GPT2Config, GPT2LMHeadModel

    for shape in (ModelShape(2, 64, 4, 256, 1000, 128), ModelShape(3, 96, 3, 384, 777, 32)):
        config = GPT2Config(
            n_layer=shape.layers,
            n_embd=shape.hidden,
            n_head=shape.heads,
            n_inner=shape.ffn,
            vocab_size=shape.vocab,
            n_positions=shape.seq_len,
        )
        with torch.device("meta"):
            model = GPT2LMHeadModel(config)
        assert shape.parameters() == sum(p.numel() for p in model.parameters())  # tied output counted once
        # tensor by tensor, as bitsandbytes sees them
        assert sorted(math.prod(s) for s in shape.tensor_shapes()) == sorted(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "name, published",
    [
        ("gpt2-small", 124_439_808),
        ("gpt2-medium", 354_823_168),
        ("gpt2-large", 774_030_080),
        ("gpt2-xl", 1_557_611_200),  # the Hub checkpoints' exact counts
        ("gpt3-175b", 175.0e9),
        ("gpt3-13b", 13.0e9),
        ("gpt3-xl", 1.3e9),
        ("gpt-j-6b", 6.05e9),
        ("t5-3b", 2.85e9),
        ("t5-11b", 11.3e9),
        ("dalle-12b", 12.0e9),
        ("bert-large", 335e6),
    ],
)
def test_catalogue_sizes_match_the_published_ones(name, published):
    counted = CATALOGUE[name].parameters()
    if isinstance(published, int):
        assert counted == published
    else:  # papers round their sizes
        assert abs(counted - published) / published < 0.02, counted


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_tensor_shapes_add_up_and_sharing_keeps_k_blocks(name):
    shape = CATALOGUE[name]
    assert sum(math.prod(s) for s in shape.tensor_shapes()) == shape.parameters()
    one, two, three = (sum(math.prod(s) for s in shape.tensor_shapes(shared_groups=k)) for k in (1, 2, 3))
    assert 0 < two - one == three - two  # every distinct block (per stack) adds the same parameters
    per_stack = shape.layers // 2 if shape.kind == "encoder-decoder" else shape.layers
    unshared = sum(math.prod(s) for s in shape.tensor_shapes(shared_groups=per_stack))
    assert unshared == shape.parameters() == one + (per_stack - 1) * (two - one)


@pytest.mark.parametrize("optimizer", ["32bit", "8bit", "factorized"])
def test_estimate_equals_the_bytes_of_a_real_step_of_gpt2(optimizer):
    model = tiny_gpt2()
    sizes = [p.numel() for p in model.parameters()]
    assert min(sizes) < 4096 and 4096 in sizes and max(sizes) > 4096  # both sides of min_8bit_size, and at it
    state = gpt2_step(model, OPTIMIZERS[optimizer])
    guess = assert_states_exact(model, state, optimizer)
    # ... and the estimate of the same model from its shape, whatever the settings, is the same estimate
    for settings in (
        dict(),
        dict(checkpointing=False, micro_batch=3, seq_len=100),
        dict(precision="fp32", attention="eager", offload=True),
    ):
        by_module = dataclasses.replace(estimate(model, optimizer=optimizer, **settings), model="")
        by_shape = dataclasses.replace(estimate(TINY_GPT2, optimizer=optimizer, **settings), model="")
        assert by_module == by_shape
    assert guess.activations_bytes > 0 and guess.parameters == TINY_GPT2.parameters()


def test_8bit_state_follows_min_8bit_size_and_frozen_parameters_have_none():
    model = tiny_gpt2()
    model.transformer.wpe.weight.requires_grad_(False)  # frozen: weights, but no gradient, no state
    state = gpt2_step(model, lambda params: adam8bit([p for p in params if p.requires_grad], min_8bit_size=100))
    guess = assert_states_exact(model, state, "8bit", min_8bit_size=100)
    assert guess.trainable_parameters == guess.parameters - 128 * 64
    # the same tensors with the default threshold keep more 32-bit statistics
    assert estimate(model, optimizer="8bit").optimizer_bytes > guess.optimizer_bytes


def test_16bit_precision_and_optimizer_match_a_bf16_model():
    model = tiny_gpt2().to(torch.bfloat16)
    state = gpt2_step(model, OPTIMIZERS["32bit"])  # torch Adam keeps bf16 statistics for bf16 parameters
    guess = assert_states_exact(model, state, "16bit", precision="bf16")
    assert guess.weights_bytes == 2 * guess.parameters


@pytest.mark.parametrize("optimizer", ["32bit", "8bit"])
def test_estimate_of_the_kit_preset_equals_the_bytes_of_its_model(optimizer):
    config = get_preset("tiny")
    torch.manual_seed(0)
    model = TextToImageTransformer(config.model)
    state = kit_step(model, OPTIMIZERS[optimizer])
    assert_states_exact(model, state, optimizer)
    by_name, by_config = estimate("tiny", optimizer=optimizer), estimate(config, optimizer=optimizer, offload=False)
    assert by_name.parameters == by_config.parameters == count_parameters(model)
    assert by_name.optimizer_bytes == by_config.optimizer_bytes == optimizer_state_bytes(state)
    assert by_name.activations_bytes == by_config.activations_bytes == estimate(model).activations_bytes


def test_the_kits_8bit_lamb_keeps_the_8bit_adam_state():
    from collab_kit.swarm.lamb import make_lamb8bit, parameter_groups

    config = get_preset("tiny")
    model = TextToImageTransformer(config.model)
    state = kit_step(model, lambda _: make_lamb8bit(parameter_groups(model, 0.01), config.optimizer))
    assert estimate(config, optimizer="8bit").optimizer_bytes == optimizer_state_bytes(state)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("autocast", [False, True])
def test_activations_are_what_autograd_saves(attention, autocast):
    """Without dropout (on a CPU, dropout keeps float masks where CUDA keeps bytes, and fused attention falls back
    to the s x s computation), the forward pass saves what the per-layer formula counts."""
    shape = dataclasses.replace(TINY_GPT2, seq_len=96)
    model = tiny_gpt2(shape, dropout=0.0, attention=attention)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in parameters:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    batch, seq = 3, 96
    tokens = torch.randint(0, shape.vocab, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            output = model(input_ids=tokens, labels=tokens)
    measured = sum(saved.values()) + output.logits.untyped_storage().nbytes()
    guess = estimate(
        model,
        micro_batch=batch,
        seq_len=seq,
        checkpointing=False,
        attention=attention,
        precision="mixed" if autocast else "fp32",
    )
    # the estimate also counts the fp32 gradient of the log-probabilities that backward starts from
    expected = guess.activations_bytes - 4 * batch * seq * shape.vocab
    assert abs(measured - expected) / expected < 0.01, (measured, expected)
    if autocast:
        assert guess.weight_copies_bytes == 2 * sum(p.numel() for p in model.parameters() if p.ndim == 2)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_autocast_keeps_every_weight_copy_to_the_end_of_the_forward_pass(checkpointing):
    """Under bf16 autocast, with or without checkpointing, what is alive at the end of the forward pass (saved
    tensors, autocast's cache of 16-bit weight copies, the logits), the log-probabilities' gradient and one
    block's recompute add up to the estimate: benchmarks/memory_estimates.py's count, on a tiny GPT-2."""
    from benchmarks.memory_estimates import measure_activations

    shape = dataclasses.replace(TINY_GPT2, seq_len=96)
    model = tiny_gpt2(shape, dropout=0.0)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    measured = measure_activations(model, torch.randint(0, shape.vocab, (3, shape.seq_len)))
    guess = estimate(model, micro_batch=3, seq_len=shape.seq_len, checkpointing=checkpointing)
    # the cache holds every matrix's copy, not only the recomputed block's (the linear layers' biases are cast
    # too, the position table is not: a few % of this tiny model's copies)
    assert abs(measured["copies"] / guess.weight_copies_bytes - 1) < 0.05, (measured, guess.weight_copies_bytes)
    assert abs(measured["total"] / guess.activations_bytes - 1) < 0.03, (measured, guess.activations_bytes)
    assert (measured["recompute"] > 0) == checkpointing


def test_settings_move_the_parts_they_should():
    base = estimate("gpt2-large", optimizer="8bit", checkpointing=True, micro_batch=4)
    assert (
        estimate("gpt2-large", optimizer="32bit", checkpointing=True, micro_batch=4).optimizer_bytes
        > 3.5 * base.optimizer_bytes
    )
    assert estimate("gpt2-large", optimizer="factorized").optimizer_bytes < 0.05 * base.optimizer_bytes
    plain = estimate("gpt2-large", optimizer="8bit", checkpointing=False, micro_batch=4)
    assert plain.activations_bytes > 2 * base.activations_bytes
    assert plain.weights_bytes == base.weights_bytes and plain.optimizer_bytes == base.optimizer_bytes
    activations = [
        estimate("gpt2-large", checkpointing=c, micro_batch=b, seq_len=s).activations_bytes
        for c in (False, True)
        for b in (1, 2, 4)
        for s in (256, 1024)
    ]
    for c in (0, 6):  # grows with the micro-batch and the sequence
        assert activations[c + 0] < activations[c + 1] and activations[c + 0] < activations[c + 2] < activations[c + 4]
    assert estimate("gpt2-small", attention="eager").activations_bytes > estimate("gpt2-small").activations_bytes
    half = estimate("gpt2-large", precision="16bit")
    assert half.weights_bytes * 2 == base.weights_bytes and half.weight_copies_bytes == 0
    assert base.gpu_bytes == sum(base.parts().values()) and base.cpu_bytes == base.transfer_seconds == 0


def test_offload_moves_the_optimizer_and_a_master_copy_to_the_cpu():
    on_gpu = estimate("gpt2-large", optimizer="8bit")
    offloaded = estimate("gpt2-large", optimizer="8bit", offload=True)
    faster = estimate("gpt2-large", optimizer="8bit", offload=True, pcie_gb_per_s=24)
    assert offloaded.gpu_bytes == on_gpu.gpu_bytes - on_gpu.optimizer_bytes
    assert offloaded.cpu_bytes == on_gpu.optimizer_bytes + 8 * on_gpu.trainable_parameters
    assert offloaded.transfer_bytes == on_gpu.gradients_bytes + on_gpu.weights_bytes
    assert offloaded.transfer_seconds == pytest.approx(offloaded.transfer_bytes / 12e9)
    assert faster.transfer_seconds == pytest.approx(offloaded.transfer_seconds / 2)
    assert offloaded.parts()["optimizer state"] == 0
    # a RunConfig brings its own setting: the paper's run offloads
    assert estimate(get_preset("paper")).offload and not estimate("paper").offload


def test_shared_layers_shrink_the_states_not_the_activations():
    full = estimate("dalle-12b", shared_groups=None, checkpointing=False)
    shared = estimate("dalle-12b", shared_groups=5, checkpointing=False)
    one_block = estimate("dalle-12b", shared_groups=6).parameters - shared.parameters
    assert full.parameters - shared.parameters == (CATALOGUE["dalle-12b"].layers - 5) * one_block
    assert shared.parameters < full.parameters / 10  # the paper's DALL-E: 64 layers, a few distinct blocks
    assert shared.weights_bytes * full.parameters == full.weights_bytes * shared.parameters
    assert shared.optimizer_bytes < full.optimizer_bytes / 10
    assert shared.activations_bytes < full.activations_bytes  # only autocast's weight copies shrink
    assert shared.activations_bytes - shared.weight_copies_bytes == full.activations_bytes - full.weight_copies_bytes


def test_a_module_without_dimensions_gets_its_states_but_no_activations():
    model = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.ReLU(), torch.nn.Linear(50, 10))
    model(torch.randn(4, 100)).sum().backward()
    state = torch.optim.Adam(model.parameters())
    state.step()
    guess = assert_states_exact(model, state, "32bit")
    assert guess.activations_bytes == 0 and "activations not estimated" in guess.notes[0]
    assert "note:" in guess.table()


def test_recommendations_fit_and_grow_with_the_gpu():
    memories = [gib * GiB for gib in (8, 12, 16, 24, 40, 80)]
    for checkpointing in (True, False):  # with the choice made for it, the micro-batch grows with the GPU
        batches = []
        for gpu in memories:
            advice = recommend_settings("gpt2-large", gpu, checkpointing=checkpointing)
            assert advice.checkpointing is checkpointing
            if advice.fits:
                assert advice.estimate.gpu_bytes <= 0.85 * gpu, advice.reason
                if advice.micro_batch < 64:  # the largest that fits (64: max_micro_batch)
                    assert (
                        estimate(
                            "gpt2-large",
                            optimizer="8bit",
                            checkpointing=checkpointing,
                            micro_batch=advice.micro_batch + 1,
                        ).gpu_bytes
                        > 0.85 * gpu
                    )
            batches.append(advice.micro_batch if advice.fits else 0)
        assert batches == sorted(batches) and batches[-1] > batches[0], batches
    # choosing for itself: it fits from some size on, and stops checkpointing from some size on
    chosen = [recommend_settings("gpt2-large", gpu) for gpu in memories]
    fits = [advice.fits for advice in chosen]
    plain = [not advice.checkpointing for advice in chosen]
    assert fits == sorted(fits) and plain == sorted(plain) and fits[-1] and plain[-1] and not plain[0]
    for advice in chosen:
        assert str(advice) == advice.reason and (
            f"micro-batch {advice.micro_batch} " in advice.reason or not advice.fits
        )
    # without checkpointing as soon as that allows a micro-batch of 4 (a third faster than checkpointing)
    at_40 = recommend_settings("gpt2-large", 40 * GiB)
    assert not at_40.checkpointing and at_40.micro_batch >= memory.MIN_MICRO_BATCH_WITHOUT_CHECKPOINTING
    assert "checkpointing would allow" in at_40.reason
    at_16 = recommend_settings("gpt2-large", 16 * GiB)
    assert at_16.checkpointing and "without it, only" in at_16.reason
    # more headroom, a more frugal optimizer: never a smaller micro-batch
    for checkpointing in (True, False):
        assert (
            recommend_settings("gpt2-medium", 16 * GiB, headroom=0.95, checkpointing=checkpointing).micro_batch
            >= recommend_settings("gpt2-medium", 16 * GiB, headroom=0.7, checkpointing=checkpointing).micro_batch
        )
        assert (
            recommend_settings("gpt2-medium", 12 * GiB, optimizer="8bit", checkpointing=checkpointing).micro_batch
            >= recommend_settings("gpt2-medium", 12 * GiB, optimizer="32bit", checkpointing=checkpointing).micro_batch
        )


def test_a_gpu_too_small_gets_fits_false_and_what_to_do():
    # 10 GiB: with checkpointing, 32-bit Adam needs 13.7 GiB and the 8-bit one 9.4 (more than 85 %), offloading 7.9
    advice = recommend_settings("gpt2-large", 10 * GiB, optimizer="32bit")
    assert not advice.fits and advice.micro_batch == 1 and advice.checkpointing
    assert "does not fit" in advice.reason and "offload=True" in advice.reason and "smaller model" in advice.reason
    hopeless = recommend_settings("gpt3-175b", 16 * GiB)
    assert not hopeless.fits and "it would fit" not in hopeless.reason and "smaller model" in hopeless.reason


def test_recommendations_accept_a_run_config_and_a_preset():
    config = get_preset("small")
    advice = recommend_settings(config, 4 * GiB, max_micro_batch=32)
    assert advice.fits and advice.micro_batch == 32 and advice.estimate.model == "small preset"
    assert recommend_settings("small", 4 * GiB, max_micro_batch=32).micro_batch == 32


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: estimate("gpt2-large", optimizer="adam"), "choose one of 32bit, 16bit, 8bit, factorized"),
        (lambda: estimate("gpt2-large", micro_batch=0), "micro_batch=0"),
        (lambda: estimate("gpt2-large", micro_batch=1.5), "micro_batch=1.5"),
        (lambda: estimate("gpt-5"), "gpt2-large"),
        (lambda: estimate("gpt-5"), "tiny"),
        (lambda: estimate("gpt2-large", seq_len=2048), "at most 1024 tokens"),
        (lambda: estimate("tiny", seq_len=100), "always 24 tokens"),
        (lambda: estimate("tiny", shared_groups=2), "share_layer_groups"),
        (lambda: estimate("gpt2-large", shared_groups=37), "from 1 to the 36 layers"),
        (lambda: estimate("gpt2-large", precision="int4"), "precision='int4'"),
        (lambda: estimate("gpt2-large", attention="flash"), "attention='flash'"),
        (lambda: estimate("gpt2-large", pcie_gb_per_s=0), "pcie_gb_per_s"),
        (lambda: recommend_settings("gpt2-large", 0), "gpu_memory_bytes=0"),
        (lambda: recommend_settings("gpt2-large", GiB, headroom=1.5), "headroom=1.5"),
        (lambda: recommend_settings("gpt2-large", GiB, max_micro_batch=0), "max_micro_batch=0"),
        (lambda: recommend_settings("gpt2-large", GiB, optimizer="sgd"), "optimizer='sgd'"),
        (lambda: ModelShape(2, 64, 4, 256, 1000, 128, activation="swish"), "activation='swish'"),
    ],
)
def test_bad_arguments_say_what_is_allowed(call, message):
    with pytest.raises(ValueError) as error:
        call()
    assert message in str(error.value)


def test_a_model_of_an_unknown_type_is_refused():
    with pytest.raises(TypeError, match="expected a name"):
        estimate(12)


def test_the_table_and_the_chart():
    import matplotlib

    matplotlib.use("Agg")
    estimates = memory.compare("gpt2-large", micro_batch=2)
    assert list(estimates) == ["32-bit Adam", "8-bit Adam", "8-bit + checkpointing", "8-bit + checkpointing + offload"]
    sizes = [item.gpu_bytes for item in estimates.values()]
    assert sizes == sorted(sizes, reverse=True)  # every trick saves GPU memory
    table = estimates["8-bit + checkpointing + offload"].table()
    assert "gpt2-large: 8-bit Adam" in table and "PCIe per step" in table and "GiB" in table
    ax = memory.plot_estimates(estimates, gpu_memory_bytes=16 * GiB)
    assert len(ax.patches) == 4 * len(estimates)  # one stacked segment per part and bar
    top = max(p.get_y() + p.get_height() for p in ax.patches)
    assert top == pytest.approx(sizes[0] / GiB)
    assert any(line.get_ydata()[0] == 16 for line in ax.get_lines())  # the GPU's memory
    png = memory.figure_png(estimates, 16 * GiB)
    assert png.startswith(b"\x89PNG")
    import matplotlib.pyplot as plt

    plt.close("all")


def test_the_calculator_widget_follows_its_controls():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        calculator = memory.calculator_widget(model="gpt2-medium", micro_batch=2, gpu_memory_gib=16)
    first = calculator.estimate
    assert first == estimate("gpt2-medium", optimizer="8bit", micro_batch=2, checkpointing=True, seq_len=1024)
    assert bytes(calculator.chart.value).startswith(b"\x89PNG") and "gpt2-medium" in calculator.text.value
    calculator.micro_batch.value = 8
    assert calculator.estimate.micro_batch == 8 and calculator.estimate.activations_bytes > first.activations_bytes
    calculator.offload.value = True
    assert calculator.estimate.cpu_bytes > 0 and "PCIe" in calculator.text.value
    calculator.model.value = "tiny"  # a preset: its sequence is fixed and it shares layers its own way
    assert calculator.estimate.model == "tiny preset" and calculator.seq_len.disabled
    assert calculator.shared_groups.disabled and calculator.shared_groups.value == 0
    calculator.model.value = "dalle-12b"
    calculator.shared_groups.value = 5
    assert calculator.estimate.shared_groups == 5 and calculator.estimate.seq_len == 1280
    # the verdict follows the estimate and the GPU slider (16 GiB)
    assert ("do NOT fit" in calculator.text.value) == (calculator.estimate.gpu_bytes > 16 * GiB)
    calculator.gpu_memory_gib.value = 80
    assert ("do NOT fit" in calculator.text.value) == (calculator.estimate.gpu_bytes > 80 * GiB)
    with pytest.raises(ValueError, match="the calculator offers"):
        memory.calculator_widget(model="gpt-5")


def test_a_cpu_with_ram_to_spare_trains_without_reversible_layers():
    """On the CPU the preset's micro-batch stays, and reversible layers go where the RAM holds its activations without
    them (they cost a second forward pass); the paper's model at 12 GiB needs them and keeps them."""
    cpu = DeviceFacts(cuda_build=None, gpus=())
    toy = get_preset("toy")
    fit = fit_to_device(toy, choose_device("auto", "auto", cpu), cpu, 12 * GiB)
    applied = fit.apply(toy)
    assert fit.plan.device.type == "cpu" and fit.note is None
    assert toy.model.reversible and not applied.model.reversible
    assert applied.optimizer.batch_size_per_step == toy.optimizer.batch_size_per_step
    assert dataclasses.replace(applied.model, reversible=True) == toy.model  # nothing else of the model changed
    paper = get_preset("paper")
    fit = fit_to_device(paper, choose_device("auto", "auto", cpu), cpu, 12 * GiB)
    assert fit.recommendation.checkpointing and fit.apply(paper) is paper
    # RAM too short for the preset's micro-batch without them: reversible layers stay
    fit = fit_to_device(toy, choose_device("auto", "auto", cpu), cpu, 64 * 2**20)
    assert fit.apply(toy) is toy, fit.recommendation


def test_a_device_plan_takes_what_fits_its_gpu_and_gives_up_one_too_small():
    """collab_kit.memory.fit_to_device, as the preflight and ``Volunteer.from_config`` apply it."""
    config = get_preset("paper")
    t4 = DeviceFacts(cuda_build="12.4", gpus=(GpuFacts("Tesla T4", 15 * GiB, (7, 5)),))
    fit = fit_to_device(config, choose_device("auto", "auto", t4), t4, 12 * GiB)
    assert fit.note is None and fit.plan.device.type == "cuda" and fit.plan.precision == "fp16"
    assert fit.recommendation.fits and fit.recommendation.micro_batch >= 1
    applied = fit.apply(config)
    assert applied.optimizer.batch_size_per_step == fit.recommendation.micro_batch
    assert applied.model.reversible == fit.recommendation.checkpointing
    # on a T4 the paper's model fits with the kit's checkpointing only: its reversible layers stay on, under the
    # micro-batch estimated for them (estimated as the reversible model, the choice read "no checkpointing")
    assert applied.model.reversible and "with gradient checkpointing" in fit.recommendation.reason
    assert applied.optimizer.target_batch_size == config.optimizer.target_batch_size  # the run's settings stay
    small = DeviceFacts(cuda_build="12.4", gpus=(GpuFacts("Small GPU", GiB // 4, (8, 6)),))
    fallen = fit_to_device(config, choose_device("auto", "auto", small), small, 12 * GiB)
    assert fallen.plan.device.type == "cpu" and fallen.plan.precision == "fp32"
    assert fallen.note.startswith("the Small GPU's 256.00 MiB cannot hold this model (does not fit")
    assert fallen.apply(config) is config  # on the CPU the preset's micro-batch stays
    # a GPU asked for by name is kept: the user chose it
    kept = fit_to_device(config, choose_device("cuda", "auto", small), small, 12 * GiB, device_asked="cuda")
    assert kept.note is None and kept.plan.device.type == "cuda" and not kept.recommendation.fits
