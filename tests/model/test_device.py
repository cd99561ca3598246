"""Where a peer trains and in what precision (collab_kit.model.device): chosen from the machine's facts, so that
every card can be tried here; loss scaling on the CPU as on a GPU."""

import pytest
import torch

from collab_kit.config import get_preset
from collab_kit.model.device import DeviceFacts, DeviceProblem, GpuFacts, LossScaler, choose_device
from collab_kit.model.transformer import TextToImageTransformer

GiB = 2**30
T4 = GpuFacts("Tesla T4", 15 * GiB, (7, 5))
P100 = GpuFacts("Tesla P100-PCIE-16GB", 16 * GiB, (6, 0))
A100 = GpuFacts("NVIDIA A100-SXM4-40GB", 40 * GiB, (8, 0))
H100 = GpuFacts("NVIDIA H100 80GB HBM3", 80 * GiB, (9, 0))


@pytest.mark.parametrize(
    "gpus, device, precision",
    [
        ((), "cpu", "fp32"),
        ((T4,), "cuda:0", "fp16"),
        ((P100,), "cuda:0", "fp16"),
        ((A100,), "cuda:0", "bf16"),
        ((H100,), "cuda:0", "bf16"),
    ],
    ids=["no GPU", "T4", "P100", "A100", "H100"],
)
def test_auto_chooses_the_device_and_the_precision_the_card_computes(gpus, device, precision):
    plan = choose_device("auto", "auto", DeviceFacts("12.4", gpus))
    assert (str(plan.device), plan.precision, plan.loss_scaling) == (device, precision, precision == "fp16")
    if gpus:
        assert plan.name == gpus[0].name and plan.memory_bytes == gpus[0].memory_bytes
        assert ("has no bf16" in plan.reason) == (precision == "fp16")


def test_a_device_or_precision_that_is_not_here_is_one_sentence():
    with pytest.raises(DeviceProblem, match="CPU-only build .* or use --device cpu"):
        choose_device("cuda", "auto", DeviceFacts(None))
    with pytest.raises(DeviceProblem, match="no CUDA GPU is visible .* or use --device cpu"):
        choose_device("cuda", "auto", DeviceFacts("12.4"))
    with pytest.raises(DeviceProblem, match="has 1 GPU"):
        choose_device("cuda:1", "auto", DeviceFacts("12.4", (T4,)))
    with pytest.raises(DeviceProblem, match="Tesla T4 .* has no bf16: use --precision fp16"):
        choose_device("cuda", "bf16", DeviceFacts("12.4", (T4,)))
    with pytest.raises(DeviceProblem, match="choose auto, cpu, cuda or cuda:N"):
        choose_device("tpu", "auto", DeviceFacts(None))
    with pytest.raises(DeviceProblem, match="--precision fp8"):
        choose_device("auto", "fp8", DeviceFacts(None))
    # asked for, a 16-bit precision runs on the CPU too (torch's CPU autocast)
    assert choose_device("cpu", "bf16", DeviceFacts(None)).autocast_dtype == torch.bfloat16
    assert choose_device("cpu", "fp16", DeviceFacts(None)).loss_scaling


@pytest.mark.parametrize(
    "precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]
)
def test_the_plan_computes_in_its_precision_and_scales_only_fp16(precision, dtype):
    torch.manual_seed(0)
    model = TextToImageTransformer(get_preset("tiny").model)
    plan = choose_device("cpu", precision, DeviceFacts(None))
    products = []
    linear = next(module for module in model.modules() if isinstance(module, torch.nn.Linear))
    linear.register_forward_hook(lambda module, inputs, output: products.append(output.dtype))
    batch = dict(text_tokens=torch.randint(0, 259, (2, 8)), image_codes=torch.randint(0, 32, (2, 16)))
    scaler = LossScaler(plan, model.parameters())
    with plan.autocast():
        loss = model(**plan.move(batch)).loss
    assert loss.dtype == torch.float32 and products[0] == dtype
    assert scaler.backward_and_unscale(loss)
    grads = [param.grad for param in model.parameters() if param.grad is not None]
    assert all(grad.dtype == torch.float32 and torch.isfinite(grad).all() for grad in grads)
    # the gradients the optimizer gets are the true ones, unscaled: those of an unscaled backward of the same loss,
    # within 16-bit rounding (its small values underflow fp16 without the scale: why fp16 scales at all)
    grads = [grad.clone() for grad in grads]
    model.zero_grad()
    with plan.autocast():
        loss_again = model(**batch).loss
    loss_again.backward()
    for unscaled, reference in zip(grads, [param.grad for param in model.parameters() if param.grad is not None]):
        assert (unscaled - reference).abs().max() <= 0.01 * reference.abs().max() + 1e-8
    assert scaler.scale == (2.0**16 if precision == "fp16" else 1.0)


def test_an_overflow_is_a_skipped_step_and_a_lower_scale_not_an_error():
    model = TextToImageTransformer(get_preset("tiny").model)
    plan = choose_device("cpu", "fp16", DeviceFacts(None))
    scaler = LossScaler(plan, model.parameters())
    batch = dict(text_tokens=torch.randint(0, 259, (2, 8)), image_codes=torch.randint(0, 32, (2, 16)))
    with plan.autocast():
        loss = model(**batch).loss
    loss.register_hook(lambda grad: grad * float("inf"))  # what an fp16 overflow leaves in the gradients
    assert scaler.backward_and_unscale(loss) is False
    assert scaler.overflows == 1 and scaler.scale == 2.0**15
    model.zero_grad()
    with plan.autocast():
        loss = model(**batch).loss
    assert scaler.backward_and_unscale(loss) and scaler.overflows == 1
