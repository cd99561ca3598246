"""The code codec, caption tokens, parquet shards and the shuffled stream."""
import numpy as np
import pytest
import torch

from collab_kit.data import (COLORS, SHAPES, ByteCaptionTokenizer, ShardStream, batches, decode_codes, encode_codes,
                             list_shards, make_synthetic_shards, write_shard)


def test_codes_round_trip_through_brotli_and_compress():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 8192, size=(32, 32))
    codes[:16] = 7  # an image's codes repeat: Brotli should find that
    data = encode_codes(codes)
    decoded = decode_codes(data, expected_length=1024)
    assert decoded.dtype == np.int16 and np.array_equal(decoded, codes.ravel())
    assert len(data) < codes.size * 2  # smaller than the raw int16 codes


def test_codec_rejects_bad_input_with_clear_errors():
    with pytest.raises(ValueError, match="int16"):
        encode_codes(np.array([0, 40000]))
    with pytest.raises(ValueError, match="not valid Brotli"):
        decode_codes(b"not brotli at all")
    with pytest.raises(ValueError, match="another image size"):
        decode_codes(encode_codes(np.zeros(16, dtype=np.int16)), expected_length=64)


def test_byte_tokenizer_pads_cuts_and_round_trips():
    tokenizer = ByteCaptionTokenizer()
    ids = tokenizer.encode("a red cross", length=16)
    assert len(ids) == 16 and ids[11] == tokenizer.eos_token_id and ids[12:] == [tokenizer.pad_token_id] * 4
    assert tokenizer.decode(ids) == "a red cross"
    cut = tokenizer.encode("x" * 100, length=8)
    assert len(cut) == 8 and cut[-1] == tokenizer.eos_token_id
    assert max(tokenizer.encode("é", 4)) < tokenizer.vocab_size


def test_shard_stream_yields_every_sample_and_each_seed_its_own_order(tmp_path):
    captions = [f"caption {i}" for i in range(40)]
    codes = [np.full(16, i, dtype=np.int16) for i in range(40)]
    write_shard(str(tmp_path / "a.parquet"), captions[:20], codes[:20])
    write_shard(str(tmp_path / "b.parquet"), captions[20:], codes[20:])
    tokenizer = ByteCaptionTokenizer()

    def first_pass(seed):
        stream = iter(ShardStream(str(tmp_path), text_length=12, image_length=16, shuffle_buffer=8, seed=seed))
        return [next(stream) for _ in range(40)]

    samples = first_pass(seed=1)
    # each caption still travels with its own image
    for sample in samples:
        index = int(sample["image_codes"][0])
        assert tokenizer.decode(sample["text_tokens"].tolist()) == captions[index]
    # a buffered shuffle over an endless stream: the first 40 samples come from the data, in a shuffled order
    order = [int(s["image_codes"][0]) for s in samples]
    assert order != sorted(order) and len(set(order)) > 25
    other = [int(s["image_codes"][0]) for s in first_pass(seed=2)]
    assert other != order

    batch = next(batches(ShardStream(str(tmp_path), 12, 16, seed=0), batch_size=5))
    assert batch["text_tokens"].shape == (5, 12) and batch["image_codes"].shape == (5, 16)
    assert batch["image_codes"].dtype == torch.int64


def test_missing_shards_say_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="make_synthetic_shards"):
        list_shards(str(tmp_path / "nothing_here"))


def test_synthetic_images_follow_their_captions(tmp_path):
    paths = make_synthetic_shards(str(tmp_path), num_samples=64, image_side=8, codebook_size=256, num_shards=2)
    assert len(paths) == 2
    stream = iter(ShardStream(str(tmp_path), text_length=32, image_length=64, shuffle_buffer=1))
    tokenizer, band = ByteCaptionTokenizer(), 256 // len(COLORS)
    for _ in range(64):
        sample = next(stream)
        _, color, shape, _, background = tokenizer.decode(sample["text_tokens"].tolist()).split()
        assert shape in SHAPES
        bands = sample["image_codes"] // band
        # apart from a few noisy codes, every code is the shape's color or the background's
        expected = {COLORS.index(color), COLORS.index(background)}
        assert (sum(int(b) in expected for b in bands) / 64) > 0.8
