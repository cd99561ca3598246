"""The code codec, caption tokens, parquet shards and the shuffled stream."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from collab_kit.data.codec import bits_per_code, decode_codes, encode_codes
from collab_kit.data.shards import SHARD_FORMAT, list_shards, misfit_for_run, shard_metadata, write_shard
from collab_kit.data.stream import ShardStream, batches
from collab_kit.data.synthetic import CODE_COLORS as COLORS
from collab_kit.data.synthetic import CODE_SHAPES as SHAPES
from collab_kit.data.synthetic import make_synthetic_shards
from collab_kit.data.tokenizers import ByteCaptionTokenizer


def test_codes_round_trip_and_take_the_bits_the_codebook_needs():
    rng = np.random.default_rng(0)
    uniform = rng.integers(0, 8192, size=(32, 32))
    data = encode_codes(uniform, codebook_size=8192)
    decoded = decode_codes(data, expected_length=1024)
    assert decoded.dtype == np.int64 and np.array_equal(decoded, uniform.ravel())
    # random codes cannot be compressed: 13 bits each (1664 bytes) plus a 3-byte header
    assert bits_per_code(8192) == 13 and len(data) == 1664 + 3
    repetitive = uniform.copy()
    repetitive[:16] = 7  # an image's codes repeat: the codec finds that
    assert len(encode_codes(repetitive, 8192)) < 0.6 * len(data)
    assert np.array_equal(decode_codes(encode_codes(repetitive, 8192)), repetitive.ravel())
    for codebook_size in (2, 3, 32, 255, 256, 257, 2**16):
        codes = rng.integers(0, codebook_size, size=77)
        assert np.array_equal(decode_codes(encode_codes(codes, codebook_size)), codes), codebook_size


def test_codec_rejects_bad_input_with_clear_errors():
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 32\)"):
        encode_codes(np.array([0, 40]), codebook_size=32)
    with pytest.raises(ValueError, match="not in collab_kit's format"):
        decode_codes(b"\x00not codes at all")
    with pytest.raises(ValueError, match="not valid Brotli"):
        decode_codes(bytes([13 | 0x80, 4, 0]) + b"not brotli at all")
    with pytest.raises(ValueError, match="damaged"):
        decode_codes(encode_codes(np.arange(16), 16)[:-1])  # cut short
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


def test_a_shard_records_its_format_sizes_and_sources(tmp_path):
    import pyarrow.parquet as pq

    codes = [np.arange(16) % 32, np.full(16, 31)]
    path = write_shard(
        str(tmp_path / "s.parquet"),
        ["one", "two"],
        codes,
        codebook_size=32,
        image_side=4,
        sizes=[(640, 480), (100, 120)],
        source_ids=["a.jpg", "b.jpg"],
    )
    assert shard_metadata(path) == dict(format=2, codebook_size=32, image_side=4)
    table = pq.read_table(path)
    assert table.column_names == ["caption", "codes", "width", "height", "source_id"]
    assert table.column("width").to_pylist() == [640, 100] and table.column("source_id").to_pylist() == [
        "a.jpg",
        "b.jpg",
    ]
    assert np.array_equal(decode_codes(table.column("codes")[1].as_py(), 16), codes[1])
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError, match="one of each per sample"):
        write_shard(str(tmp_path / "t.parquet"), ["one"], codes)


def write_raw_shard(path, rows):
    """A shard with exactly these (caption, codes bytes, source id) rows, bad ones included."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from collab_kit.data.shards import SHARD_SCHEMA

    captions, codes, ids = zip(*rows)
    pq.write_table(
        pa.table(
            {
                "caption": list(captions),
                "codes": list(codes),
                "width": [0] * len(rows),
                "height": [0] * len(rows),
                "source_id": list(ids),
            },
            schema=SHARD_SCHEMA,
        ),
        path,
    )


def test_bad_samples_and_unreadable_shards_are_skipped_counted_and_training_goes_on(tmp_path, caplog):
    good = [(f"good {i}", encode_codes(np.full(16, i % 32), 32), f"good-{i}") for i in range(6)]
    bad = [
        ("bad brotli", bytes([5 | 0x80, 16, 0]) + b"garbage", "b1"),
        ("not our format", b"\x00\x01", "b2"),
        ("too few codes", encode_codes(np.zeros(9, dtype=np.int64), 32), "b3"),
        ("outside the codebook", encode_codes(np.full(16, 40), 64), "b4"),
        ("", encode_codes(np.zeros(16, dtype=np.int64), 32), "b5"),
        ("   ", encode_codes(np.zeros(16, dtype=np.int64), 32), "b6"),
        (None, encode_codes(np.zeros(16, dtype=np.int64), 32), "b7"),
    ]
    write_raw_shard(str(tmp_path / "a.parquet"), good[:3] + bad[:4])
    write_raw_shard(str(tmp_path / "b.parquet"), bad[4:] + good[3:])
    (tmp_path / "c.parquet").write_bytes(b"PAR1 this is not a parquet file")
    stream = ShardStream(str(tmp_path), text_length=8, image_length=16, codebook_size=32, shuffle_buffer=4, seed=0)
    samples = iter(stream)
    for _ in range(5):  # the stream goes on, pass after pass, with every good sample once per pass
        one_pass = [next(samples) for _ in range(6)]
        assert sorted(int(s["image_codes"][0]) for s in one_pass) == [0, 1, 2, 3, 4, 5]
    per_pass = {"invalid codes": 2, "wrong number of codes": 1, "codes outside the codebook": 1, "empty caption": 3}
    # rows are read ahead of the samples handed out: the last pass may be partly read
    for reason, count in per_pass.items():
        assert count * (stream.passes - 1) <= stream.skipped.counts[reason] <= count * stream.passes, reason
    assert stream.passes in (5, 6)
    assert [p.rsplit("/", 1)[-1] for p in stream.skipped.unreadable_shards] == ["c.parquet"]
    assert "c.parquet: unreadable" in caplog.text


def test_a_skip_reason_is_logged_at_most_once_per_n(tmp_path, caplog):
    rows = [("", encode_codes(np.zeros(16, dtype=np.int64), 32), f"e{i}") for i in range(7)]
    write_raw_shard(str(tmp_path / "a.parquet"), rows + [("fine", encode_codes(np.ones(16, dtype=np.int64), 32), "ok")])
    stream = ShardStream(str(tmp_path), 8, 16, codebook_size=32, shuffle_buffer=1, log_every=3)
    next(iter(stream))
    assert stream.skipped.counts["empty caption"] == 7
    assert caplog.text.count("empty caption") == 3  # the 1st, 3rd and 6th


def test_a_stream_with_nothing_usable_says_why(tmp_path):
    write_raw_shard(str(tmp_path / "a.parquet"), [("x", encode_codes(np.zeros(9, dtype=np.int64), 32), "s")])
    with pytest.raises(RuntimeError, match="no usable sample"):
        next(iter(ShardStream(str(tmp_path), 8, 16)))


def test_peers_with_different_identities_read_different_orders_and_passes_repeat(tmp_path):
    from collab_kit.data.stream import peer_data_seed

    make_synthetic_shards(str(tmp_path), num_samples=96, image_side=4, codebook_size=32, num_shards=4)

    def order(peer_id: bytes, count=40):
        stream = iter(ShardStream(str(tmp_path), 16, 16, shuffle_buffer=16, seed=peer_data_seed(peer_id, 0)))
        return [tuple(next(stream)["image_codes"].tolist()) for _ in range(count)]

    alice, bob = order(b"peer alice"), order(b"peer bob")
    assert alice != bob and sorted(alice[:24]) != sorted(bob[:24])  # not just shuffled within the same rows
    assert order(b"peer alice") == alice  # the same identity reads the same order again
    assert peer_data_seed(b"peer alice", 1) != peer_data_seed(b"peer alice", 0)
    # passes differ from each other, and a restart repeats them
    stream = iter(ShardStream(str(tmp_path), 16, 16, shuffle_buffer=16, seed=7))
    passes = [[tuple(next(stream)["image_codes"].tolist()) for _ in range(96)] for _ in range(2)]
    assert passes[0] != passes[1] and sorted(passes[0]) == sorted(passes[1])
    again = iter(ShardStream(str(tmp_path), 16, 16, shuffle_buffer=16, seed=7))
    assert [tuple(next(again)["image_codes"].tolist()) for _ in range(192)] == passes[0] + passes[1]


def test_synthetic_pictures_match_their_captions(tmp_path):
    import json

    from PIL import Image

    from collab_kit.data.synthetic import BACKGROUNDS, COLORS, dominant_color, make_synthetic_images, prompt_color

    folder = make_synthetic_images(str(tmp_path / "pictures"), num_samples=12, size=32, seed=3)
    entries = [json.loads(line) for line in open(tmp_path / "pictures" / "captions.jsonl")]
    assert len(entries) == 12 and sorted(e["file"] for e in entries) == sorted(
        p.name for p in (tmp_path / "pictures").glob("*.png")
    )
    for entry in entries:
        pixels = np.asarray(Image.open(f"{folder}/{entry['file']}"))
        assert pixels.shape == (32, 32, 3)
        colors = {tuple(p) for p in pixels.reshape(-1, 3)}
        color = prompt_color(entry["caption"])
        # flat colours, shrunk without blending: the caption's colour and one background, nothing else
        assert len(colors) == 2 and COLORS[color] in colors and colors - {COLORS[color]} <= set(BACKGROUNDS.values())
        assert dominant_color(pixels) == color, entry


def test_the_configured_caption_tokenizer(tmp_path):
    from collab_kit.config import get_preset
    from collab_kit.data.tokenizers import ToyTokenizer, caption_tokenizer

    assert get_preset("paper").data.tokenizer == "t5-small" and get_preset("small").data.tokenizer == "bytes"
    assert isinstance(caption_tokenizer("bytes"), ByteCaptionTokenizer)
    toy = caption_tokenizer("toy")
    assert isinstance(toy, ToyTokenizer) and toy.decode(toy.encode("a small red circle", 8)) == "a small red circle"
    # a Hugging Face tokenizer that is neither cached nor reachable (the tests run offline): a clear error
    with pytest.raises(ValueError, match="use 'bytes', 'toy' or a Hugging Face tokenizer"):
        caption_tokenizer("someone/no-such-tokenizer")


def test_shards_of_another_codebook_grid_tokenizer_or_format_do_not_fit_a_run(tmp_path):
    codes = [np.arange(16, dtype=np.int16) % 8]

    def shard(name, **recorded):
        path = str(tmp_path / name / "shard.parquet")
        write_shard(path, ["a red cross"], codes, **recorded)
        return [path]

    run = dict(codebook_size=32, image_side=4, tokenizer="bytes")
    assert misfit_for_run(shard("fits", codebook_size=32, image_side=4), **run) is None
    assert misfit_for_run(shard("any_tokenizer", codebook_size=32, image_side=4, tokenizer="bytes"), **run) is None
    assert misfit_for_run(shard("other_tool"), **run) is None  # nothing recorded: the stream checks each sample
    smaller = misfit_for_run(shard("smaller", codebook_size=16, image_side=4), **run)
    assert "a codebook of 16" in smaller and "a codebook of 32" in smaller  # another VQGAN, though its codes fit
    assert "a codebook of 64" in misfit_for_run(shard("larger", codebook_size=64, image_side=4), **run)
    assert "8x8 codes" in misfit_for_run(shard("grid", codebook_size=32, image_side=8), **run)
    toy = misfit_for_run(shard("toy", codebook_size=32, image_side=4, tokenizer="toy"), **run)
    assert "written for the 'toy' tokenizer" in toy and "'bytes'" in toy
    newer = shard("newer", codebook_size=32, image_side=4)
    table = pq.read_table(newer[0])
    metadata = {b"collab_kit": json.dumps(dict(format=SHARD_FORMAT + 1, codebook_size=32, image_side=4)).encode()}
    pq.write_table(table.replace_schema_metadata(metadata), newer[0])
    assert "upgrade collab_kit" in misfit_for_run(newer, **run)
