"""Training samples: the code codec, caption tokens, and a stream of batches from parquet shards.

A shard row holds ``caption`` (a string) and ``codes`` (the image's VQGAN codes as little-endian
int16, compressed with Brotli; the paper streams these instead of images, about 18x fewer bytes).
Every peer reads the shards in its own shuffled order, so peers contribute different samples.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import zlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import brotli
import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from huggingface_hub import HfFileSystem

logger = logging.getLogger(__name__)

MAX_CODEBOOK_SIZE = 2 ** 16  # a code is stored in at most 16 bits
MAX_CODES_PER_IMAGE = 2 ** 16 - 1  # the count is stored in 16 bits
_BROTLI_FLAG = 0x80  # header bit: the payload is Brotli-compressed
# the largest Brotli window a record may declare: brotli.compress's default, which the kit's first shards used. The
# decoder allocates the window (4 MiB here) before it writes a byte; a stream declaring 16 MiB (lgwin 24) would cost
# that much memory even when the output is cut at a few bytes
MAX_BROTLI_WINDOW_BITS = 22


# ---------------------------------------------------------------------------------------------
# the code codec: integer codes <-> a few bytes
#
# One image's codes are stored as ``[header: 1 byte][count: uint16 LE][payload]``. The header's low
# bits give the bits per code b; the payload packs every code in b bits (little-endian bit order),
# Brotli-compressed when that is smaller. A codebook of 8192 needs 13 bits: 1024 codes take 1664
# bytes however random they are, where int16 + Brotli takes about 1775. Codes of a trained tokenizer
# repeat patterns that byte-aligned int16 shows Brotli better, so the encoder also tries that (b = 16)
# and keeps the smallest form.


def bits_per_code(codebook_size: int) -> int:
    """The bits one code needs: 13 for a codebook of 8192."""
    if not 2 <= codebook_size <= MAX_CODEBOOK_SIZE:
        raise ValueError(f"codebook_size={codebook_size} is not allowed: expected 2 .. {MAX_CODEBOOK_SIZE}")
    return int(codebook_size - 1).bit_length()


def _pack(codes: np.ndarray, bits: int) -> bytes:
    if bits == 16:
        return codes.astype("<u2").tobytes()
    bit_matrix = (codes.astype(np.uint32)[:, None] >> np.arange(bits, dtype=np.uint32)) & 1
    return np.packbits(bit_matrix.astype(np.uint8).ravel(), bitorder="little").tobytes()


def _unpack(payload: bytes, bits: int, count: int) -> np.ndarray:
    if len(payload) != (count * bits + 7) // 8:
        raise ValueError(f"holds {len(payload)} bytes of codes where its header says {count} codes of {bits} bits")
    if bits == 16:
        codes = np.frombuffer(payload, dtype="<u2")
    else:
        flat = np.unpackbits(np.frombuffer(payload, dtype=np.uint8), count=count * bits, bitorder="little")
        codes = flat.reshape(count, bits).astype(np.uint32) @ (1 << np.arange(bits, dtype=np.uint32))
    return codes.astype(np.int64)


def encode_codes(codes: np.ndarray, codebook_size: Optional[int] = None, quality: int = 11) -> bytes:
    """Store one image's codes in as few bytes as this codec can.

    :param codes: integers in [0, codebook_size), any shape (stored flat, in C order)
    :param codebook_size: the tokenizer's codebook (8192 in the paper); default: just enough for the largest code
    :param quality: Brotli's effort, 0..11
    """
    codes = np.asarray(codes).ravel()
    if codes.size > MAX_CODES_PER_IMAGE:
        raise ValueError(f"an image of {codes.size} codes is too large: at most {MAX_CODES_PER_IMAGE}")
    largest = int(codes.max()) if codes.size else 0
    if codebook_size is None:
        codebook_size = max(2, largest + 1)
    if codes.size and (codes.min() < 0 or largest >= codebook_size):
        raise ValueError(f"codes must lie in [0, {codebook_size}) (the codebook), got values in "
                         f"[{codes.min()}, {largest}]")
    header_count = codes.size.to_bytes(2, "little")
    candidates = []
    for bits in sorted({bits_per_code(codebook_size), 16}):
        packed = _pack(codes, bits)
        candidates.append(bytes([bits]) + header_count + packed)
        # a window just large enough for the payload: what the decoder must allocate to read it
        window = min(MAX_BROTLI_WINDOW_BITS, max(10, len(packed).bit_length()))
        candidates.append(bytes([bits | _BROTLI_FLAG]) + header_count +
                          brotli.compress(packed, quality=quality, lgwin=window))
    return min(candidates, key=len)


class InvalidCodesError(ValueError):
    """A sample's stored codes cannot be decoded: the only error ``decode_codes`` raises, whatever the bytes."""


def _brotli_window_bits(payload: bytes) -> Optional[int]:
    """The window a Brotli stream declares in its first bits (RFC 7932, 9.1); None for the large-window extension or
    a reserved value."""
    if not payload:
        return None
    bits = payload[0] | (payload[1] << 8 if len(payload) > 1 else 0)
    if bits & 1 == 0:
        return 16
    if (bits >> 1) & 7:
        return 17 + ((bits >> 1) & 7)
    value = (bits >> 4) & 7
    if value == 1:
        return None
    return 8 + value if value else 17


def _decompress_bounded(payload: bytes, size: int) -> bytes:
    """Brotli-decompress ``payload``, which must hold exactly ``size`` bytes, in memory and time bounded by ``size``.

    A record of a few hundred bytes can expand to gigabytes (a decompression bomb): its window is checked first
    (the decoder's memory), and the decompressor is never let past ``size``, so such a record costs at most what a
    legal one does before it is refused.
    """
    window = _brotli_window_bits(payload)
    if window is None or window > MAX_BROTLI_WINDOW_BITS:
        raise InvalidCodesError(f"a sample's codes declare a Brotli window of "
                                f"{'an unknown size' if window is None else f'{2 ** window} bytes'}, more than a "
                                f"record of at most 131,070 bytes needs (at most {2 ** MAX_BROTLI_WINDOW_BITS}): "
                                f"refused (a damaged record, or a decompression bomb)")
    decompressor = brotli.Decompressor()
    try:
        # the output buffer stops growing at the limit (brotli rounds it up to its next block, some 32 KiB)
        data = decompressor.process(payload, output_buffer_limit=size + 1)
    except brotli.error as e:
        raise InvalidCodesError(f"a sample's codes are not valid Brotli data ({e}): the shard is corrupt") from None
    if len(data) > size or not decompressor.can_accept_more_data():
        raise InvalidCodesError(f"a sample's codes decompress to more than the {size} bytes its header announces "
                                f"(a damaged record, or a decompression bomb): refused")
    if not decompressor.is_finished():
        raise InvalidCodesError(f"a sample's codes are cut short: {len(data)} of the {size} bytes its header "
                                f"announces, and the Brotli stream does not end")
    return data


def decode_codes(data: bytes, expected_length: Optional[int] = None) -> np.ndarray:
    """The codes ``encode_codes`` stored, as a flat int64 array.

    Any bytes at all can be given: what is not a valid record raises InvalidCodesError (a ValueError), in time and
    memory bounded by the largest legal record (65,535 codes of 16 bits: 131,070 bytes of payload).

    :param expected_length: if given, raise InvalidCodesError when the sample holds another number of codes
    :raises InvalidCodesError: the bytes are not a record of this codec, or not the expected number of codes
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidCodesError(f"a sample's codes are a {type(data).__name__}, not bytes: the shard's codes "
                                f"column must be binary (written by collab_kit.data.write_shard)")
    data = bytes(data)
    if len(data) < 3 or not 1 <= (data[0] & ~_BROTLI_FLAG) <= 16:
        raise InvalidCodesError("a sample's codes are not in collab_kit's format (a header of bits per code and a "
                                "count): the shard is corrupt or was written by something else")
    bits, count, payload = data[0] & ~_BROTLI_FLAG, int.from_bytes(data[1:3], "little"), data[3:]
    if expected_length is not None and count != expected_length:
        raise InvalidCodesError(f"a sample holds {count} image codes but the model expects {expected_length}: "
                                f"the shards were made for another image size")
    size = (count * bits + 7) // 8
    if data[0] & _BROTLI_FLAG:
        payload = _decompress_bounded(payload, size)
    try:
        return _unpack(payload, bits, count)
    except ValueError as e:
        raise InvalidCodesError(f"a sample's codes are damaged: it {e}") from None


# ---------------------------------------------------------------------------------------------
# caption tokens


class ByteCaptionTokenizer:
    """Captions as UTF-8 bytes: a tokenizer that needs no download, for the CPU presets.

    Ids: 0 = pad, 1 = end of caption, 2 = unused, 3 + byte for every byte. The paper preset uses
    t5-small's tokenizer instead (32,100 tokens), which must be downloaded.
    """

    pad_token_id, eos_token_id, offset = 0, 1, 3
    vocab_size = 256 + offset

    def encode(self, caption: str, length: int) -> List[int]:
        ids = [b + self.offset for b in caption.encode("utf-8")][: length - 1] + [self.eos_token_id]
        return ids + [self.pad_token_id] * (length - len(ids))

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i - self.offset for i in ids if i >= self.offset)
        return data.decode("utf-8", errors="replace")


class PretrainedCaptionTokenizer:
    """A Hugging Face tokenizer (t5-small in the paper) behind ``encode(caption, length)``, padded with ``pad_token_id``.

    The paper pads with eos (pad = eos = 1 for t5-small), so the model sees one token for "nothing more".
    """

    def __init__(self, name: str, pad_token_id: Optional[int] = None):
        from transformers import AutoTokenizer

        self.name = name
        self.tokenizer = AutoTokenizer.from_pretrained(name)
        self.pad_token_id = pad_token_id if pad_token_id is not None else self.tokenizer.pad_token_id
        self.vocab_size = len(self.tokenizer)

    def encode(self, caption: str, length: int) -> List[int]:
        ids = list(self.tokenizer(caption, truncation=True, max_length=length)["input_ids"])
        return ids + [self.pad_token_id] * (length - len(ids))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i != self.pad_token_id], skip_special_tokens=True)


def caption_tokenizer(name: str, pad_token_id: Optional[int] = None):
    """The caption tokenizer a configuration names (``config.data.tokenizer``).

    :param name: "bytes" (ByteCaptionTokenizer), "toy" (collab_kit.toy.ToyTokenizer) or a Hugging Face
      tokenizer name or folder ("t5-small" in the paper; downloaded once)
    :param pad_token_id: the model's pad id, for Hugging Face tokenizers
    """
    if name == "bytes":
        return ByteCaptionTokenizer()
    if name == "toy":
        from collab_kit.toy import ToyTokenizer

        return ToyTokenizer()
    try:
        return PretrainedCaptionTokenizer(name, pad_token_id)
    except OSError as e:
        raise ValueError(f"data.tokenizer={name!r} could not be loaded ({e}); use 'bytes', 'toy' or a Hugging Face "
                         f"tokenizer name or folder") from None


# ---------------------------------------------------------------------------------------------
# shards


SHARD_FORMAT = 2  # 2: codes in the bit-packed codec above, with width / height / source_id columns
SHARD_SCHEMA = pa.schema([
    ("caption", pa.string()),
    ("codes", pa.binary()),  # encode_codes(...) of the image's codes, raster order
    ("width", pa.int32()),  # the original image's size, before resizing and cropping (0 if unknown)
    ("height", pa.int32()),
    ("source_id", pa.string()),  # where the sample came from (file name, dataset row, ...)
])


def write_shard(path: str, captions: Sequence[str], codes: Sequence[np.ndarray], *,
                codebook_size: Optional[int] = None, sizes: Optional[Sequence[Tuple[int, int]]] = None,
                source_ids: Optional[Sequence[str]] = None, image_side: Optional[int] = None) -> str:
    """Write one parquet shard; returns the path. The file appears whole or not at all.

    :param captions: one caption per sample
    :param codes: one array of image codes per sample
    :param codebook_size: the tokenizer's codebook, recorded in the file and used to pack the codes
    :param sizes: (width, height) of each original image (default: unknown, 0)
    :param source_ids: where each sample came from (default: its row number in this shard)
    :param image_side: the code grid's side, recorded in the file
    """
    count = len(captions)
    sizes = sizes if sizes is not None else [(0, 0)] * count
    source_ids = source_ids if source_ids is not None else [str(i) for i in range(count)]
    if not len(codes) == len(sizes) == len(source_ids) == count:
        raise ValueError(f"got {count} captions, {len(codes)} code arrays, {len(sizes)} sizes and "
                         f"{len(source_ids)} source ids: expected one of each per sample")
    metadata = dict(format=SHARD_FORMAT, codebook_size=codebook_size, image_side=image_side)
    schema = SHARD_SCHEMA.with_metadata({b"collab_kit": json.dumps(metadata).encode()})
    table = pa.table({"caption": list(captions), "codes": [encode_codes(c, codebook_size) for c in codes],
                      "width": [int(w) for w, _ in sizes], "height": [int(h) for _, h in sizes],
                      "source_id": [str(i) for i in source_ids]}, schema=schema)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp_path = path + ".tmp"
    # the codes are compressed already and unique: no compression, dictionary or min / max statistics for them
    # (those would cost ~9 bytes per sample); captions and the rest compress well with zstd
    small_columns = ["caption", "width", "height", "source_id"]
    pq.write_table(table, tmp_path, compression=dict(caption="zstd", codes="none", width="zstd", height="zstd",
                                                     source_id="zstd"),
                   use_dictionary=small_columns, write_statistics=small_columns)
    os.replace(tmp_path, path)  # a crash never leaves a half-written shard under the real name
    return path


def shard_metadata(path: str) -> dict:
    """What ``write_shard`` recorded in a shard: format, codebook_size, image_side (None where not recorded)."""
    raw = (pq.read_schema(path).metadata or {}).get(b"collab_kit")
    return json.loads(raw) if raw else {}


def is_hub_dataset(source: str) -> bool:
    """``user/name`` (or ``hf://datasets/user/name``) that is not a local path: a Hub dataset repository."""
    if source.startswith("hf://datasets/"):
        return True
    return (source.count("/") == 1 and not os.path.exists(source) and not source.startswith((".", "/", "~"))
            and not any(char in source for char in "*?[]"))


def list_shards(shards: str) -> List[str]:
    """The parquet files of a local folder, a glob, or a Hub dataset repository (``hf://`` paths), sorted."""
    if is_hub_dataset(shards):
        repo = shards[len("hf://datasets/"):] if shards.startswith("hf://") else shards
        try:
            paths = sorted("hf://" + path for path in HfFileSystem().glob(f"datasets/{repo}/**/*.parquet"))
        except FileNotFoundError:
            paths = []
        where = f"the Hub dataset {repo!r}"
    elif os.path.isdir(shards):
        paths = sorted(glob.glob(os.path.join(shards, "**", "*.parquet"), recursive=True))
        where = f"the folder {shards!r}"
    else:
        paths = sorted(glob.glob(shards, recursive=True))
        where = f"{shards!r}"
    if not paths:
        raise FileNotFoundError(f"no parquet shards found in {where}: pass a folder of .parquet files, a glob, or a "
                                f"Hub dataset id (user/name); `collab-kit preprocess` makes shards from images, and "
                                f"collab_kit.data.make_synthetic_shards makes a demo dataset")
    return paths


def peer_data_seed(peer_id: bytes, seed: int = 0) -> int:
    """The order in which one peer reads the data: derived from its identity, so peers read different samples.

    :param peer_id: the peer's identity (``dht.peer_id.to_bytes()``)
    :param seed: the run's data seed (``config.data.seed``), shifting every peer's order at once
    """
    return (zlib.crc32(peer_id) + seed) % 2 ** 32


class SkippedSamples:
    """What a stream skipped: samples by reason, and shards by reason (each shard named once in the log).

    Samples are counted each time a pass meets them; a shard that does not fit is counted once.
    """

    REASONS = ("invalid codes", "wrong number of codes", "codes outside the codebook", "empty caption",
               "invalid caption")

    def __init__(self, log_every: int = 1000):
        self.counts: Dict[str, int] = {reason: 0 for reason in self.REASONS}
        self.shards: Dict[str, str] = {}  # path -> why it was skipped whole
        self.log_every = log_every

    def add(self, reason: str, source: str, detail: str) -> None:
        self.counts[reason] += 1
        count = self.counts[reason]
        if count == 1 or count % self.log_every == 0:
            logger.warning(f"skipped sample {source} ({reason}: {detail}); {count} skipped for this reason so far")

    def shard_skipped(self, path: str, reason: str, detail: str) -> None:
        """A shard that cannot be read, or whose columns or metadata do not fit the model: skipped whole."""
        if path not in self.shards:
            self.shards[path] = reason
            logger.error(f"skipping shard {path}: {reason} ({detail})")

    def shard_failed(self, path: str, error: Exception) -> None:
        self.shard_skipped(path, "unreadable", f"{type(error).__name__}: {error}")

    @property
    def unreadable_shards(self) -> List[str]:
        """Every shard skipped whole, whatever the reason."""
        return list(self.shards)

    @property
    def shard_counts(self) -> Dict[str, int]:
        """Shards skipped whole, by reason."""
        counts: Dict[str, int] = {}
        for reason in self.shards.values():
            counts[reason] = counts.get(reason, 0) + 1
        return counts

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def shard_misfit(schema: pa.Schema, image_length: Optional[int] = None,
                 codebook_size: Optional[int] = None) -> Optional[Tuple[str, str]]:
    """Why a shard cannot feed the model, read from its schema alone (None: it fits).

    :returns: (reason, detail): "wrong columns" (no caption or codes column, or one of the wrong type), "newer
      format", "unreadable metadata", "other codebook" (codes from a larger codebook than the model's), "other image
      size" (a code grid of another size)
    """
    fields = {field.name: field.type for field in schema}
    missing = [name for name in ("caption", "codes") if name not in fields]
    if missing:
        return "wrong columns", (f"no {' or '.join(missing)} column (it has {', '.join(fields) or 'none'}); "
                                 f"shards are made by `collab-kit preprocess`")
    caption, codes = fields["caption"], fields["codes"]
    if not (pa.types.is_string(caption) or pa.types.is_large_string(caption)):
        return "wrong columns", f"its captions are {caption}, not strings"
    if not (pa.types.is_binary(codes) or pa.types.is_large_binary(codes) or pa.types.is_fixed_size_binary(codes)):
        return "wrong columns", f"its codes are {codes}, not binary records of collab_kit's codec"
    source_id = fields.get("source_id")
    if source_id is not None and not (pa.types.is_string(source_id) or pa.types.is_large_string(source_id)
                                      or pa.types.is_integer(source_id)):
        return "wrong columns", f"its source ids are {source_id}, not strings"
    raw = (schema.metadata or {}).get(b"collab_kit")
    if not raw:
        return None  # shards of another tool: each sample's codes are checked as they are read
    try:
        metadata = json.loads(raw)
        if not isinstance(metadata, dict):
            raise ValueError(f"a {type(metadata).__name__}, not an object")
        recorded_format, recorded_codebook, side = (metadata.get(key) for key in ("format", "codebook_size",
                                                                                   "image_side"))
        for key, value in (("format", recorded_format), ("codebook_size", recorded_codebook), ("image_side", side)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{key} is {value!r}, not a count")
    except ValueError as e:
        return "unreadable metadata", f"its collab_kit metadata is not what write_shard records: {e}"
    if recorded_format is not None and recorded_format > SHARD_FORMAT:
        return "newer format", (f"written in shard format {recorded_format}, this collab_kit reads up to "
                                f"{SHARD_FORMAT}: upgrade collab_kit")
    if codebook_size is not None and recorded_codebook is not None and recorded_codebook > codebook_size:
        return "other codebook", (f"its codes come from a codebook of {recorded_codebook}, the model's holds "
                                  f"{codebook_size}")
    if image_length is not None and side is not None and side * side != image_length:
        return "other image size", f"its images are {side}x{side} codes, the model takes {image_length} codes"
    return None


# what _shard_rows yields, declared: datasets would otherwise infer it from the first rows
_ROW_FEATURES = datasets.Features(dict(caption=datasets.Value("string"), codes=datasets.Value("binary"),
                                       source=datasets.Value("string")))


def _shard_rows(shards: List[str], skipped: SkippedSamples, image_length: Optional[int] = None,
                codebook_size: Optional[int] = None) -> Iterator[dict]:
    """The rows of each shard in ``shards`` that fits the model (a generator for IterableDataset.from_generator):
    caption (str, or None when the shard holds none), codes (bytes or None) and source."""
    for path in shards:
        if path in skipped.shards:
            continue  # said once, skipped in every pass
        try:
            if path.startswith("hf://"):
                source = HfFileSystem().open(path[len("hf://"):], "rb")
            else:
                source = path
            parquet = pq.ParquetFile(source)
            misfit = shard_misfit(parquet.schema_arrow, image_length, codebook_size)
            if misfit is not None:
                skipped.shard_skipped(path, *misfit)
                continue
            columns = ["caption", "codes"] + (["source_id"] if "source_id" in parquet.schema_arrow.names else [])
            name = os.path.basename(path)
            for batch in parquet.iter_batches(batch_size=256, columns=columns):
                # captions as bytes: one that is not UTF-8 is one bad sample, not a shard that stops reading
                captions = batch.column("caption").cast(pa.large_binary()).to_pylist()
                codes = batch.column("codes").to_pylist()
                ids = (batch.column("source_id").to_pylist() if "source_id" in columns else
                       [None] * batch.num_rows)
                for row, (caption, record, source_id) in enumerate(zip(captions, codes, ids)):
                    source = f"{name}:{source_id if source_id is not None else row}"
                    if caption is not None:
                        try:
                            caption = caption.decode("utf-8")
                        except UnicodeDecodeError as e:
                            skipped.add("invalid caption", source, f"not UTF-8 ({e.reason})")
                            continue
                    yield dict(caption=caption, codes=record, source=source)
        except Exception as e:  # a damaged or vanished shard must not end training: the others go on
            skipped.shard_failed(path, e)


class ShardStream(torch.utils.data.IterableDataset):
    """An endless stream of training samples from parquet shards, shuffled, with bad samples skipped.

    The shards are read with a ``datasets`` streaming ``IterableDataset``: each pass visits the
    shards in a new order and mixes rows through a shuffle buffer; the order depends on ``seed``
    (each peer derives its own from its identity) and on the pass, so passes are repeatable. Rows
    are read as they are needed, from local files or over HTTP from a Hub dataset repository.

    Shards come from whoever published the dataset, so nothing in them may stop training. Before a shard is read,
    its schema is checked (``shard_misfit``: columns and their types, the codebook and grid it records): a shard
    that does not fit is skipped whole, named once in the log and counted in ``stream.skipped.shards``; so is one
    that cannot be read. Each sample is then decoded on its own: invalid codes (decompression bombs included:
    ``decode_codes`` never expands a record past the largest legal size), a wrong number of codes, codes outside
    the codebook, an empty caption or one the tokenizer cannot take are skipped and counted by reason in
    ``stream.skipped.counts``.

    :param shards: a folder of parquet shards, a glob, or a Hub dataset id ``user/name``
    :param text_length: captions are tokenized, cut and padded to this many tokens
    :param image_length: the number of codes every sample must hold
    :param tokenizer: turns captions into ids: ``encode(caption, length)`` (default: ByteCaptionTokenizer)
    :param codebook_size: codes must lie in [0, codebook_size) (default: not checked beyond int16)
    :param shuffle_buffer: rows held for shuffling; 1 disables shuffling within shards
    :param seed: the order's seed
    :param log_every: log a skipped reason on its first occurrence and then every this many
    """

    def __init__(self, shards: str, text_length: int, image_length: int, tokenizer=None,
                 shuffle_buffer: int = 1024, seed: int = 0, codebook_size: Optional[int] = None,
                 log_every: int = 1000):
        super().__init__()
        self.paths = list_shards(shards)
        self.text_length, self.image_length, self.codebook_size = text_length, image_length, codebook_size
        self.tokenizer = tokenizer if tokenizer is not None else ByteCaptionTokenizer()
        self.shuffle_buffer, self.seed = shuffle_buffer, seed
        self.skipped = SkippedSamples(log_every)
        self.passes = 0  # passes started over the shards
        self._rows = None  # the datasets pipeline, built at the first pass

    def _dataset(self):
        # datasets waits 5 s for its reader threads at the end of each shuffled pass; ours has none
        datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0.0
        rows = datasets.IterableDataset.from_generator(
            _shard_rows, features=_ROW_FEATURES,
            gen_kwargs=dict(shards=self.paths, skipped=self.skipped, image_length=self.image_length,
                            codebook_size=self.codebook_size))
        # seeds above 2**32 are folded: numpy's generators take 32-bit seeds here
        return rows.shuffle(seed=self.seed % 2 ** 32, buffer_size=self.shuffle_buffer)

    def _sample(self, row: dict) -> Optional[Dict[str, torch.Tensor]]:
        """A training sample, or None (counted) if the row is unusable."""
        caption, source = row["caption"], row["source"]
        if not isinstance(caption, str) or not caption.strip():
            self.skipped.add("empty caption", source, "no text")
            return None
        try:
            codes = decode_codes(row["codes"] or b"")
        except Exception as e:  # InvalidCodesError is all the codec raises; anything else is one bad sample too
            self.skipped.add("invalid codes", source, str(e))
            return None
        if codes.size != self.image_length:
            self.skipped.add("wrong number of codes", source, f"{codes.size} codes, the model takes {self.image_length}")
            return None
        if self.codebook_size is not None and codes.size and codes.max() >= self.codebook_size:
            self.skipped.add("codes outside the codebook", source,
                             f"code {codes.max()} in a codebook of {self.codebook_size}")
            return None
        try:
            tokens = torch.tensor(self.tokenizer.encode(caption, self.text_length), dtype=torch.long)
            if tokens.shape != (self.text_length,):
                raise ValueError(f"the tokenizer gave {tuple(tokens.shape)} ids where {self.text_length} were asked")
        except Exception as e:  # whatever a tokenizer raises on odd text, it is this sample's problem only
            self.skipped.add("invalid caption", source, f"{type(e).__name__}: {e}")
            return None
        return dict(text_tokens=tokens, image_codes=torch.from_numpy(codes))

    def one_pass(self) -> Iterator[Dict[str, torch.Tensor]]:
        """The usable samples of the next pass over every shard, each once, in this pass's order."""
        if self._rows is None:
            self._rows = self._dataset()
        self._rows.set_epoch(self.passes)
        self.passes += 1
        usable = 0
        for row in self._rows:
            sample = self._sample(row)
            if sample is not None:
                usable += 1
                yield sample
        logger.debug(f"finished pass {self.passes} over {len(self.paths)} shards ({usable} samples)")
        if usable == 0:
            raise RuntimeError(f"no usable sample in {len(self.paths)} shard(s): skipped samples {self.skipped.counts}, "
                               f"skipped shards {self.skipped.shards}; check that the shards were made for this "
                               f"model (image codes, codebook)")

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        while True:
            yield from self.one_pass()


def batches(stream: ShardStream, batch_size: int) -> Iterator[Dict[str, torch.Tensor]]:
    """Stack consecutive samples of ``stream`` into batches of ``batch_size``."""
    pending: List[Dict[str, torch.Tensor]] = []
    for sample in stream:
        pending.append(sample)
        if len(pending) == batch_size:
            yield {key: torch.stack([s[key] for s in pending]) for key in pending[0]}
            pending = []


# ---------------------------------------------------------------------------------------------
# a synthetic dataset for the demo and the tests

COLORS = ("red", "green", "blue", "yellow", "purple", "orange", "white", "black")
SHAPES = ("square", "cross", "stripe", "frame")


def _synthetic_image(color: int, shape: int, background: int, side: int, codebook_size: int,
                     rng: np.random.Generator) -> np.ndarray:
    """Codes of a made-up image: a shape of one color on a background of another.

    Each color owns a band of codes; the shape decides which cells take the shape's color. A few
    codes are noise, so the images are learnable but not trivially deterministic.
    """
    band = max(1, codebook_size // len(COLORS))
    rows, cols = np.mgrid[0:side, 0:side]
    centre, half = side / 2 - 0.5, max(1, side // 4)
    if shape == 0:
        mask = (np.abs(rows - centre) <= half) & (np.abs(cols - centre) <= half)
    elif shape == 1:
        mask = (np.abs(rows - centre) <= 0.5) | (np.abs(cols - centre) <= 0.5)
    elif shape == 2:
        mask = (rows % 2) == 0
    else:
        mask = (rows == 0) | (cols == 0) | (rows == side - 1) | (cols == side - 1)
    codes = np.where(mask, color * band, background * band) + rng.integers(0, min(2, band), size=(side, side))
    noise = rng.random((side, side)) < 0.05
    codes[noise] = rng.integers(0, codebook_size, size=int(noise.sum()))
    return codes.astype(np.int16) % codebook_size


def make_synthetic_shards(folder: str, num_samples: int, image_side: int, codebook_size: int,
                          num_shards: int = 4, seed: int = 0) -> List[str]:
    """Write ``num_samples`` captioned synthetic images as parquet shards; returns their paths.

    Captions read like "a red cross on blue"; the codes follow the caption, so a model that reads
    the caption can learn to predict them.
    """
    rng = np.random.default_rng(seed)
    per_shard = [num_samples // num_shards + (i < num_samples % num_shards) for i in range(num_shards)]
    paths = []
    for shard_index, count in enumerate(per_shard):
        captions, codes = [], []
        for _ in range(count):
            color, background = rng.choice(len(COLORS), size=2, replace=False)
            shape = int(rng.integers(len(SHAPES)))
            captions.append(f"a {COLORS[color]} {SHAPES[shape]} on {COLORS[background]}")
            codes.append(_synthetic_image(int(color), shape, int(background), image_side, codebook_size, rng))
        paths.append(write_shard(os.path.join(folder, f"shard-{shard_index:05d}.parquet"), captions, codes,
                                 codebook_size=codebook_size, image_side=image_side,
                                 source_ids=[f"synthetic-{shard_index}-{i}" for i in range(count)]))
    return paths


# synthetic pictures: what the demo sends through the whole path (images -> preprocess -> shards -> stream)

PALETTE = dict(red=(220, 30, 30), green=(30, 180, 60), blue=(40, 60, 220), yellow=(240, 220, 40),
               purple=(140, 40, 160), orange=(250, 140, 20), white=(245, 245, 245), black=(15, 15, 15))


def draw_synthetic_picture(color: str, shape: str, background: str, size: int = 32):
    """A PIL picture of ``shape`` (one of SHAPES) in ``color`` on ``background`` (names from COLORS)."""
    from PIL import Image, ImageDraw

    picture = Image.new("RGB", (size, size), PALETTE[background])
    draw, fill, quarter, last = ImageDraw.Draw(picture), PALETTE[color], size // 4, size - 1
    if shape == "square":
        draw.rectangle([quarter, quarter, last - quarter, last - quarter], fill=fill)
    elif shape == "cross":
        draw.rectangle([size // 2 - size // 16, 0, size // 2 + size // 16 - 1, last], fill=fill)
        draw.rectangle([0, size // 2 - size // 16, last, size // 2 + size // 16 - 1], fill=fill)
    elif shape == "stripe":
        for top in range(0, size, quarter):
            draw.rectangle([0, top, last, top + quarter // 2 - 1], fill=fill)
    elif shape == "frame":
        draw.rectangle([0, 0, last, last], outline=fill, width=max(1, size // 8))
    else:
        raise ValueError(f"shape={shape!r} is not known: choose one of {', '.join(SHAPES)}")
    return picture


def write_captioned_images(folder: str, pairs) -> str:
    """Save ``(PIL image, caption)`` pairs as PNG files plus ``captions.jsonl``, what ``collab-kit preprocess`` reads.

    The captions file is written last and atomically: a folder that has it is complete. Returns the folder.
    """
    os.makedirs(folder, exist_ok=True)
    lines = []
    for index, (image, caption) in enumerate(pairs):
        name = f"picture-{index:06d}.png"
        image.save(os.path.join(folder, name))
        lines.append(json.dumps(dict(file=name, caption=caption)))
    tmp_path = os.path.join(folder, "captions.jsonl.tmp")
    with open(tmp_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp_path, os.path.join(folder, "captions.jsonl"))
    return folder


def make_synthetic_images(folder: str, num_samples: int, size: int = 32, seed: int = 0) -> str:
    """Write ``num_samples`` captioned PNG pictures and a ``captions.jsonl`` (``write_captioned_images``).

    :returns: the folder
    """
    rng = np.random.default_rng(seed)

    def pairs():
        for _ in range(num_samples):
            color, background = rng.choice(len(COLORS), size=2, replace=False)
            shape = SHAPES[int(rng.integers(len(SHAPES)))]
            yield (draw_synthetic_picture(COLORS[color], shape, COLORS[background], size),
                   f"a {COLORS[color]} {shape} on {COLORS[background]}")
    return write_captioned_images(folder, pairs())
