"""Training samples: the code codec, caption tokens, and a stream of batches from parquet shards.

A shard row holds ``caption`` (a string) and ``codes`` (the image's VQGAN codes as little-endian
int16, compressed with Brotli; the paper streams these instead of images, about 18x fewer bytes).
Every peer reads the shards in its own shuffled order, so peers contribute different samples.
"""
from __future__ import annotations

import glob
import logging
import os
from typing import Dict, Iterator, List, Optional, Sequence

import brotli
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

logger = logging.getLogger(__name__)

SHARD_SCHEMA = pa.schema([("caption", pa.string()), ("codes", pa.binary())])
MAX_CODEBOOK_SIZE = 2 ** 15  # codes are stored as int16


# ---------------------------------------------------------------------------------------------
# the code codec: int16 codes <-> brotli bytes


def encode_codes(codes: np.ndarray, quality: int = 11) -> bytes:
    """Compress one image's codes (any integer array with values in [0, 32767]) to Brotli bytes."""
    codes = np.asarray(codes)
    if codes.size and (codes.min() < 0 or codes.max() >= MAX_CODEBOOK_SIZE):
        raise ValueError(f"codes must lie in [0, {MAX_CODEBOOK_SIZE}) to be stored as int16, "
                         f"got values in [{codes.min()}, {codes.max()}]")
    return brotli.compress(codes.astype("<i2").tobytes(), quality=quality)


def decode_codes(data: bytes, expected_length: Optional[int] = None) -> np.ndarray:
    """Decompress Brotli bytes back to a flat int16 array of codes.

    :param expected_length: if given, raise a ValueError when the sample holds another number of codes
    """
    try:
        raw = brotli.decompress(data)
    except brotli.error as e:
        raise ValueError(f"a sample's codes are not valid Brotli data ({e}): the shard is corrupt or was not "
                         f"written by collab_kit") from None
    codes = np.frombuffer(raw, dtype="<i2")
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


# ---------------------------------------------------------------------------------------------
# shards


def write_shard(path: str, captions: Sequence[str], codes: Sequence[np.ndarray]) -> str:
    """Write one parquet shard of (caption, compressed codes) rows; returns the path."""
    if len(captions) != len(codes):
        raise ValueError(f"got {len(captions)} captions but {len(codes)} code arrays")
    table = pa.table({"caption": list(captions), "codes": [encode_codes(c) for c in codes]}, schema=SHARD_SCHEMA)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp_path = path + ".tmp"
    pq.write_table(table, tmp_path)
    os.replace(tmp_path, path)  # a crash never leaves a half-written shard under the real name
    return path


def list_shards(shards: str) -> List[str]:
    """The parquet files of a folder, or those matching a glob, sorted."""
    if os.path.isdir(shards):
        paths = sorted(glob.glob(os.path.join(shards, "**", "*.parquet"), recursive=True))
    else:
        paths = sorted(glob.glob(shards, recursive=True))
    if not paths:
        raise FileNotFoundError(f"no parquet shards found at {shards!r}: pass a folder of .parquet files or a glob, "
                                f"or make a demo dataset with collab_kit.data.make_synthetic_shards")
    return paths


class ShardStream(torch.utils.data.IterableDataset):
    """An endless stream of training samples from parquet shards, shuffled with a buffer.

    Each pass visits the shards in a new random order; rows go through a shuffle buffer so that
    consecutive samples come from different places. Different ``seed`` values (one per peer) give
    different orders.

    :param shards: a folder of parquet shards or a glob
    :param text_length: captions are tokenized, cut and padded to this many tokens
    :param image_length: the number of codes every sample must hold
    :param tokenizer: turns captions into ids (default: ByteCaptionTokenizer)
    :param shuffle_buffer: rows held for shuffling; 1 disables shuffling
    :param seed: the order's seed
    """

    def __init__(self, shards: str, text_length: int, image_length: int, tokenizer=None,
                 shuffle_buffer: int = 1024, seed: int = 0):
        super().__init__()
        self.paths = list_shards(shards)
        self.text_length, self.image_length = text_length, image_length
        self.tokenizer = tokenizer if tokenizer is not None else ByteCaptionTokenizer()
        self.shuffle_buffer, self.seed = shuffle_buffer, seed

    def _rows(self, rng: np.random.Generator) -> Iterator[Dict[str, torch.Tensor]]:
        passes = 0
        while True:
            for path in rng.permutation(self.paths):
                for batch in pq.ParquetFile(path).iter_batches(batch_size=256, columns=["caption", "codes"]):
                    for caption, data in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
                        codes = decode_codes(data, self.image_length)
                        yield dict(
                            text_tokens=torch.tensor(self.tokenizer.encode(caption, self.text_length)),
                            image_codes=torch.from_numpy(codes.astype(np.int64)),
                        )
            passes += 1
            logger.debug(f"finished pass {passes} over {len(self.paths)} shards")

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        rng = np.random.default_rng(self.seed)
        buffer: List[Dict[str, torch.Tensor]] = []
        for row in self._rows(rng):
            if len(buffer) < self.shuffle_buffer:
                buffer.append(row)
                continue
            index = int(rng.integers(len(buffer)))
            yield buffer[index]
            buffer[index] = row


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
        paths.append(write_shard(os.path.join(folder, f"shard-{shard_index:05d}.parquet"), captions, codes))
    return paths
