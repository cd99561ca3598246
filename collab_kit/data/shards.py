"""Parquet shards: the files a run's samples live in, written whole or not at all, and found by folder, glob or Hub id.

A shard row holds ``caption`` (a string), ``codes`` (the image's codes through collab_kit.data.codec) and where the
sample came from; the file's metadata records the shard format, codebook size and code grid (and, for captions only
one tokenizer can read, that tokenizer), so a stream can turn away a shard made for another model before it reads a
row, and a volunteer can turn away a whole dataset before it trains (``misfit_for_run``).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from huggingface_hub import HfFileSystem
from huggingface_hub.errors import OfflineModeIsEnabled

from collab_kit.config import SettingFileMissing, SettingProblem
from collab_kit.data.codec import encode_codes

SHARD_FORMAT = 2  # 2: codes in the bit-packed codec above, with width / height / source_id columns
SHARD_SCHEMA = pa.schema(
    [
        ("caption", pa.string()),
        ("codes", pa.binary()),  # encode_codes(...) of the image's codes, raster order
        ("width", pa.int32()),  # the original image's size, before resizing and cropping (0 if unknown)
        ("height", pa.int32()),
        ("source_id", pa.string()),  # where the sample came from (file name, dataset row, ...)
    ]
)


def write_shard(
    path: str,
    captions: Sequence[str],
    codes: Sequence[np.ndarray],
    *,
    codebook_size: int | None = None,
    sizes: Sequence[tuple[int, int]] | None = None,
    source_ids: Sequence[str] | None = None,
    image_side: int | None = None,
    tokenizer: str | None = None,
) -> str:
    """Write one parquet shard; returns the path. The file appears whole or not at all.

    :param captions: one caption per sample
    :param codes: one array of image codes per sample
    :param codebook_size: the tokenizer's codebook, recorded in the file and used to pack the codes
    :param sizes: (width, height) of each original image (default: unknown, 0)
    :param source_ids: where each sample came from (default: its row number in this shard)
    :param image_side: the code grid's side, recorded in the file
    :param tokenizer: the caption tokenizer the captions are written for (``data.tokenizer``), recorded where only
      one can read them (the toy world's words); None: any tokenizer
    """
    count = len(captions)
    sizes = sizes if sizes is not None else [(0, 0)] * count
    source_ids = source_ids if source_ids is not None else [str(i) for i in range(count)]
    if not len(codes) == len(sizes) == len(source_ids) == count:
        raise ValueError(
            f"got {count} captions, {len(codes)} code arrays, {len(sizes)} sizes and "
            f"{len(source_ids)} source ids: expected one of each per sample"
        )
    metadata = dict(format=SHARD_FORMAT, codebook_size=codebook_size, image_side=image_side)
    if tokenizer is not None:
        metadata["tokenizer"] = tokenizer
    schema = SHARD_SCHEMA.with_metadata({b"collab_kit": json.dumps(metadata).encode()})
    table = pa.table(
        {
            "caption": list(captions),
            "codes": [encode_codes(c, codebook_size) for c in codes],
            "width": [int(w) for w, _ in sizes],
            "height": [int(h) for _, h in sizes],
            "source_id": [str(i) for i in source_ids],
        },
        schema=schema,
    )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp_path = path + ".tmp"
    # the codes are compressed already and unique: no compression, dictionary or min / max statistics for them
    # (those would cost ~9 bytes per sample); captions and the rest compress well with zstd
    small_columns = ["caption", "width", "height", "source_id"]
    pq.write_table(
        table,
        tmp_path,
        compression=dict(caption="zstd", codes="none", width="zstd", height="zstd", source_id="zstd"),
        use_dictionary=small_columns,
        write_statistics=small_columns,
    )
    os.replace(tmp_path, path)  # a crash never leaves a half-written shard under the real name
    return path


def shard_metadata(path: str) -> dict:
    """What ``write_shard`` recorded in a shard (``format``, ``codebook_size``, ``image_side``, maybe ``tokenizer``); {}
    for a shard of another tool. ``path`` may be an ``hf://`` path: only the file's footer is read."""
    if path.startswith("hf://"):
        with HfFileSystem().open(path[len("hf://") :], "rb") as f:
            schema = pq.read_schema(f)
    else:
        schema = pq.read_schema(path)
    raw = (schema.metadata or {}).get(b"collab_kit")
    return json.loads(raw) if raw else {}


class DataSourceError(SettingProblem):
    """The data a setting names cannot be read: a Hub dataset out of reach (offline, missing, private) or no shards
    where it points; the message says which and what to do."""


class DataSourceMissing(DataSourceError, SettingFileMissing):
    """Nothing is where the data setting points (no folder, no repository, no shard): caught as FileNotFoundError
    too."""


def is_hub_dataset(source: str) -> bool:
    """``user/name`` (or ``hf://datasets/user/name``) that is not a local path: a Hub dataset repository."""
    if source.startswith("hf://datasets/"):
        return True
    return (
        source.count("/") == 1
        and not os.path.exists(source)
        and not source.startswith((".", "/", "~"))
        and not any(char in source for char in "*?[]")
    )


def _hub_shards(repo: str) -> list[str]:
    """The parquet files of the Hub dataset ``repo``; every way the Hub can be out of reach is one sentence."""
    try:
        return sorted("hf://" + path for path in HfFileSystem().glob(f"datasets/{repo}/**/*.parquet"))
    except FileNotFoundError:  # HfFileSystem's word for a repository the Hub says is not there, or private
        raise DataSourceMissing(
            f"the Hub dataset {repo!r} does not exist, or it is private: check its name, and "
            f"for a private one log in (`hf auth login`, or HF_TOKEN) as a user who may read "
            f"it"
        ) from None
    except OfflineModeIsEnabled:
        raise DataSourceError(
            f"the Hub dataset {repo!r} cannot be read while Hugging Face's offline mode is on "
            f"(HF_HUB_OFFLINE=1): unset it, or use a local copy of its shards"
        ) from None
    except Exception as e:  # httpx's and requests' connection errors, timeouts, a proxy's answer: the Hub is away
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise DataSourceError(
            f"could not reach the Hugging Face Hub for the dataset {repo!r} ({reason}): check "
            f"this machine's Internet connection, or use a local copy of its shards"
        ) from None


def list_shards(shards: str) -> list[str]:
    """The parquet files of a local folder, a glob, or a Hub dataset repository (``hf://`` paths), sorted.

    :raises DataSourceMissing: no shard there (a FileNotFoundError too)
    :raises DataSourceError: a Hub dataset that cannot be reached: offline mode, no connection, missing or private
      (tests/cli/test_join_errors.py, against the stand-in Hub and with none)
    """
    if is_hub_dataset(shards):
        repo = shards[len("hf://datasets/") :] if shards.startswith("hf://") else shards
        paths = _hub_shards(repo)
        where = f"the Hub dataset {repo!r}"
    elif os.path.isdir(shards):
        paths = sorted(glob.glob(os.path.join(shards, "**", "*.parquet"), recursive=True))
        where = f"the folder {shards!r}"
    else:
        paths = sorted(glob.glob(shards, recursive=True))
        where = f"{shards!r}"
    if not paths:
        raise DataSourceMissing(
            f"no parquet shards found in {where}: pass a folder of .parquet files, a glob, or a "
            f"Hub dataset id (user/name); `collab-kit preprocess` makes shards from images, and "
            f"collab_kit.data.synthetic.make_synthetic_shards makes a demo dataset"
        )
    return paths


def misfit_for_run(
    paths: Sequence[str], codebook_size: int, image_side: int, tokenizer: str, most: int = 8
) -> str | None:
    """Why shards cannot feed a run whose model reads ``codebook_size`` codes on an ``image_side`` grid and whose
    captions go through ``tokenizer`` (None: they fit), from the metadata of the first ``most`` shards: a newer
    format, another codebook (a codebook of another size is another VQGAN), another grid, captions written for
    another tokenizer. Shards of another tool record nothing: their samples are checked as they are read.
    Shown by tests/data/test_data.py::test_shards_of_another_codebook_grid_tokenizer_or_format_do_not_fit_a_run."""
    for path in list(paths)[:most]:
        recorded = shard_metadata(path)
        name = os.path.basename(path)
        shard_format, codebook, side = (recorded.get(key) for key in ("format", "codebook_size", "image_side"))
        if isinstance(shard_format, int) and shard_format > SHARD_FORMAT:
            return (
                f"{name} is in shard format {shard_format}, and this collab_kit reads up to {SHARD_FORMAT}: "
                f"upgrade collab_kit"
            )
        if isinstance(codebook, int) and codebook != codebook_size:
            return (
                f"the codes of {name} come from a codebook of {codebook}, and the run's model reads a codebook "
                f"of {codebook_size}"
            )
        if isinstance(side, int) and side != image_side:
            return f"{name} holds images of {side}x{side} codes, and the run's model draws {image_side}x{image_side}"
        written_for = recorded.get("tokenizer")
        if isinstance(written_for, str) and written_for != tokenizer:
            return (
                f"the captions of {name} are written for the {written_for!r} tokenizer, and the run tokenizes "
                f"with {tokenizer!r}"
            )
    return None
