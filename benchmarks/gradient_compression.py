"""Bytes of one gradient-averaging round: the kit's size-adaptive compression over fp32 (target <= 0.26).

Real gradients of the ``small`` preset are cut into parts and serialized exactly as hivemind's
all-reduce does (``hivemind.averaging.partition.TensorPartContainer``, which calls
``compression.compress(part, CompressionInfo)`` for each part), once with
``collab_kit.swarm.lamb.gradient_compression`` and once with ``hivemind.compression.NoCompression``; the
figure is the ratio of the summed ``ByteSize()`` of the protobufs.
"""

from __future__ import annotations

import asyncio
import sys
import warnings
from collections.abc import Sequence

import torch

from benchmarks import common

TITLE = "Gradient averaging bytes: size-adaptive compression / fp32"
HOW = """
Real gradients: the `small` preset's model (seed 0) computes the loss on one batch of 16 synthetic
samples (`collab_kit.data.synthetic.make_synthetic_shards` + `ShardStream`) and `loss.backward()`. Every
gradient tensor goes through `hivemind.averaging.partition.TensorPartContainer`, the class hivemind's
all-reduce uses to cut tensors into parts of up to 512 KiB (after compression) and serialize each
part with `compression.compress(part, CompressionInfo)` (a `SizeAdaptiveCompression` decides from
`CompressionInfo.descriptor.numel()` of the whole tensor, so `serialize_torch_tensor`, which takes
only a fixed compression type, cannot express it). The figure is the summed `ByteSize()` of the
serialized parts with `collab_kit.swarm.lamb.gradient_compression(config.optimizer.compression_threshold)`
(tensors of 2^16 elements or more in 8 bits, others in fp16) over the same with `NoCompression()`
(fp32). In a group of n peers each peer sends (n-1)/n of these parts and receives as many back, in
the same encoding, so the ratio is that of the whole round. The compressed parts are also decoded
with `hivemind.compression.deserialize_torch_tensor`, as a receiving peer does: the details give the
worst relative error, or the error decoding raised (it did with numpy 2.4, which hivemind 1.1.12's
8-bit codec does not support; pyproject pins numpy<2.4).

The paper preset's model (125 M stored parameters, 1.1 B of compute at 1280 positions) is too slow to
back-propagate on this CPU; its row serializes, for every parameter shape of the model built on the meta device, a
tensor of
that shape filled with normal noise. The byte counts of these encodings depend only on the number
of elements, not on the values, so this row is exact for sizes but uses no real gradients.
"""


def serialize_parts(tensor: torch.Tensor, compression) -> list:
    """``tensor`` serialized the way hivemind's all-reduce sends it: a list of runtime_pb2.Tensor parts."""
    from hivemind.averaging.partition import TensorPartContainer
    from hivemind.compression import CompressionInfo

    async def serialize() -> list:
        container = TensorPartContainer(
            [tensor],
            peer_fractions=[1.0],
            compression=compression,
            tensor_infos=[CompressionInfo.from_tensor(tensor, key=0)],
        )
        return [part async for part in container.iterate_input_parts_for(0)]

    with warnings.catch_warnings():  # torch deprecates quantize_per_tensor, which hivemind's 8-bit codec calls
        warnings.simplefilter("ignore", UserWarning)
        return asyncio.run(serialize())


def decoding_error(tensor: torch.Tensor, parts: Sequence) -> float:
    """Relative L2 error of ``tensor`` decoded from ``parts`` with hivemind's deserializer (what peers receive)."""
    from hivemind.compression import deserialize_torch_tensor

    decoded = torch.cat([deserialize_torch_tensor(part).flatten() for part in parts])
    return float((decoded - tensor.flatten()).norm() / tensor.norm().clamp_min(1e-30))


def round_bytes(
    tensors: Sequence[torch.Tensor],
    threshold: int,
    check_decoding: bool = True,
    names: Sequence[str] | None = None,
    bits: int = 8,
) -> dict[str, object]:
    """Serialized bytes of ``tensors`` with the kit's compression and with none, and how many went 8-bit.

    :param check_decoding: also decode the compressed parts, as a receiving peer does, and report the
      largest relative error (or the error that decoding raised)
    :param names: the tensors' names, to say which one decoded worst
    :param bits: the bits of the large tensors' values (8, or 4 for pseudo-gradients: collab_kit.swarm.four_bit)
    """
    from hivemind.compression import NoCompression

    from collab_kit.swarm.lamb import gradient_compression

    compressed, fp32, parts, eight_bit_elements = 0, 0, 0, 0
    worst_error, worst_name, decode_failure = 0.0, None, None
    names = list(names) if names is not None else [f"tensor {i}" for i in range(len(tensors))]
    for name, tensor in zip(names, tensors):
        serialized = serialize_parts(tensor, gradient_compression(threshold, bits))
        compressed, parts = compressed + sum(part.ByteSize() for part in serialized), parts + len(serialized)
        fp32 += sum(part.ByteSize() for part in serialize_parts(tensor, NoCompression()))
        eight_bit_elements += tensor.numel() if tensor.numel() >= threshold else 0
        if check_decoding and decode_failure is None:
            try:
                error = decoding_error(tensor, serialized)
                if error >= worst_error:
                    worst_error, worst_name = error, name
            except Exception as e:  # a codec that cannot decode what it sent is a finding, not a crash
                decode_failure = f"{type(e).__name__}: {e}"
    elements = sum(t.numel() for t in tensors)
    return dict(
        compressed=compressed,
        fp32=fp32,
        parts=parts,
        elements=elements,
        eight_bit_share=eight_bit_elements / elements,
        ratio=compressed / fp32,
        worst_error=worst_error,
        worst_name=worst_name,
        decode_failure=decode_failure,
    )


def real_gradients(preset: str = "small", batch_size: int = 16) -> tuple[list[str], list[torch.Tensor]]:
    """Names and gradients of the preset's model (seed 0) parameters on one batch of synthetic samples."""
    from collab_kit.config import get_preset
    from collab_kit.model.transformer import TextToImageTransformer

    config = get_preset(preset)
    batch = common.synthetic_batches(config, batch_size, count=1)[0]
    torch.manual_seed(0)
    model = TextToImageTransformer(config.model)
    model(**batch).loss.backward()
    names, params = zip(*model.named_parameters())
    return list(names), [param.grad for param in params]


def parameter_shapes(preset: str = "paper") -> list[torch.Size]:
    """The shape of every parameter of the preset's model, built on the meta device (no memory for it)."""
    from collab_kit.config import get_preset
    from collab_kit.model.transformer import TextToImageTransformer

    with torch.device("meta"):
        model = TextToImageTransformer(get_preset(preset).model)
    return [param.shape for param in model.parameters()]


def paper_round_bytes(threshold: int) -> dict[str, float]:
    """round_bytes for the paper preset's shapes, serializing one tensor per distinct shape."""
    shapes = parameter_shapes("paper")
    per_shape: dict[torch.Size, dict[str, float]] = {}
    generator = torch.Generator().manual_seed(0)
    for shape in set(shapes):
        per_shape[shape] = round_bytes(
            [torch.randn(shape, generator=generator) * 1e-3], threshold, check_decoding=False
        )
    total = {key: sum(per_shape[shape][key] for shape in shapes) for key in ("compressed", "fp32", "parts", "elements")}
    total["eight_bit_share"] = (
        sum(per_shape[s]["eight_bit_share"] * per_shape[s]["elements"] for s in shapes) / total["elements"]
    )
    total["ratio"] = total["compressed"] / total["fp32"]
    return total


def _details(result: dict[str, object], what: str) -> str:
    text = (
        f"{what}: {common.fmt_bytes(result['compressed'])} compressed vs {common.fmt_bytes(result['fp32'])} fp32 "
        f"for {result['elements'] / 1e6:.2f} M gradient values in {int(result['parts'])} parts; "
        f"{result['eight_bit_share']:.1%} of the values are in tensors sent as 8 bits."
    )
    if result.get("decode_failure"):
        text += (
            f" WARNING: hivemind could not decode the compressed parts ({result['decode_failure']}), "
            f"so peers would fail to average these gradients."
        )
    elif "decode_failure" in result and result.get("worst_error") is not None:
        text += (
            f" Decoded by hivemind as a receiving peer does: relative L2 error up to {result['worst_error']:.3f} "
            f"per tensor (worst: {result['worst_name']})."
        )
    return text


def run(quick: bool = False) -> list[dict]:
    from collab_kit.config import get_preset

    module = __spec__.name
    threshold = get_preset("small").optimizer.compression_threshold
    names, gradients = real_gradients("small")
    small = round_bytes(gradients, threshold, names=names)
    note = "but hivemind cannot decode these parts, see below" if small["decode_failure"] else ""
    rows = [
        common.make_row(
            module,
            "gradient round bytes, adaptive / fp32 (small preset, real gradients)",
            small["ratio"],
            "<= 0.26",
            f"{small['ratio']:.3f}",
            _details(small, "small preset"),
            note=note,
        )
    ]
    if small["decode_failure"]:
        print(f"  WARNING: hivemind cannot decode the compressed gradients: {small['decode_failure']}", flush=True)
    print(f"  small preset: {small['ratio']:.4f}", flush=True)
    if not quick:
        paper_threshold = get_preset("paper").optimizer.compression_threshold
        paper = paper_round_bytes(paper_threshold)
        rows.append(
            common.make_row(
                module,
                "gradient round bytes, adaptive / fp32 (paper preset, shapes only)",
                paper["ratio"],
                "<= 0.26",
                f"{paper['ratio']:.3f}",
                _details(paper, "paper preset, noise tensors of the model's shapes"),
            )
        )
        print(f"  paper preset (shapes): {paper['ratio']:.4f}", flush=True)
    return rows


if __name__ == "__main__":
    common.main(sys.modules[__name__])
