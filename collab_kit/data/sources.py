"""Where image-caption pairs come from: folders, WebDataset tars, parquet files, saved and Hub datasets.

``read_pairs`` yields each source's pairs (``Pair``) in a fixed order, before any filter; collab_kit.data.preprocess
filters, encodes and shards them. Sources (``read_pairs``; the kind is found from the path, or given as
``source_format``):

- ``folder``: a folder of images (``.jpg .jpeg .png .webp .bmp``, subfolders included, in the order of their
  relative paths) with their captions in ONE of
  ``captions.jsonl`` (one ``{"file": "cats/1.jpg", "caption": "a cat"}`` per line),
  ``captions.tsv`` (``cats/1.jpg<TAB>a cat`` per line) or ``captions.csv`` (``cats/1.jpg,a cat``, CSV quoting),
  each with paths relative to the folder and an optional header line ``file / caption``;
  or, without a captions file, in a sidecar ``NAME.txt`` beside each ``NAME.jpg``.
- ``webdataset``: a WebDataset ``.tar`` (or ``.tar.gz``), or a folder of them (what img2dataset writes):
  members ``KEY.jpg|jpeg|png|webp|bmp`` with ``KEY.txt`` or ``KEY.json`` (its ``"caption"`` or ``"text"``, and
  the NSFW label if it has one), read as a stream.
- ``parquet``: a ``.parquet`` file or a folder of them, with an image column (bytes, or ``{"bytes": ...}`` as
  ``datasets`` stores its Image feature), a caption column and an optional NSFW column (LAION's ``NSFW``).
- ``disk``: a folder written by ``datasets.Dataset.save_to_disk``; ``hub``: a Hub dataset id (``user/name``),
  streamed with ``datasets.load_dataset(..., streaming=True)``; the Python API also takes a ``datasets``
  ``Dataset`` or ``IterableDataset``. Columns as for parquet.
"""

from __future__ import annotations

import csv
import io
import json
import os
import posixpath
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import fsspec
import pyarrow.parquet as pq
from PIL import Image

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp")
CAPTION_FILES = ("captions.jsonl", "captions.tsv", "captions.csv")
IMAGE_COLUMNS = ("image", "jpg", "jpeg", "png", "webp", "img")  # tried in this order when none is named
CAPTION_COLUMNS = ("caption", "text", "TEXT", "txt")
NSFW_COLUMNS = ("NSFW", "nsfw")
SOURCE_FORMATS = ("folder", "webdataset", "parquet", "disk", "hub")

ImageLike = None | str | bytes | dict | Image.Image


@dataclass
class Pair:
    """One image-caption pair as a source yields it, before any filter.

    :param source_id: where it came from: the image's path in a folder, its key in a tar, ``file:row`` of a parquet
      file, or its row number in a dataset
    :param caption: the caption (None if the pair has none)
    :param image: a local path, encoded bytes, ``{"bytes": ..., "path": ...}``, a PIL image, or None
    :param nsfw: the NSFW label (LAION's ``UNLIKELY`` / ``UNSURE`` / ``NSFW``), None where there is none
    """

    source_id: str
    caption: str | None
    image: ImageLike
    nsfw: str | None = None


def open_image(image: ImageLike) -> Image.Image:
    """A PIL image (lazily loaded: the header only, until its pixels are asked for) from what a source yields."""
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, dict):  # datasets' Image feature, not decoded: {"bytes": ..., "path": ...}
        image = image.get("bytes") if image.get("bytes") is not None else image.get("path")
    if isinstance(image, (bytes, bytearray, memoryview)):
        return Image.open(io.BytesIO(bytes(image)))
    if isinstance(image, (str, os.PathLike)):
        if "://" in os.fspath(image):  # an image file in a remote dataset (hf://...)
            with fsspec.open(os.fspath(image), "rb") as f:
                return Image.open(io.BytesIO(f.read()))
        return Image.open(image)
    raise TypeError(f"cannot read an image from {type(image).__name__}")


def image_header_size(image: ImageLike) -> tuple[int, int]:
    opened = open_image(image)
    try:
        return opened.size
    finally:
        if opened is not image:
            opened.close()


# ---------------------------------------------------------------------------------------------
# sources


@dataclass(frozen=True)
class PairSource:
    """Where image-caption pairs come from and how to read them: ``collab-kit preprocess``'s source options.

    :param location: a folder, a ``.tar`` / ``.parquet`` file, a Hub dataset id, or a ``datasets`` dataset
    :param format: one of ``SOURCE_FORMATS``; by default found from ``location``
    :param captions_file: for a folder: the captions file to use (default: the folder's ``captions.jsonl``,
      ``.tsv`` or ``.csv``, else sidecar ``.txt`` files)
    :param image_column: the image column (default: the first of ``IMAGE_COLUMNS`` there is)
    :param caption_column: the caption column (default: the first of ``CAPTION_COLUMNS``)
    :param nsfw_column: the NSFW label column (default: the first of ``NSFW_COLUMNS``, if any)
    :param split: the split of a Hub or saved dataset
    :param max_samples: read at most this many pairs (the paper used LAION's first 100M); None: all
    """

    location: object
    format: str | None = None
    captions_file: str | None = None
    image_column: str | None = None
    caption_column: str | None = None
    nsfw_column: str | None = None
    split: str = "train"
    max_samples: int | None = None

    def __post_init__(self):
        if self.format is not None and self.format not in SOURCE_FORMATS:
            raise ValueError(f"unknown source format {self.format!r}: expected one of {', '.join(SOURCE_FORMATS)}")
        if self.max_samples is not None and self.max_samples < 0:
            raise ValueError(f"max_samples must be at least 0, got {self.max_samples}")

    def describe(self) -> str:
        return repr(self.location) if isinstance(self.location, (str, os.PathLike)) else type(self.location).__name__

    def open(self) -> tuple[Iterator[Pair], int | None]:
        """(the pairs, how many there are if known without reading them all); checked as ``read_pairs`` says."""
        return open_source(self)


def read_pairs(source, **options) -> Iterator[Pair]:
    """The image-caption pairs of ``source``, in a fixed order, unfiltered. See the module's docstring.

    The source is checked before this returns (a missing folder, a folder without images, a captions file that
    names a missing image, an unknown column: ``FileNotFoundError`` / ``ValueError`` saying what to do).

    :param source: a ``PairSource``, or its location (a folder, a ``.tar`` / ``.parquet`` file, a Hub dataset id, or a
      ``datasets`` dataset)
    :param options: the other fields of ``PairSource`` (``format``, ``captions_file``, ``caption_column``, ...)
    """
    source = source if isinstance(source, PairSource) else PairSource(source, **options)
    pairs, _ = source.open()
    return pairs


def open_source(source: PairSource) -> tuple[Iterator[Pair], int | None]:
    """(the pairs of ``source``, how many there are if known without reading them all)."""
    source_format, captions_file, nsfw_column, split = (
        source.format,
        source.captions_file,
        source.nsfw_column,
        source.split,
    )
    columns = dict(image_column=source.image_column, caption_column=source.caption_column, nsfw_column=nsfw_column)
    source = source.location
    if not isinstance(source, (str, os.PathLike)):  # a datasets Dataset / IterableDataset
        if not hasattr(source, "column_names") or not hasattr(source, "__iter__"):
            raise TypeError(f"expected a path, a Hub dataset id or a datasets dataset, got {type(source).__name__}")
        return _dataset_pairs(source, **columns), _length(source)
    source = os.fspath(source)
    kind = source_format or _detect_format(source)
    if kind != "hub" and not os.path.exists(source):
        raise FileNotFoundError(f"no such folder or file: {source!r}")
    if kind == "folder":
        return _folder_pairs(source, captions_file)
    if captions_file is not None:
        raise ValueError("a captions file goes with a folder of images; other sources carry their captions")
    if kind == "webdataset":
        tars = _files(source, (".tar", ".tar.gz", ".tgz"), "WebDataset .tar")
        return _tar_pairs(tars, nsfw_column or NSFW_COLUMNS[0]), None
    if kind == "parquet":
        files = _files(source, (".parquet",), "parquet")
        return _parquet_pairs(files, source, **columns)
    # lazy: datasets takes seconds to import; only these sources need it
    import datasets

    if kind == "disk":
        dataset = datasets.load_from_disk(source)
        if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
            if split not in dataset:
                raise ValueError(f"{source!r} has no split {split!r}: its splits are {', '.join(dataset)} (--split)")
            dataset = dataset[split]
        return _dataset_pairs(dataset, **columns), _length(dataset)
    try:
        dataset = datasets.load_dataset(source, split=split, streaming=True)
    except (datasets.exceptions.DatasetNotFoundError, FileNotFoundError, ConnectionError) as e:
        raise FileNotFoundError(
            f"no local folder or file {source!r}, and no Hub dataset of that name could be "
            f"opened ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    return _dataset_pairs(dataset, **columns), None


def _length(dataset) -> int | None:
    try:
        return len(dataset)
    except TypeError:  # an IterableDataset
        return None


def _detect_format(source: str) -> str:
    if os.path.isfile(source):
        if source.endswith((".tar", ".tar.gz", ".tgz")):
            return "webdataset"
        if source.endswith(".parquet"):
            return "parquet"
        raise ValueError(
            f"cannot tell how to read {source!r}: expected a folder of images, a WebDataset .tar, "
            f"a .parquet file, a saved dataset or a Hub dataset id"
        )
    if os.path.isdir(source):
        if any(os.path.isfile(os.path.join(source, name)) for name in ("state.json", "dataset_dict.json")):
            return "disk"
        has_tars = has_parquet = False
        for _, _, names in os.walk(source):
            if any(_is_image_file(name) for name in names):
                return "folder"
            has_tars = has_tars or any(name.endswith((".tar", ".tar.gz", ".tgz")) for name in names)
            has_parquet = has_parquet or any(name.endswith(".parquet") for name in names)
        if has_tars:  # img2dataset writes metadata parquet files beside its tars: the tars hold the images
            return "webdataset"
        if has_parquet:
            return "parquet"
        raise ValueError(
            f"{source!r} holds no images ({', '.join(IMAGE_EXTENSIONS)}), WebDataset .tar files, "
            f"parquet files or saved dataset: put the image files there, or pass another source"
        )
    if source.count("/") == 1 and not source.startswith((".", "/", "~")):
        return "hub"
    raise FileNotFoundError(f"no such folder or file: {source!r}")


def _files(source: str, suffixes: tuple[str, ...], what: str) -> list[str]:
    if os.path.isfile(source):
        return [source]
    files = sorted(
        os.path.join(parent, name) for parent, _, names in os.walk(source) for name in names if name.endswith(suffixes)
    )
    if not files:
        raise ValueError(f"no {what} files in {source!r}")
    return files


def _is_image_file(name: str) -> bool:
    return not name.startswith(".") and name.rpartition(".")[2].lower() in IMAGE_EXTENSIONS and "." in name


# folders of images


def _folder_pairs(folder: str, captions_file: str | None) -> tuple[Iterator[Pair], int]:
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no such folder: {folder!r}")
    images = []
    for parent, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        images += [
            os.path.relpath(os.path.join(parent, name), folder).replace(os.sep, "/")
            for name in names
            if _is_image_file(name)
        ]
    images.sort()
    if not images:
        raise ValueError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) in {folder!r}")
    if captions_file is None:
        found = [name for name in CAPTION_FILES if os.path.isfile(os.path.join(folder, name))]
        if len(found) > 1:
            raise ValueError(
                f"{folder!r} holds {' and '.join(found)}: keep one captions file, or name it with --captions"
            )
        captions_file = os.path.join(folder, found[0]) if found else None
    if captions_file is not None:
        captions = _read_captions_file(captions_file)
        known = set(images)
        missing = [name for name in captions if name not in known]
        if missing:
            raise ValueError(
                f"{captions_file} names {len(missing)} image(s) that {folder!r} does not hold, "
                f"e.g. {missing[0]!r}: fix the file names in it (paths relative to the folder)"
            )

        def pairs() -> Iterator[Pair]:
            for name in images:
                yield Pair(name, captions.get(name), os.path.join(folder, name))

        return pairs(), len(images)

    def sidecar(name: str) -> str:
        return os.path.join(folder, os.path.splitext(name)[0] + ".txt")

    if not any(os.path.isfile(sidecar(name)) for name in images):
        raise ValueError(
            f"{folder!r} holds images but no captions: add {' / '.join(CAPTION_FILES)} "
            f"or a NAME.txt beside each NAME.jpg"
        )

    def sidecar_pairs() -> Iterator[Pair]:
        for name in images:
            caption = None
            if os.path.isfile(sidecar(name)):
                with open(sidecar(name), encoding="utf-8", errors="replace") as f:
                    caption = f.read()
            yield Pair(name, caption, os.path.join(folder, name))

    return sidecar_pairs(), len(images)


def _read_captions_file(path: str) -> dict[str, str]:
    """{image path relative to the folder: caption} from a captions.jsonl / .tsv / .csv file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such captions file: {path!r}")
    rows: list[tuple[int, str, str]] = []  # (line, file, caption)
    with open(path, encoding="utf-8", newline="") as f:
        if path.endswith(".jsonl"):
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                    rows.append((line_number, entry["file"], entry["caption"]))
                except (ValueError, KeyError, TypeError):
                    example = json.dumps({"file": "cats/1.jpg", "caption": "a cat"})
                    raise ValueError(
                        f'{path}, line {line_number}: expected a JSON object with "file" and "caption", e.g. {example}'
                    ) from None
        elif path.endswith((".tsv", ".csv")):
            reader = csv.reader(
                f,
                delimiter="\t" if path.endswith(".tsv") else ",",
                quoting=csv.QUOTE_NONE if path.endswith(".tsv") else csv.QUOTE_MINIMAL,
            )
            for row in reader:
                if not row or not "".join(row).strip():
                    continue
                if len(row) < 2:
                    separator = "a tab" if path.endswith(".tsv") else "a comma"
                    raise ValueError(f"{path}, line {reader.line_num}: expected FILE, {separator}, CAPTION")
                if not rows and [cell.strip().lower() for cell in row[:2]] == ["file", "caption"]:
                    continue  # the header line
                separator = "\t" if path.endswith(".tsv") else ","
                rows.append((reader.line_num, row[0], separator.join(row[1:])))
        else:
            raise ValueError(f"{path!r}: a captions file is .jsonl, .tsv or .csv")
    captions: dict[str, str] = {}
    lines: dict[str, int] = {}
    for line_number, name, caption in rows:
        name = posixpath.normpath(str(name).strip().replace("\\", "/"))
        if name in captions:
            raise ValueError(
                f"{path} names {name!r} twice (lines {lines[name]} and {line_number}): one caption per image"
            )
        captions[name], lines[name] = (str(caption) if caption is not None else None), line_number
    return captions


# WebDataset tars


def _tar_pairs(paths: Sequence[str], nsfw_key: str) -> Iterator[Pair]:
    """Samples of WebDataset tars: consecutive members with the same key (the name up to its first dot)."""
    wanted = set(IMAGE_EXTENSIONS) | {"txt", "json"}
    for path in paths:
        try:
            with tarfile.open(path, "r|*") as tar:  # a stream: members are read once, in order
                key, parts = None, {}
                for member in tar:
                    if not member.isfile():
                        continue
                    folder, name = posixpath.split(member.name)
                    if name.startswith("."):  # ._ files of macOS, and the like
                        continue
                    stem, _, extension = name.partition(".")
                    member_key = posixpath.join(folder, stem)
                    if member_key != key:
                        if parts:
                            yield _tar_pair(key, parts, nsfw_key)
                        key, parts = member_key, {}
                    if extension.lower() in wanted:
                        parts[extension.lower()] = tar.extractfile(member).read()
                if parts:
                    yield _tar_pair(key, parts, nsfw_key)
        except tarfile.TarError as e:
            raise ValueError(f"{path!r} is not a readable tar file ({e}): is the download complete?") from None


def _tar_pair(key: str, parts: dict[str, bytes], nsfw_key: str) -> Pair:
    image = next((parts[extension] for extension in IMAGE_EXTENSIONS if extension in parts), None)
    caption = nsfw = None
    if "json" in parts:
        try:
            metadata = json.loads(parts["json"])
        except ValueError:
            metadata = {}
        if isinstance(metadata, dict):
            caption = metadata.get("caption", metadata.get("text"))
            nsfw = metadata.get(nsfw_key)
    if "txt" in parts:
        caption = parts["txt"].decode("utf-8", errors="replace")
    return Pair(key, None if caption is None else str(caption), image, nsfw)


# parquet files and datasets


def _pick_column(
    names: Sequence[str], requested: str | None, candidates: Sequence[str], what: str, required: bool
) -> str | None:
    if requested is not None:
        if requested not in names:
            raise ValueError(f"no {what} column {requested!r}: the columns are {', '.join(names)}")
        return requested
    for candidate in candidates:
        if candidate in names:
            return candidate
    if required:
        raise ValueError(
            f"found no {what} column ({' / '.join(candidates)}) among {', '.join(names)}: name it with --{what}-column"
        )
    return None


def _parquet_pairs(
    files: Sequence[str], source: str, image_column, caption_column, nsfw_column
) -> tuple[Iterator[Pair], int]:
    names = pq.read_schema(files[0]).names
    image = _pick_column(names, image_column, IMAGE_COLUMNS, "image", required=True)
    caption = _pick_column(names, caption_column, CAPTION_COLUMNS, "caption", required=True)
    nsfw = _pick_column(names, nsfw_column, NSFW_COLUMNS, "nsfw", required=False)
    columns = [image, caption] + ([nsfw] if nsfw else [])
    total = 0
    for path in files:
        missing = [column for column in (image, caption) if column not in pq.read_schema(path).names]
        if missing:
            raise ValueError(
                f"{path} has no column {', '.join(missing)} (the first file has): "
                f"all parquet files must have the same columns"
            )
        total += pq.ParquetFile(path).metadata.num_rows

    def pairs() -> Iterator[Pair]:
        for path in files:
            name = (
                os.path.basename(path) if os.path.isfile(source) else os.path.relpath(path, source).replace(os.sep, "/")
            )
            parquet_file = pq.ParquetFile(path)
            present = [column for column in columns if column in parquet_file.schema_arrow.names]
            row = 0
            for batch in parquet_file.iter_batches(batch_size=64, columns=present):
                values = {column: batch.column(column).to_pylist() for column in present}
                for i in range(batch.num_rows):
                    yield Pair(
                        f"{name}:{row}",
                        values[caption][i],
                        values[image][i],
                        values[nsfw][i] if nsfw in values else None,
                    )
                    row += 1

    return pairs(), total


def _dataset_pairs(dataset, image_column, caption_column, nsfw_column) -> Iterator[Pair]:
    """Rows of a ``datasets`` Dataset / IterableDataset (row number = source id), images left undecoded."""
    # lazy: datasets takes seconds to import; only these sources need it
    import datasets

    names = list(dataset.column_names or [])
    if not names:  # a streamed dataset whose features are not known before its first row
        names = list(next(iter(dataset), None) or {})
    image = _pick_column(names, image_column, IMAGE_COLUMNS, "image", required=True)
    caption = _pick_column(names, caption_column, CAPTION_COLUMNS, "caption", required=True)
    nsfw = _pick_column(names, nsfw_column, NSFW_COLUMNS, "nsfw", required=False)
    features = getattr(dataset, "features", None) or {}
    if isinstance(features.get(image), datasets.Image) and features[image].decode:
        # the bytes as stored: the header tells the size without decoding, and skipped shards decode nothing
        dataset = dataset.cast_column(image, datasets.Image(decode=False))

    def pairs() -> Iterator[Pair]:
        for index, row in enumerate(dataset):
            text = row.get(caption)
            yield Pair(str(index), None if text is None else str(text), row.get(image), row.get(nsfw) if nsfw else None)

    return pairs()
