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
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

logger = logging.getLogger(__name__)

MAX_CODEBOOK_SIZE = 2 ** 16  # a code is stored in at most 16 bits
MAX_CODES_PER_IMAGE = 2 ** 16 - 1  # the count is stored in 16 bits
_BROTLI_FLAG = 0x80  # header bit: the payload is Brotli-compressed


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
        candidates.append(bytes([bits | _BROTLI_FLAG]) + header_count + brotli.compress(packed, quality=quality))
    return min(candidates, key=len)


def decode_codes(data: bytes, expected_length: Optional[int] = None) -> np.ndarray:
    """The codes ``encode_codes`` stored, as a flat int64 array.

    :param expected_length: if given, raise a ValueError when the sample holds another number of codes
    """
    if len(data) < 3 or not 1 <= (data[0] & ~_BROTLI_FLAG) <= 16:
        raise ValueError("a sample's codes are not in collab_kit's format (a header of bits per code and a "
                         "count): the shard is corrupt or was written by something else")
    bits, count, payload = data[0] & ~_BROTLI_FLAG, int.from_bytes(data[1:3], "little"), data[3:]
    if data[0] & _BROTLI_FLAG:
        try:
            payload = brotli.decompress(payload)
        except brotli.error as e:
            raise ValueError(f"a sample's codes are not valid Brotli data ({e}): the shard is corrupt") from None
    try:
        codes = _unpack(payload, bits, count)
    except ValueError as e:
        raise ValueError(f"a sample's codes are damaged: it {e}") from None
    if expected_length is not None and codes.size != expected_length:
        raise ValueError(f"a sample holds {codes.size} image codes but the model expects {expected_length}: "
                         f"the shards were made for another image size")
    return codes


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
        from huggingface_hub import HfFileSystem

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
    """What a stream skipped, by reason, and the shards it could not read; logged at most once per ``log_every``."""

    REASONS = ("invalid codes", "wrong number of codes", "codes outside the codebook", "empty caption")

    def __init__(self, log_every: int = 1000):
        self.counts: Dict[str, int] = {reason: 0 for reason in self.REASONS}
        self.unreadable_shards: List[str] = []
        self.log_every = log_every

    def add(self, reason: str, source: str, detail: str) -> None:
        self.counts[reason] += 1
        count = self.counts[reason]
        if count == 1 or count % self.log_every == 0:
            logger.warning(f"skipped sample {source} ({reason}: {detail}); {count} skipped for this reason so far")

    def shard_failed(self, path: str, error: Exception) -> None:
        if path not in self.unreadable_shards:
            self.unreadable_shards.append(path)
            logger.error(f"cannot read shard {path} ({type(error).__name__}: {error}); skipping it")

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _shard_rows(shards: List[str], skipped: SkippedSamples) -> Iterator[dict]:
    """The raw rows of each shard in ``shards`` (a generator for datasets.IterableDataset.from_generator)."""
    for path in shards:
        try:
            if path.startswith("hf://"):
                from huggingface_hub import HfFileSystem

                source = HfFileSystem().open(path[len("hf://"):], "rb")
            else:
                source = path
            columns = ["caption", "codes", "source_id"]
            parquet = pq.ParquetFile(source)
            if "source_id" not in parquet.schema_arrow.names:  # shards written before source ids
                columns = columns[:2]
            for batch in parquet.iter_batches(batch_size=256, columns=columns):
                values = batch.to_pydict()
                ids = values.get("source_id") or [str(i) for i in range(batch.num_rows)]
                for caption, codes, source_id in zip(values["caption"], values["codes"], ids):
                    yield dict(caption=caption, codes=codes, source=f"{os.path.basename(path)}:{source_id}")
        except Exception as e:  # a damaged or vanished shard must not end training: the others go on
            skipped.shard_failed(path, e)


class ShardStream(torch.utils.data.IterableDataset):
    """An endless stream of training samples from parquet shards, shuffled, with bad samples skipped.

    The shards are read with a ``datasets`` streaming ``IterableDataset``: each pass visits the
    shards in a new order and mixes rows through a shuffle buffer; the order depends on ``seed``
    (each peer derives its own from its identity) and on the pass, so passes are repeatable. Rows
    are read as they are needed, from local files or over HTTP from a Hub dataset repository.

    A bad sample never stops training: invalid codes, a wrong number of codes, codes outside the
    codebook or an empty caption are skipped and counted in ``stream.skipped.counts``; a shard that
    cannot be read is reported by name (``stream.skipped.unreadable_shards``) and skipped.

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

    def _dataset(self):
        import datasets

        # datasets waits 5 s for its reader threads at the end of each shuffled pass; ours has none
        datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0.0
        rows = datasets.IterableDataset.from_generator(_shard_rows, gen_kwargs=dict(shards=self.paths,
                                                                                    skipped=self.skipped))
        # seeds above 2**32 are folded: numpy's generators take 32-bit seeds here
        return rows.shuffle(seed=self.seed % 2 ** 32, buffer_size=self.shuffle_buffer)

    def _sample(self, row: dict) -> Optional[Dict[str, torch.Tensor]]:
        """A training sample, or None (counted) if the row is unusable."""
        caption, source = row["caption"], row["source"]
        if not caption or not caption.strip():
            self.skipped.add("empty caption", source, "no text")
            return None
        try:
            codes = decode_codes(row["codes"] or b"")
        except ValueError as e:
            self.skipped.add("invalid codes", source, str(e))
            return None
        if codes.size != self.image_length:
            self.skipped.add("wrong number of codes", source, f"{codes.size} codes, the model takes {self.image_length}")
            return None
        if self.codebook_size is not None and codes.size and codes.max() >= self.codebook_size:
            self.skipped.add("codes outside the codebook", source,
                             f"code {codes.max()} in a codebook of {self.codebook_size}")
            return None
        return dict(text_tokens=torch.tensor(self.tokenizer.encode(caption, self.text_length)),
                    image_codes=torch.from_numpy(codes))

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        dataset = self._dataset()
        while True:
            dataset.set_epoch(self.passes)
            self.passes += 1
            usable = 0
            for row in dataset:
                sample = self._sample(row)
                if sample is not None:
                    usable += 1
                    yield sample
            logger.debug(f"finished pass {self.passes} over {len(self.paths)} shards ({usable} samples)")
            if usable == 0:
                raise RuntimeError(f"no usable sample in {len(self.paths)} shard(s): skipped {self.skipped.counts}, "
                                   f"unreadable shards {self.skipped.unreadable_shards}; check that the shards "
                                   f"were made for this model (image codes, codebook)")


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
