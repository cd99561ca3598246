"""Shards from a dataset someone else published: whatever they hold, the stream never stops.

A shard that does not fit (columns of the wrong type, another codebook or image size, not parquet at all) is skipped
whole and counted under its reason; a sample that does not decode (decompression bombs included) is skipped and
counted; every good sample comes out once per pass with its own codes.
"""

import functools
import json
import subprocess
import sys

import brotli
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collab_kit.data.codec import InvalidCodesError, decode_codes, encode_codes
from collab_kit.data.shards import SHARD_FORMAT, SHARD_SCHEMA, write_shard
from collab_kit.data.stream import ShardStream
from collab_kit.data.tokenizers import ByteCaptionTokenizer

IMAGE_LENGTH, CODEBOOK, TEXT_LENGTH = 16, 32, 12
LARGEST_PAYLOAD = (2**16 - 1) * 16 // 8  # 65,535 codes of 16 bits: the largest record the codec writes


@functools.cache
def zeros_compressed(size: int, window_bits: int = 24) -> bytes:
    """``size`` zero bytes (a multiple of 16 MiB), Brotli-compressed: 1 GiB takes 809 bytes with a 16 MiB window."""
    compressor, chunk = brotli.Compressor(quality=5, lgwin=window_bits), bytes(16 << 20)
    return b"".join(compressor.process(chunk) for _ in range(size // len(chunk))) + compressor.finish()


def bomb(expanded_bytes: int, bits: int = 5, count: int = IMAGE_LENGTH, window_bits: int = 24) -> bytes:
    """A record whose header announces ``count`` codes of ``bits`` bits and whose Brotli payload expands to
    ``expanded_bytes`` zeros, declaring a window of 2 ** ``window_bits`` bytes (22 is what records use: such a bomb
    meets the bounded decompressor; 24 is refused from its window alone)."""
    return bytes([bits | 0x80]) + count.to_bytes(2, "little") + zeros_compressed(expanded_bytes, window_bits)


def good_codes(i: int) -> np.ndarray:
    return (np.arange(IMAGE_LENGTH) * 7 + i) % CODEBOOK


def write_table(path, columns: dict, schema=None, metadata=None):
    table = pa.table(columns, schema=schema)
    if metadata is not None:
        table = table.replace_schema_metadata({b"collab_kit": metadata})
    pq.write_table(table, path)


class FussyTokenizer(ByteCaptionTokenizer):
    """A tokenizer that fails on some text, as real ones do on input they were not made for."""

    def encode(self, caption, length):
        if "boom" in caption:
            raise RuntimeError("this tokenizer cannot take 'boom'")
        if "short" in caption:
            return [5, 6]  # fewer ids than asked
        return super().encode(caption, length)


@pytest.fixture(scope="module")
def hostile_shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    good = {f"good-{i}": (f"picture {i}", good_codes(i)) for i in range(10)}
    # good samples, in a shard written by the kit and in one written by another tool (no collab_kit metadata)
    write_shard(
        str(folder / "kit.parquet"),
        [good[f"good-{i}"][0] for i in range(5)],
        [good[f"good-{i}"][1] for i in range(5)],
        codebook_size=CODEBOOK,
        image_side=4,
        source_ids=[f"good-{i}" for i in range(5)],
    )
    bad_rows = [  # (caption, codes, source id, the reason it is skipped for)
        ("bomb 256 MiB", bomb(256 << 20, window_bits=22), "bomb-256m", "invalid codes"),
        ("bomb 1 GiB", bomb(1 << 30), "bomb-1g", "invalid codes"),
        ("bomb, 16-bit header", bomb(1 << 30, bits=16, count=2**16 - 1, window_bits=22), "bomb-max", "invalid codes"),
        (
            "more than announced",
            bytes([5 | 0x80, IMAGE_LENGTH, 0]) + brotli.compress(bytes(11)),
            "long",
            "invalid codes",
        ),
        (
            "cut short",
            encode_codes(np.zeros(IMAGE_LENGTH, dtype=np.int64), CODEBOOK)[:-3],
            "short-record",
            "invalid codes",
        ),
        ("not brotli", bytes([5 | 0x80, IMAGE_LENGTH, 0]) + b"\xff" * 40, "not-brotli", "invalid codes"),
        ("no header", b"\x00", "no-header", "invalid codes"),
        ("nothing", b"", "empty-codes", "invalid codes"),
        ("null codes", None, "null-codes", "invalid codes"),
        ("nine codes", encode_codes(np.zeros(9, dtype=np.int64), CODEBOOK), "nine", "wrong number of codes"),
        ("too large a code", encode_codes(np.full(IMAGE_LENGTH, 40), 64), "outside", "codes outside the codebook"),
        (None, encode_codes(good_codes(0), CODEBOOK), "null-caption", "empty caption"),
        ("  ", encode_codes(good_codes(0), CODEBOOK), "blank-caption", "empty caption"),
        ("boom", encode_codes(good_codes(0), CODEBOOK), "tokenizer-raises", "invalid caption"),
        ("short", encode_codes(good_codes(0), CODEBOOK), "tokenizer-short", "invalid caption"),
    ]
    rows = [(caption, encode_codes(codes, CODEBOOK), source) for source, (caption, codes) in good.items()][5:]
    rows += [(caption, codes, source) for caption, codes, source, _ in bad_rows]
    captions, codes, sources = zip(*rows)
    # a caption that is not UTF-8, as a string column can hold when written without checks
    caption_array = pa.array(
        [c.encode() if c is not None else None for c in captions] + [b"\xff\xfe caption"], pa.binary()
    ).view(pa.string())
    write_table(
        str(folder / "other_tool.parquet"),
        {
            "caption": caption_array,
            "codes": pa.array(list(codes) + [encode_codes(good_codes(0), CODEBOOK)], pa.binary()),
            "source_id": list(sources) + ["not-utf8"],
        },
    )
    sample_reasons = {source: reason for _, _, source, reason in bad_rows}
    sample_reasons["not-utf8"] = "invalid caption"
    # shards skipped whole
    n = 3
    record = [encode_codes(good_codes(0), CODEBOOK)] * n
    write_table(str(folder / "codes_as_strings.parquet"), {"caption": ["a"] * n, "codes": ["0 1 2"] * n})
    write_table(str(folder / "codes_as_integers.parquet"), {"caption": ["a"] * n, "codes": [7] * n})
    write_table(str(folder / "captions_as_integers.parquet"), {"caption": [1] * n, "codes": record})
    write_table(str(folder / "captions_as_bytes.parquet"), {"caption": [b"a"] * n, "codes": record})
    write_table(str(folder / "no_codes.parquet"), {"caption": ["a"] * n, "image": record})
    write_table(
        str(folder / "source_ids_as_lists.parquet"), {"caption": ["a"] * n, "codes": record, "source_id": [[1]] * n}
    )
    kit_columns = {"caption": ["a"] * n, "codes": record, "width": [0] * n, "height": [0] * n, "source_id": ["x"] * n}
    write_table(
        str(folder / "larger_codebook.parquet"),
        kit_columns,
        SHARD_SCHEMA,
        json.dumps(dict(format=SHARD_FORMAT, codebook_size=8192, image_side=4)).encode(),
    )
    write_table(
        str(folder / "other_grid.parquet"),
        kit_columns,
        SHARD_SCHEMA,
        json.dumps(dict(format=SHARD_FORMAT, codebook_size=CODEBOOK, image_side=32)).encode(),
    )
    write_table(
        str(folder / "newer_format.parquet"),
        kit_columns,
        SHARD_SCHEMA,
        json.dumps(dict(format=SHARD_FORMAT + 1, codebook_size=CODEBOOK, image_side=4)).encode(),
    )
    write_table(str(folder / "garbled_metadata.parquet"), kit_columns, SHARD_SCHEMA, b"{not json")
    write_table(
        str(folder / "metadata_of_strings.parquet"),
        kit_columns,
        SHARD_SCHEMA,
        json.dumps(dict(format="2", codebook_size="lots")).encode(),
    )
    (folder / "not_parquet.parquet").write_bytes(b"PAR1 this is not a parquet file PAR1")
    whole = (folder / "kit.parquet").read_bytes()
    (folder / "truncated.parquet").write_bytes(whole[: len(whole) // 2])
    shard_reasons = {
        "codes_as_strings": "wrong columns",
        "codes_as_integers": "wrong columns",
        "captions_as_integers": "wrong columns",
        "captions_as_bytes": "wrong columns",
        "no_codes": "wrong columns",
        "source_ids_as_lists": "wrong columns",
        "larger_codebook": "other codebook",
        "other_grid": "other image size",
        "newer_format": "newer format",
        "garbled_metadata": "unreadable metadata",
        "metadata_of_strings": "unreadable metadata",
        "not_parquet": "unreadable",
        "truncated": "unreadable",
    }
    return folder, good, sample_reasons, shard_reasons


def count_by(values):
    counts = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


def test_hostile_shards_and_samples_are_skipped_and_counted_and_every_good_sample_comes_once_per_pass(
    hostile_shards, caplog
):
    folder, good, sample_reasons, shard_reasons = hostile_shards
    tokenizer = FussyTokenizer()
    stream = ShardStream(
        str(folder),
        text_length=TEXT_LENGTH,
        image_length=IMAGE_LENGTH,
        tokenizer=tokenizer,
        codebook_size=CODEBOOK,
        shuffle_buffer=8,
        seed=3,
    )
    expected = sorted((tokenizer.encode(caption, TEXT_LENGTH), codes.tolist()) for caption, codes in good.values())
    for passes in (1, 2):
        samples = list(stream.one_pass())  # never raises, whatever the shards hold
        got = sorted((sample["text_tokens"].tolist(), sample["image_codes"].tolist()) for sample in samples)
        assert got == expected  # each good sample once, with its own caption and codes
        # each bad sample counted once per pass, under its reason
        per_pass = count_by(sample_reasons.values())
        assert {reason: count for reason, count in stream.skipped.counts.items() if count} == {
            reason: count * passes for reason, count in per_pass.items()
        }
    # each bad shard skipped whole, counted once under its reason, and named once in the log
    assert {
        path.rsplit("/", 1)[-1][: -len(".parquet")]: reason for path, reason in stream.skipped.shards.items()
    } == shard_reasons
    assert stream.skipped.shard_counts == count_by(shard_reasons.values())
    for name in shard_reasons:
        assert caplog.text.count(f"{name}.parquet: ") == 1, name
    assert "larger_codebook.parquet: other codebook (its codes come from a codebook of 8192" in caplog.text


def test_training_batches_flow_past_hostile_shards(hostile_shards):
    folder, good, _, _ = hostile_shards
    stream = ShardStream(
        str(folder),
        text_length=TEXT_LENGTH,
        image_length=IMAGE_LENGTH,
        tokenizer=FussyTokenizer(),
        codebook_size=CODEBOOK,
        shuffle_buffer=4,
        seed=0,
    )
    samples = iter(stream)
    seen = [tuple(next(samples)["image_codes"].tolist()) for _ in range(3 * len(good))]  # three passes, endless
    assert count_by(seen) == {tuple(codes.tolist()): 3 for _, codes in good.values()}


# decodes records in a fresh process and prints, for each, the growth of its resident memory's peak (Linux: writing
# 5 to /proc/self/clear_refs resets the peak to the current size) and the error
MEMORY_CHECK = """
import json, sys
from collab_kit.data.codec import decode_codes, encode_codes
import numpy as np

def rss(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))

decode_codes(encode_codes(np.arange(1000) % 300, 300))  # the codec's own first-call costs, once
for path in sys.argv[1:]:
    record = open(path, "rb").read()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = rss("VmRSS")
    try:
        decode_codes(record)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    print(json.dumps(dict(path=path, growth=rss("VmHWM") - before, error=error)))
"""


def test_a_decompression_bomb_is_refused_in_bounded_memory(tmp_path):
    cases = {
        "window 4 MiB, 256 MiB of zeros": (bomb(256 << 20, window_bits=22), "more than the 10 bytes"),
        "window 4 MiB, 1 GiB of zeros": (bomb(1 << 30, window_bits=22), "more than the 10 bytes"),
        "window 16 MiB, 1 GiB of zeros": (bomb(1 << 30), "Brotli window of 16777216 bytes"),
        "the largest header, 1 GiB": (
            bomb(1 << 30, bits=16, count=2**16 - 1, window_bits=22),
            f"more than the {LARGEST_PAYLOAD} bytes",
        ),
    }
    paths = []
    for index, (record, _) in enumerate(cases.values()):
        assert len(record) < 2000
        paths.append(str(tmp_path / f"bomb-{index}"))
        with open(paths[-1], "wb") as f:
            f.write(record)
    outcomes = []
    for path in paths:  # a process each: memory one bomb freed, and the allocator kept, would hide the next one's
        result = subprocess.run([sys.executable, "-c", MEMORY_CHECK, path], capture_output=True, text=True, timeout=120)
        if result.returncode != 0 and "clear_refs" in result.stderr:
            pytest.skip(f"this kernel does not let a process reset its peak memory: {result.stderr[-300:]}")
        assert result.returncode == 0, result.stderr[-2000:]
        outcomes.append(json.loads(result.stdout.splitlines()[-1]))
    for (what, (_, message)), outcome in zip(cases.items(), outcomes):
        assert outcome["error"] and outcome["error"].startswith("InvalidCodesError") and message in outcome["error"], (
            what,
            outcome,
        )
        assert outcome["growth"] < 10 * 10**6, (what, outcome)  # plain Brotli: 256 MiB and 1 GiB


def test_the_codec_round_trips_the_largest_record():
    codes = np.random.default_rng(0).integers(0, 2**16, size=2**16 - 1)
    assert np.array_equal(decode_codes(encode_codes(codes, 2**16)), codes)


# -- the codec, fuzzed: only its documented error ------------------------------------------------------------


def valid_records():
    return st.builds(
        lambda codebook, values: encode_codes(np.array(values, dtype=np.int64) % codebook, codebook),
        st.sampled_from([2, 3, 32, 255, 8192, 2**16]),
        st.lists(st.integers(0, 2**16 - 1), max_size=300),
    )


@st.composite
def mutated_records(draw):
    record = bytearray(draw(valid_records()))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "header", "brotli"]))
        if kind == "flip" and record:
            index = draw(st.integers(0, len(record) - 1))
            record[index] ^= 1 << draw(st.integers(0, 7))
        elif kind == "cut":
            record = record[: draw(st.integers(0, len(record)))]
        elif kind == "insert":
            index = draw(st.integers(0, len(record)))
            record[index:index] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "header" and len(record) >= 3:
            record[:3] = draw(st.binary(min_size=3, max_size=3))
        elif kind == "brotli" and len(record) >= 3:  # a payload that is Brotli of anything
            record[0] |= 0x80
            record[3:] = brotli.compress(draw(st.binary(max_size=2000)), quality=1)
    return bytes(record)


def decode_or_refuse(record):
    try:
        codes = decode_codes(record)
    except InvalidCodesError as e:
        assert str(e)  # says what is wrong
        return
    # what decodes is a record of the codec: as many codes as its header says, each within its bits
    bits = record[0] & 0x7F
    assert codes.dtype == np.int64 and codes.size == int.from_bytes(record[1:3], "little")
    assert codes.size == 0 or (codes.min() >= 0 and codes.max() < 2**bits)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_fuzz_random_bytes_raise_only_the_codecs_error(record):
    decode_or_refuse(record)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_records())
def test_fuzz_mutated_records_raise_only_the_codecs_error(record):
    decode_or_refuse(record)


@settings(max_examples=100, deadline=None)
@given(valid_records())
def test_fuzz_valid_records_round_trip(record):
    codes = decode_codes(record)
    assert decode_codes(encode_codes(codes, 2**16)).tolist() == codes.tolist()


@pytest.mark.parametrize("value", ["codes as text", 12345, 1.5, ["a"], None])
def test_codes_of_the_wrong_type_raise_the_codecs_error(value):
    with pytest.raises(InvalidCodesError):
        decode_codes(value)
