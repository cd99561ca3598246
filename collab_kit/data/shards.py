"""Parquet shards: the files a run's samples live in, written whole or not at all, and found by folder, glob or Hub id.

A shard row holds ``caption`` (a string), ``codes`` (the image's codes through collab_kit.data.codec) and where the
sample came from; the file's metadata records the shard format, codebook size and code grid, so a stream can turn
away a shard made for another model before it reads a row.
"""
from __future__ import annotations

import glob
import json
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from huggingface_hub import HfFileSystem

from collab_kit.data.codec import encode_codes

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
                                f"collab_kit.data.synthetic.make_synthetic_shards makes a demo dataset")
    return paths
