"""Pseudo-gradients in 4 bits: blockwise quantization with a scale per block, and error feedback.

    compression = gradient_compression(2 ** 16, bits=4)   # collab_kit.swarm.lamb: 4 bits for large tensors
    feedback = ErrorFeedback(threshold=2 ** 16)
    feedback.quantize_(pseudo_gradients)                  # each on the 4-bit grid, what it dropped kept for next time

A block of 64 values travels as 64 integers in [-7, 7] (two to a byte) and one bf16 scale: 0.53 bytes a value.
Each peer keeps what rounding drops (``ErrorFeedback``) and adds it to its next pseudo-gradient, so what it sends
sums to within one rounding of its pseudo-gradients (tests/swarm/test_four_bit.py).

hivemind's CompressionType enum cannot be extended: 4-bit parts travel under the blockwise 8-bit tag (which the kit
never sends otherwise), with a ``dtype`` starting with ``MARKER``; the codec ``install`` registers decodes both.
A reducer's whole rounded average goes under ``AVERAGE_MARKER`` (collab_kit.swarm.runners). Blocks align with
hivemind's parts (2^20 values a part), so peer and averager round the same 64 values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from hivemind.compression import CompressionBase, CompressionInfo, serialization
from hivemind.compression.quantization import BlockwiseQuantization
from hivemind.proto import runtime_pb2

BLOCK_SIZE = 64  # values per scale
LEVELS = 7  # a value travels as an integer in [-LEVELS, LEVELS] times its block's scale
MARKER = "collab_kit.4bit:"  # how a 4-bit part's dtype starts (the rest: the tensor's own dtype)
# how a reducer's reply starts that holds the part's rounded average itself, not the average minus the sender's part
AVERAGE_MARKER = "collab_kit.4bit-average:"


def _rounded_codes(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor``'s bf16 scales (one per block of BLOCK_SIZE values) and its codes, as floats in [-LEVELS, LEVELS]."""
    flat = tensor.detach().reshape(-1).float()
    padding = (-flat.numel()) % BLOCK_SIZE
    if padding:
        flat = torch.cat([flat, flat.new_zeros(padding)])
    blocks = flat.view(-1, BLOCK_SIZE)
    scales = (blocks.abs().amax(dim=1) / LEVELS).to(torch.bfloat16)
    divisors = scales.float().clamp_min(torch.finfo(torch.float32).tiny)[:, None]  # an all-zero block stays zeros
    return scales, (blocks / divisors).round_().clamp_(-LEVELS, LEVELS)


def quantize_4bit(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor``'s values as (bf16 scales, one per block of BLOCK_SIZE; uint8 bytes, two 4-bit codes each)."""
    scales, codes = _rounded_codes(tensor)
    codes = codes.add_(8).to(torch.uint8).view(-1)
    return scales, codes[0::2] | (codes[1::2] << 4)


def dequantize_4bit(scales: torch.Tensor, packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The float32 values (flat, ``numel`` of them) that ``quantize_4bit`` gave ``scales`` and ``packed`` for."""
    codes = torch.empty(2 * packed.numel(), dtype=torch.uint8)
    codes[0::2], codes[1::2] = packed & 15, packed >> 4
    return codes.view(-1, BLOCK_SIZE).float().sub_(8).mul_(scales.float()[:, None]).view(-1)[:numel]


def round_4bit(tensor: torch.Tensor) -> torch.Tensor:
    """What ``tensor`` becomes after a trip in 4 bits (``dequantize_4bit`` of ``quantize_4bit``, without the packing).
    Rounding it again changes nothing (its blocks' scales come out the same), which keeps error feedback exact."""
    scales, codes = _rounded_codes(tensor)
    return codes.mul_(scales.float()[:, None]).view(-1)[: tensor.numel()].view(tensor.shape).to(tensor.dtype)


class Blockwise4BitQuantization(CompressionBase):
    """hivemind's codec interface for 4-bit parts (see the module's docstring for the tag they travel under); decodes
    hivemind's blockwise 8-bit parts too."""

    compression_type = runtime_pb2.CompressionType.BLOCKWISE_8BIT

    def __init__(self):
        self._blockwise_8bit = BlockwiseQuantization()

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        if not torch.is_floating_point(tensor):
            raise ValueError(f"4-bit quantization takes floating-point tensors, not {tensor.dtype}")
        scales, packed = quantize_4bit(tensor)
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=scales.view(torch.int16).numpy().tobytes() + packed.numpy().tobytes(),
            size=tensor.shape,
            dtype=MARKER + str(tensor.dtype).replace("torch.", ""),
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        marker = next((m for m in (MARKER, AVERAGE_MARKER) if serialized_tensor.dtype.startswith(m)), None)
        if marker is None:
            return self._blockwise_8bit.extract(serialized_tensor)
        shape = tuple(serialized_tensor.size)
        numel = math.prod(shape)
        scale_bytes = 2 * math.ceil(numel / BLOCK_SIZE)
        buffer = bytearray(serialized_tensor.buffer)
        scales = torch.frombuffer(buffer, dtype=torch.int16, count=scale_bytes // 2).view(torch.bfloat16)
        packed = torch.frombuffer(buffer, dtype=torch.uint8, offset=scale_bytes)
        dtype = getattr(torch, serialized_tensor.dtype[len(marker) :])
        values = dequantize_4bit(scales, packed, numel).view(shape).to(dtype)
        # read by collab_kit.swarm.runners.SharedFourBitAverageMixin; torch's stubs declare no such attribute
        values.is_whole_average = marker == AVERAGE_MARKER  # type: ignore[attr-defined]
        return values.requires_grad_(serialized_tensor.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 4 / torch.finfo(info.descriptor.dtype).bits


_CODEC = Blockwise4BitQuantization()  # the one this process registers for the tag (``install``) and replies with


def serialize_average(average: torch.Tensor) -> runtime_pb2.Tensor:
    """A reducer's reply for a part that travels in 4 bits: the part's average itself, already on the 4-bit grid (so
    sent exactly), which the sender turns into a difference with the part it sent."""
    message = _CODEC.compress(average, CompressionInfo.from_tensor(average))
    message.dtype = AVERAGE_MARKER + message.dtype[len(MARKER) :]
    return message


def is_whole_average(part: torch.Tensor) -> bool:
    """Whether a decoded reply is a part's whole average (``serialize_average``) rather than a difference."""
    return getattr(part, "is_whole_average", False)


def sends_4_bits(compression, info: CompressionInfo) -> bool:
    """Whether ``compression`` (hivemind's, or one that chooses by the tensor, like SizeAdaptiveCompression) sends the
    tensor ``info`` describes in 4 bits."""
    chosen = compression.choose_compression(info) if hasattr(compression, "choose_compression") else compression
    return isinstance(chosen, Blockwise4BitQuantization)


def install() -> None:
    """Register the 4-bit codec for its tag in hivemind's table of decoders (this process and those it forks later),
    so that this peer decodes 4-bit parts."""
    if not isinstance(serialization._BASE_COMPRESSION_TYPES.get("BLOCKWISE_8BIT"), Blockwise4BitQuantization):
        serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] = _CODEC


install()


class ErrorFeedback:
    """Error feedback for 4-bit pseudo-gradients: each tensor of ``threshold`` elements or more gets what rounding
    dropped from it last time and is rounded to the 4-bit grid here, so the averager's rounding changes nothing.

    :param threshold: the size from which tensors travel in 4 bits (OptimizerConfig.compression_threshold)
    """

    def __init__(self, threshold: int):
        self.threshold = threshold
        self.residuals: dict[int, torch.Tensor] = {}  # by the tensor's index: what its last rounding dropped

    @torch.no_grad()
    def quantize_(self, tensors: Sequence[torch.Tensor], sent: Sequence[int] | None = None) -> None:
        """Add each large tensor's residual to it, round it to the 4-bit grid in place, and keep the new residual.

        :param sent: the indices of the tensors this round sends (fragments); None: all
        """
        for index, tensor in enumerate(tensors):
            if tensor.numel() < self.threshold or (sent is not None and index not in sent):
                continue
            residual = self.residuals.get(index)
            if residual is None:
                residual = self.residuals[index] = torch.zeros_like(tensor)
            tensor.add_(residual)
            rounded = round_4bit(tensor)
            residual.copy_(tensor).sub_(rounded)
            tensor.copy_(rounded)

    def reset(self) -> None:
        """Forget what was dropped (the peer takes the swarm's parameters instead of its own)."""
        for residual in self.residuals.values():
            residual.zero_()
