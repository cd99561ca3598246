"""4-bit pseudo-gradients (collab_kit.swarm.four_bit): the codec through hivemind's own serialization, and error
feedback.

The real peers' rounds in 4 bits are in tests/swarm/test_local_updates.py.
"""

import pytest
import torch
from hivemind.compression import CompressionInfo, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.quantization import BlockwiseQuantization
from hivemind.proto import runtime_pb2

from collab_kit.swarm.four_bit import BLOCK_SIZE, LEVELS, Blockwise4BitQuantization, ErrorFeedback, round_4bit
from collab_kit.swarm.lamb import gradient_compression


def _pseudo_gradient(numel: int, seed: int) -> torch.Tensor:
    # values of a pseudo-gradient's size, a few large ones among them, as an embedding's rows make
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator) * 1e-3
    values[torch.randint(0, numel, (numel // 500,), generator=generator)] *= 30
    return values


def test_a_tensor_goes_in_4_bits_and_a_scale_per_block_and_comes_back_within_half_a_step():
    tensor = _pseudo_gradient(300_041, seed=0).view(-1, 7)  # a size no block divides: the last block is padded
    sent = serialize_torch_tensor(tensor, runtime_pb2.CompressionType.BLOCKWISE_8BIT)  # as a reducer returns a part
    back = deserialize_torch_tensor(sent)
    assert back.shape == tensor.shape and back.dtype == tensor.dtype
    # 4 bits a value and a bf16 scale per 64 values: 0.133 of fp32
    ratio = len(sent.buffer) / (4 * tensor.numel())
    assert ratio <= 0.14, ratio
    # each value within half a step (its block's largest magnitude / 7) of its own; bf16 scales round by 2^-8
    flat, back_flat = tensor.view(-1), back.view(-1)
    padded = torch.cat([flat, flat.new_zeros((-flat.numel()) % BLOCK_SIZE)]).view(-1, BLOCK_SIZE)
    half_step = (padded.abs().amax(dim=1, keepdim=True) / LEVELS / 2 * 1.01).expand_as(padded).reshape(-1)
    assert bool(((back_flat - flat).abs() <= half_step[: flat.numel()]).all())
    # what the codec sends is what round_4bit gives, and rounding that again changes nothing
    assert torch.equal(back, round_4bit(tensor)) and torch.equal(round_4bit(back), back)
    # the codec the optimizer uses sends large tensors this way, small ones in fp16
    compression = gradient_compression(threshold=2**16, bits=4)
    info = CompressionInfo.from_tensor(tensor)
    assert len(compression.compress(tensor, info).buffer) == len(sent.buffer)
    small = torch.randn(100)
    assert (
        compression.compress(small, CompressionInfo.from_tensor(small)).compression
        == runtime_pb2.CompressionType.FLOAT16
    )


def test_parts_of_hivemind_blockwise_8_bit_quantization_still_decode_under_the_shared_tag():
    tensor = _pseudo_gradient(2**13, seed=1)
    sent = BlockwiseQuantization().compress(tensor, CompressionInfo.from_tensor(tensor))
    assert sent.compression == Blockwise4BitQuantization.compression_type
    back = deserialize_torch_tensor(sent)
    assert (back - tensor).norm() < 0.05 * tensor.norm()  # 8 bits: 2% here, 4 bits 18%
    assert not torch.equal(back, round_4bit(tensor))


def test_4_bit_parts_of_hivemind_are_whole_blocks():
    """hivemind splits a tensor into parts of part_size_bytes over the estimated ratio: a whole number of blocks, so
    that a block is the same 64 values in the peer's rounding and in the averager's."""
    info = CompressionInfo.from_tensor(torch.zeros(10))
    values_per_part = int(2**19 / (4 * Blockwise4BitQuantization().estimate_compression_ratio(info)))
    assert values_per_part % BLOCK_SIZE == 0, values_per_part


def test_error_feedback_keeps_the_sum_of_what_is_sent_within_one_rounding_of_the_sum_of_the_pseudo_gradients():
    """Without it, each round's rounding adds up: a small steady gradient (an embedding row seldom seen) is rounded
    to zero beside the block's large values, round after round, and never arrives."""
    feedback = ErrorFeedback(threshold=1024)
    steady = torch.zeros(4096)
    steady[::64] = 1.0  # one large value per block
    steady[1::64] = 0.05  # a small value, under half a step (1/14) of its block: rounded to zero alone
    true_sum, sent_sum, plain_sum = torch.zeros(4096), torch.zeros(4096), torch.zeros(4096)
    small = torch.randn(100)  # a tensor under the threshold: sent in fp16, left as it is
    for round_ in range(40):
        pseudo = steady + _pseudo_gradient(4096, seed=round_) * 0.01
        true_sum += pseudo
        plain_sum += round_4bit(pseudo)
        sent = [pseudo.clone(), small.clone()]
        feedback.quantize_(sent)
        assert torch.equal(round_4bit(sent[0]), sent[0]) and torch.equal(sent[1], small)
        sent_sum += sent[0]
    step = 1.0 / LEVELS
    assert float((sent_sum - true_sum).abs().max()) <= step / 2 * 1.01
    # the small steady values: 40 x 0.05 = 2 arrive with feedback, nothing without it
    assert float((plain_sum - true_sum)[1::64].abs().min()) > 1.5
    feedback.reset()
    assert all(float(residual.abs().max()) == 0 for residual in feedback.residuals.values())


def test_only_floating_point_tensors_go_in_4_bits():
    with pytest.raises(ValueError, match="floating-point"):
        Blockwise4BitQuantization().compress(torch.arange(10), CompressionInfo.from_tensor(torch.zeros(10)))
